"""Progress: what the client has of one generation's n samples, and the router-side request
metrics (TTFT, inter-token latency, TPOT, end-to-end) their outputs make as they pass.

Failover continues each unfinished sample from exactly what is recorded here (its tokens and
how many characters of text the client has)."""
from __future__ import annotations

import dataclasses
import time

from raypaged.outputs import SequenceOutput
from raypaged.serve.metrics import RequestMetrics


@dataclasses.dataclass
class Sample:
    token_ids: list[int] = dataclasses.field(default_factory=list)
    text_chars: int = 0
    finish_reason: str | None = None
    last_token_at: float | None = None


class Progress:
    def __init__(self, n: int, arrival: float, metrics: RequestMetrics):
        self.samples = [Sample() for _ in range(n)]
        self.arrival = arrival
        self.metrics = metrics
        self.num_cached_tokens = 0
        self.num_output_tokens = 0
        self._first_token_at: float | None = None

    @property
    def done(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)

    def observe(self, outs: list[SequenceOutput], resumed: bool) -> None:
        """Outputs about to reach the client. `resumed`: from a continuation, whose cached
        tokens are not the prompt's."""
        now = time.monotonic()
        for out in outs:
            sample = self.samples[out.index]
            if not resumed:
                self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
            if out.new_token_ids:
                if sample.last_token_at is not None:  # this sample's gap, per token it brought
                    gap = (now - sample.last_token_at) / len(out.new_token_ids)
                    for _ in out.new_token_ids:
                        self.metrics.observe("inter_token_latency_seconds", gap)
                sample.last_token_at = now
                sample.token_ids.extend(out.new_token_ids)
                self.num_output_tokens += len(out.new_token_ids)
                if self._first_token_at is None:
                    self._first_token_at = now
                    self.metrics.observe("time_to_first_token_seconds", now - self.arrival)
            sample.text_chars += len(out.new_text)
            if out.finish_reason is not None:
                sample.finish_reason = out.finish_reason

    def record_finished(self, num_prompt_tokens: int) -> None:
        """The request is over (finished, failed or left by its client)."""
        m, n = self.metrics, len(self.samples)
        m.observe("e2e_request_latency_seconds", time.monotonic() - self.arrival)
        if self._first_token_at is not None and self.num_output_tokens > n:
            last = max(s.last_token_at or 0.0 for s in self.samples)  # the latest token's
            m.observe("time_per_output_token_seconds",
                      (last - self._first_token_at) / (self.num_output_tokens / n - 1))
        m.inc("prompt_tokens", value=num_prompt_tokens)
        m.inc("generation_tokens", value=self.num_output_tokens)
        m.inc("request_success", self.samples[0].finish_reason or "abort")
