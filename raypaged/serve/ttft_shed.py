"""The router's TTFT-SLO shedding (`--ttft-slo-s`): core/ttft_slo.py's rule on the fleet snapshot.

Checked once per request after its prompts are tokenized and before any Generation starts, so a
shed request has cost the fleet nothing: 503 with a `Retry-After` from the best worker's queue,
counted as raypaged:shed_requests{reason="ttft_slo"} and in /fleet's `shed_requests`.

The snapshot lags the workers by up to a poll and a refresh (~0.75 s): a burst arriving within
one snapshot would all read the same queues and all be admitted. So this router adds what it
admitted since the snapshot to the queue of the worker the rule picked for it (the one that
would start it soonest, where cost-aware routing sends it), until the next snapshot counts it.
"""
from __future__ import annotations

from typing import Callable

from raypaged.core.ttft_slo import WorkerQueue, decide
from raypaged.serve.errors import APIError
from raypaged.serve.fleet import FleetSnapshot
from raypaged.serve.metrics import RequestMetrics

TTFT_SLO = "ttft_slo"  # the reason label


class TTFTShedder:
    def __init__(self, slo_s: float, snapshot: Callable[[], FleetSnapshot],
                 metrics: RequestMetrics) -> None:
        self.slo_s, self.snapshot, self.metrics = slo_s, snapshot, metrics
        self._version = -1
        self._admitted: dict[str, int] = {}  # worker id -> prompt tokens sent since the snapshot

    def check(self, prompt_tokens: int) -> None:
        """Raises a 503 APIError when the fleet predicts a TTFT over the SLO; else counts the
        prompt against the worker predicted to start it soonest."""
        snap = self.snapshot()
        if snap.version != self._version:
            self._version, self._admitted = snap.version, {}
        ready = [w for w in snap.ready() if w.stats is not None]
        queues = [WorkerQueue(w.stats.engine.num_queued_tokens + self._admitted.get(w.worker_id, 0),
                              w.drain_tokens_per_s) for w in ready]
        decision = decide(self.slo_s, prompt_tokens, queues)
        if decision is None:  # no drain rate measured yet: nothing to predict with
            return
        best, refusal = decision
        if refusal is not None:
            self.metrics.inc("shed_requests", TTFT_SLO)
            raise APIError(
                503, f"the server is overloaded: this request's time to first token is "
                     f"predicted at {refusal.predicted_s:.1f} s on the least loaded worker, over "
                     f"the server's TTFT objective of {self.slo_s:g} s (the setting ttft_slo_s, "
                     f"--ttft-slo-s); retry after {refusal.retry_after_s} s",
                code="ttft_slo_exceeded", retry_after=refusal.retry_after_s)
        wid = ready[best].worker_id
        self._admitted[wid] = self._admitted.get(wid, 0) + prompt_tokens
