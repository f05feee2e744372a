"""OpenAI response shapes: choices (whole or as stream deltas), logprobs, usage, SSE framing."""
from __future__ import annotations

import functools
import itertools
import json
import re
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

import anyio
from starlette.responses import StreamingResponse

from raypaged.outputs import SequenceOutput
from raypaged.serve.prompt_bound import byte_level_alphabet

# On every reply where a worker was chosen: the one(s) that finished the request (after a
# failover, the last), or that refused it.
WORKER_HEADER = "x-raypaged-worker"


@dataclass
class Choice:
    """The accumulated output of one sample (all of it, or one stream chunk's worth)."""

    text: list[str] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: object = None
    offset: int = 0  # characters of the sample's text before this (a stream's earlier chunks)

    def add(self, out: SequenceOutput) -> None:
        self.text.append(out.new_text)
        self.logprobs.extend(out.new_logprobs)
        self.token_ids.extend(out.new_token_ids)
        if out.finish_reason is not None:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def token_bytes(tokenizer) -> Callable[[int], bytes]:
    """token id -> the bytes it stands for (cached: a vocabulary is small): chat logprobs'
    `bytes`, which OpenAI gives so that a client can join the bytes of consecutive tokens into
    the text when one character spans several tokens.

    Byte-level BPE (GPT-2's scheme: SmolLM2, Llama 3, Qwen) splits UTF-8 sequences, and such a
    token decoded alone is U+FFFD, whose bytes are not the token's: its vocabulary string is the
    bytes, each drawn as one printable character (`byte_level_alphabet`). SentencePiece's byte
    fallback names a lone byte `<0xE6>`. Any other token is its decoded text."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    byte_level = type(decoder).__name__ == "ByteLevel"
    added = set(tokenizer.get_added_vocab().values()) if byte_level else set()
    table = byte_level_alphabet()
    piece_of = getattr(tokenizer, "convert_ids_to_tokens", lambda token_id: "")

    @functools.lru_cache(maxsize=65536)
    def of(token_id: int) -> bytes:
        piece = piece_of(token_id)
        if byte_level and token_id not in added and all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        if fallback := _BYTE_FALLBACK.fullmatch(piece or ""):
            return bytes([int(fallback[1], 16)])
        return tokenizer.decode([token_id]).encode()
    return of


class Shapes:
    """Builds choice dicts; decodes single tokens for logprobs (cached: a vocabulary is small)."""

    def __init__(self, tokenizer):
        self.token_text = functools.lru_cache(maxsize=65536)(
            lambda token_id: tokenizer.decode([token_id]))
        self.token_bytes = token_bytes(tokenizer)

    def completion_choice(self, want_logprobs: bool, index: int, c: Choice,
                          whole: bool = False, *, token_ids: bool = False) -> dict:
        return {"index": index, "text": "".join(c.text),
                "logprobs": self._completion_logprobs(c) if want_logprobs else None,
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                **({"token_ids": c.token_ids} if token_ids else {})}

    def chat_choice(self, want_logprobs: bool, index: int, c: Choice, whole: bool = False, *,
                    token_ids: bool = False) -> dict:
        text = "".join(c.text)
        if whole:
            part = {"message": {"role": "assistant", "content": text}}
        else:
            part = {"delta": {"content": text} if text or c.finish_reason is None else {}}
        return {"index": index, **part,
                "logprobs": {"content": self._chat_logprobs(c)} if want_logprobs else None,
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                **({"token_ids": c.token_ids} if token_ids else {})}

    def _completion_logprobs(self, c: Choice) -> dict:
        tokens = [self.token_text(lp.token_id) for lp in c.logprobs]
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in c.logprobs],
                "top_logprobs": [{self.token_text(t): v for t, v in lp.top} for lp in c.logprobs],
                # each token's start in the sample's whole text
                "text_offset": list(itertools.accumulate(map(len, tokens),
                                                         initial=c.offset))[:-1]}

    def _chat_logprobs(self, c: Choice) -> list[dict]:
        def entry(token_id: int, logprob: float) -> dict:
            return {"token": self.token_text(token_id), "logprob": logprob,
                    "bytes": list(self.token_bytes(token_id))}
        return [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                for lp in c.logprobs]


def usage(gens) -> dict:
    prompt = sum(len(g.token_ids) for g in gens)
    completion = sum(g.num_output_tokens for g in gens)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(g.num_cached_tokens for g in gens)}}


def workers_header(gens) -> dict:
    return {WORKER_HEADER: ",".join(dict.fromkeys(g.worker_id for g in gens))}


# Characters that json.dumps(ensure_ascii=False) leaves as they are and str.splitlines() ends a
# line at (so does httpx's iter_lines()): escaped, so that every reader sees one SSE event per
# data line and one record per JSONL line. They occur only inside JSON strings, where the
# escape means the same character.
_LINE_BREAKS = re.compile("[\x85\u2028\u2029]")


def json_line(obj) -> str:
    """obj as one line of JSON that no line splitter cuts (other non-ASCII stays as it is)."""
    return _LINE_BREAKS.sub(lambda m: f"\\u{ord(m[0]):04x}", json.dumps(obj, ensure_ascii=False))


def sse_data(obj: dict) -> str:
    return f"data: {json_line(obj)}\n\n"


class SSEResponse(StreamingResponse):
    """A stream that is closed the moment its sending ends. A client that leaves while a
    chunk is being sent cancels the send with the body generator suspended at its `yield`;
    Starlette leaves it open then, and the garbage collector may finalize it (and abort its
    requests) only after they have run to their last token."""

    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(send)
        finally:
            with anyio.CancelScope(shield=True):  # the abort must run inside a cancelled scope
                await self.body_iterator.aclose()


def sse_response(events: AsyncIterator[str], headers: dict) -> StreamingResponse:
    return SSEResponse(events, media_type="text/event-stream",
                       headers={**headers, "Cache-Control": "no-cache"})
