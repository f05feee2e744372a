"""Incremental detokenization with stop strings.

Decoding only the newest token breaks multi-byte characters and word-joining tokenizers, so each
step decodes a short window (prefix_offset..end) and emits what it adds over (prefix_offset..
read_offset); text ending in U+FFFD (an incomplete UTF-8 sequence) waits for the next token.
Stop strings: while running, the last len(longest stop) - 1 characters are held back, so a stop
string that completes later never leaks into text already streamed; as in vLLM, one counts only
once the output is longer than min_tokens. Special tokens and the
token that ended the sample: see SamplingParams.skip_special_tokens.
"""
from __future__ import annotations

from typing import Sequence

PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded with the first outputs, for correct spacing


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], stop: Sequence[str] = (),
                 include_stop_str_in_output: bool = False,
                 skip_special_tokens: bool = True, min_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        self.ids = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = tuple(stop)
        self.include_stop = include_stop_str_in_output
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        # As vLLM: a stop string counts only once the output is longer than min_tokens, and
        # must end past the text of its first min_tokens tokens (min_chars characters).
        self.min_tokens = min_tokens
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
