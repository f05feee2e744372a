"""OutputProcessor: the engine's token ids -> text deltas, stop strings and finish reasons.

Single-threaded state: either `Engine.step` calls it in line, or the output stage
(output_stage.py) runs it on its own thread while the step thread goes on to the next step.
Either way it sees every RequestDelta of every sequence in order, and its results are the same.

A stop string is found here, after core has already sampled the token that completes it, so the
sequence may still be running in core. `process` then ends the sample in its outputs at once and
returns the core abort to perform; until core's own final delta for that sequence arrives, any
further deltas of it (tokens sampled after the stop, when the abort comes a step late) are
dropped, so the outputs never carry tokens, logprobs or text past the stop.
"""
from __future__ import annotations

from typing import Sequence

from raypaged.core.contracts import RequestDelta
from raypaged.core.engine_core import ERROR
from raypaged.core.sampling_params import SamplingParams
from raypaged.outputs import SequenceOutput


PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded with the first outputs, for correct spacing


class IncrementalDetokenizer:
    """Incremental detokenization with stop strings.

    Decoding only the newest token breaks multi-byte characters and word-joining tokenizers, so each
    step decodes a short window (prefix_offset..end) and emits what it adds over (prefix_offset..
    read_offset); text ending in U+FFFD (an incomplete UTF-8 sequence) waits for the next token.
    Stop strings: while running, the last len(longest stop) - 1 characters are held back, so a stop
    string that completes later never leaks into text already streamed; as in vLLM, one counts only
    once the output is longer than min_tokens. Special tokens and the
    token that ended the sample: see SamplingParams.skip_special_tokens.
    """

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.skip_special = params.skip_special_tokens
        self.ids = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        # As vLLM: a stop string counts only once the output is longer than min_tokens, and
        # must end past the text of its first min_tokens tokens (min_chars characters).
        self.min_tokens = params.min_tokens
        self.num_tokens = 0
        self.min_chars = 0
        self.text = ""          # all decoded output text (cut at a stop string once found)
        self.emitted = 0        # characters of self.text already returned
        self.stop_reason: str | None = None

    def add(self, token_ids: Sequence[int], finished: bool = False,
            stop_terminated: bool = False) -> str:
        """Feed new tokens; returns the new text that is safe to show. `stop_terminated`: the
        last of them ended the sample (EOS or a stop token)."""
        if stop_terminated and not self.include_stop:
            token_ids = token_ids[:-1]  # "</s>" is no part of the answer
        if self.stop_reason is None:
            for t in token_ids:
                self.ids.append(t)
                self._decode_tail()
                self.num_tokens += 1
                if self.num_tokens <= self.min_tokens:
                    self.min_chars = len(self.text)
                elif self._find_stop():
                    break
        done = finished or self.stop_reason is not None
        end = len(self.text) if done else max(self.emitted, len(self.text) - self.hold)
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta

    def resume(self, token_ids: Sequence[int], text_chars: int) -> None:
        """Carry on a sample begun elsewhere: replay its tokens (the text is a function of the
        tokens alone), of which the first `text_chars` characters were already shown."""
        self.add(token_ids)
        if not 0 <= text_chars <= len(self.text) or self.stop_reason is not None:
            raise ValueError(f"continuation text_chars={text_chars} does not fit the "
                             f"{len(self.text)} characters its tokens decode to")
        self.emitted = text_chars

    def _decode_tail(self) -> None:
        dec = self.tokenizer.decode
        skip = self.skip_special
        prefix = dec(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=skip)
        full = dec(self.ids[self.prefix_offset:], skip_special_tokens=skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)

    def _find_stop(self) -> bool:
        if not self.stop:
            return False
        # only the new characters (plus a stop's length of overlap) can complete a stop string
        start = max(0, self.emitted - self.hold - 1)
        hits = [(i, s) for s in self.stop
                if (i := self.text.find(s, max(start, self.min_chars - len(s) + 1))) != -1]
        if not hits:
            return False
        i, s = min(hits)
        self.text = self.text[:i + len(s)] if self.include_stop else self.text[:i]
        self.stop_reason = s
        return True


