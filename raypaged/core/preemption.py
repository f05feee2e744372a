"""Whom to preempt when a running request needs a block and none is free, and what it cost.

Preempting the newest running request, under steady pressure, preempts the same request again
and again (a preemption storm). The bounded rule instead takes the request whose recompute is
cheapest (the least computed work) among those preempted fewer than K times; a request
preempted K times is chosen again only when every candidate has been, and then the
fewest-preempted first. A preempted request goes back into the waiting queue at its arrival's
place, so it resumes before everyone who arrived after it (FCFS by arrival).
"""
from __future__ import annotations

from typing import Callable, Iterable

from raypaged.core.contracts import PreemptionStats
from raypaged.core.request import Request
from raypaged.core.request_queue import RequestQueue


def choose_victim(candidates: Iterable[Request], protect_after: int) -> Request:
    """Unprotected first, then the fewest preemptions; the least computed work; the newest."""
    def cost(r: Request):
        protected = r.num_preemptions >= protect_after
        return (protected, r.num_preemptions if protected else 0, r.num_computed_tokens,
                -r.arrival, -r.sample_index)
    return min(candidates, key=cost)


def requeue_by_arrival(waiting: RequestQueue, req: Request) -> None:
    """Put a preempted request back before every waiting request that arrived after it."""
    key = (req.arrival, req.sample_index)
    later = (i for i, other in enumerate(waiting) if (other.arrival, other.sample_index) > key)
    waiting.insert(next(later, len(waiting)), req)


class PreemptionCounters:
    """Recomputed work, preemptions per request and time spent preempted, kept at each event."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.computed_tokens = 0
        self.recomputed_tokens = 0
        self.preempted_seconds = 0.0
        self.per_request: list[int] = [0]  # [k]: finished sequences preempted k times

    def scheduled(self, req: Request, start: int, n: int) -> None:
        """req computes positions start..start+n-1; those below its old high-water mark were
        computed before a preemption (a prefix hit on resume skips them: not counted)."""
        self.computed_tokens += n
        self.recomputed_tokens += max(0, min(start + n, req.num_lost_tokens) - start)

    def preempted(self, req: Request) -> None:
        # KV of known tokens only: a placeholder's token is sampled again, not recomputed
        req.num_lost_tokens = max(req.num_lost_tokens,
                                  min(req.num_computed_tokens, req.num_tokens))
        req.preempted_at = self.clock()

    def resumed(self, req: Request) -> None:
        if req.preempted_at is not None:
            self.preempted_seconds += self.clock() - req.preempted_at
            req.preempted_at = None

    def finished(self, req: Request) -> None:
        self.resumed(req)  # finished (aborted) while preempted: that time counts too
        k = req.num_preemptions
        self.per_request.extend([0] * (k + 1 - len(self.per_request)))  # none when long enough
        self.per_request[k] += 1

    def stats(self) -> PreemptionStats:
        return PreemptionStats(self.computed_tokens, self.recomputed_tokens,
                               self.preempted_seconds, tuple(self.per_request))
