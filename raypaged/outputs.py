"""What the engine hands its callers (offline LLM, worker actor) after each step."""
from __future__ import annotations

from dataclasses import dataclass, field

from raypaged.core.contracts import TokenLogprobs


@dataclass(frozen=True)
class SequenceOutput:
    """The new part of one sample (index) of one request, produced by one engine step."""

    request_id: str                      # the id given to Engine.add_request
    index: int                           # which of the request's n samples (0..n-1)
    new_token_ids: tuple[int, ...]
    new_text: str                        # detokenized delta; stop strings never leak into it
    new_logprobs: tuple[TokenLogprobs, ...] = ()
    finish_reason: str | None = None     # "stop" | "length" | "abort"; None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0           # prompt tokens served from the prefix cache

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class CompletionOutput:
    """One of a request's n samples, accumulated (vLLM's shape)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, out: SequenceOutput) -> None:
        self.text += out.new_text
        self.token_ids.extend(out.new_token_ids)
        if out.new_logprobs:
            self.logprobs = self.logprobs or []
            self.logprobs.extend(out.new_logprobs)
        if out.finished:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)