class _Sequence:
    """Tokenizer-side state of one sample of one request."""

    __slots__ = ("request_id", "index", "detok", "num_prompt_tokens")

    def __init__(self, request_id: str, index: int, detok: IncrementalDetokenizer, n_prompt: int):
        self.request_id, self.index, self.detok, self.num_prompt_tokens = request_id, index, detok, n_prompt


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._seqs: dict[str, _Sequence] = {}    # core sequence id -> state
        self._prompts: dict[str, tuple[list[int], SamplingParams]] = {}  # for forked samples
        self._live: dict[str, int] = {}  # request id -> its samples tracked here
        # Sequences this processor finished (stop string, detokenizer error) whose final delta
        # from core has not arrived yet: their later deltas are dropped.
        self._ended_here: set[str] = set()

    def add(self, request_id: str, prompt: list[int], params: SamplingParams, index: int,
            detok: IncrementalDetokenizer) -> None:
        """Track a new request's first sample (index), with its detokenizer (resumed, for a
        continuation)."""
        self._prompts[request_id] = (prompt, params)
        self._seqs[request_id] = _Sequence(request_id, index, detok, len(prompt))
        self._live[request_id] = 1

    def tracks(self, request_id: str) -> bool:
        return request_id in self._prompts

    def process(self, deltas: Sequence[RequestDelta]
                ) -> tuple[list[SequenceOutput], list[tuple[str, str]]]:
        """This step's deltas -> (outputs, core aborts to perform as (sequence id, reason))."""
        for d in deltas:
            if d.request_id not in self._seqs and d.request_id not in self._ended_here:
                # A forked sample seen for the first time. Track every new sample before any
                # finish is handled: when all samples end in the step that forks them
                # (max_tokens=1, say), forgetting the first would drop the prompt the others need.
                prompt, params = self._prompts[d.parent_id]
                detok = IncrementalDetokenizer(self.tokenizer, prompt, params)
                self._seqs[d.request_id] = _Sequence(d.parent_id, d.sample_index, detok,
                                                     len(prompt))
                self._live[d.parent_id] += 1
        outs, aborts = [], []
        for d in deltas:
            if d.request_id in self._ended_here:
                if d.finish_reason is not None:  # core's last word on it: nothing more comes
                    self._ended_here.discard(d.request_id)
                continue
            seq = self._seqs[d.request_id]
            finish, stop_reason = d.finish_reason, d.stop_reason
            try:
                text = seq.detok.add(d.new_token_ids, finished=finish is not None,
                                     stop_terminated=finish == "stop")
            except Exception as exc:  # noqa: BLE001 - this sample's text failed, not the engine
                text, finish = "", ERROR
                stop_reason = f"the request failed in the detokenizer: {type(exc).__name__}: {exc}"
                if d.finish_reason is None:
                    aborts.append((d.request_id, ERROR))
            # a stop string found in this delta's text names the stop, as in vLLM, also when
            # core ended the sample on a stop token whose kept text completed it
            if seq.detok.stop_reason is not None and finish in (None, "length", "stop"):
                if finish is None:  # still running in core: end this sample only
                    aborts.append((d.request_id, "stop"))
                finish, stop_reason = "stop", seq.detok.stop_reason
            if finish is not None and d.finish_reason is None:
                self._ended_here.add(d.request_id)
            outs.append(SequenceOutput(
                request_id=seq.request_id, index=seq.index, new_token_ids=d.new_token_ids,
                new_text=text, new_logprobs=d.new_logprobs, finish_reason=finish,
                stop_reason=stop_reason, num_prompt_tokens=seq.num_prompt_tokens,
                num_cached_tokens=d.num_cached_tokens))
            if finish is not None:
                self._forget(d.request_id, seq.request_id)
        return outs, aborts

    def _forget(self, seq_id: str, request_id: str) -> None:
        # Core forks all n samples in one step, and process() tracks them all before handling
        # any finish: once no sample of the request is tracked here, none will come.
        del self._seqs[seq_id]
        self._live[request_id] -= 1
        if not self._live[request_id]:
            del self._live[request_id]
            self._prompts.pop(request_id, None)
