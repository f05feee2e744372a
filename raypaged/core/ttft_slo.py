"""TTFT-SLO load shedding: refuse a request at the edge when no worker could start it in time.

A request's time to first token is, on a loaded worker, mostly the wait for the tokens queued
ahead of it (prompts admitted, prompts blocked on KV blocks, preempted work to recompute):

    predicted TTFT on w = (queued_w + prompt) / drain_rate_w

`queued_w` is the scheduler's num_queued_tokens (EngineStats); `drain_rate_w` is how fast that
queue shrinks while it has work: queue tokens computed per second (EngineStats.
num_prefill_tokens: prompt and recompute, not decode), measured online per worker from the
counters every poll brings (`DrainRate`), over the polls during which the worker never ran out of
queued work. KV pressure shows there: a worker whose blocks are full admits a queued prompt only
as running requests finish, and its drain rate falls with that pace. No constant is hand-set.

The request is shed (503 + Retry-After) when even the best worker predicts more than the SLO and
something is queued there: a request the idle fleet would serve late anyway (its own prompt
longer than the SLO's worth of prefill) is never shed, since retrying it could not help. This is
Dynamo's rule (reject only when every worker is busy), with the busy threshold put in seconds of
TTFT. Workers whose rate is not measured yet take the mean of the measured ones; a fleet with
none measured sheds nothing.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from raypaged.core.autoscale_policy import saturated_rate

RETRY_AFTER_MAX_S = 60


class DrainRate:
    """One worker's queue drain rate in tokens per second: an exponential moving average over
    the poll intervals in which it drained at full speed (it had at least as many queued tokens
    at the start as it computed by the end). Sticky through idle polls; starts afresh when the
    worker's process does (its counters do)."""

    def __init__(self, alpha: float = 0.3) -> None:
        self.alpha = alpha
        self.tokens_per_s = 0.0  # 0: not measured yet
        self._last: tuple[float, int, int, str] | None = None  # time, counter, queued, process

    def observe(self, now_s: float, prefill_tokens: int, queued_tokens: int,
                incarnation: str) -> float:
        """One poll's counters; returns the rate after it."""
        last, self._last = self._last, (now_s, prefill_tokens, queued_tokens, incarnation)
        if last is None or last[3] != incarnation:
            if last is not None:
                self.tokens_per_s = 0.0  # a new process: its speed is measured again
            return self.tokens_per_s
        rate = saturated_rate(last[2], prefill_tokens - last[1], now_s - last[0])
        if rate is not None:
            self.tokens_per_s = rate if self.tokens_per_s == 0 else (
                (1 - self.alpha) * self.tokens_per_s + self.alpha * rate)
        return self.tokens_per_s


@dataclass(frozen=True)
class WorkerQueue:
    """One ready worker as the shedding rule sees it."""

    queued_tokens: int
    tokens_per_s: float  # its drain rate; 0: not measured


@dataclass(frozen=True)
class Shed:
    """The rule's refusal: the best worker's prediction and when to come back."""

    predicted_s: float
    retry_after_s: int
    worker: int  # index of the best worker in the list given


def _rates(workers: Sequence[WorkerQueue]) -> list[float] | None:
    """Each worker's drain rate, the mean measured one for those not measured; None: none is."""
    measured = [w.tokens_per_s for w in workers if w.tokens_per_s > 0]
    if not measured:
        return None
    fallback = sum(measured) / len(measured)
    return [w.tokens_per_s if w.tokens_per_s > 0 else fallback for w in workers]


def best_worker(prompt_tokens: int, workers: Sequence[WorkerQueue]
                ) -> tuple[int, float] | None:
    """(index, predicted TTFT in seconds) of the worker that would start this prompt soonest;
    None when no worker's rate is measured (nothing to predict with)."""
    rates = _rates(workers)
    if rates is None:
        return None
    predicted = [(w.queued_tokens + prompt_tokens) / r for w, r in zip(workers, rates)]
    i = min(range(len(workers)), key=predicted.__getitem__)
    return i, predicted[i]


def shed(slo_s: float, prompt_tokens: int, workers: Sequence[WorkerQueue]) -> Shed | None:
    """A Shed if this prompt is predicted to start later than `slo_s` on every worker because of
    the work queued there; None to admit it."""
    found = best_worker(prompt_tokens, workers)
    if found is None:
        return None
    i, predicted = found
    queued = workers[i].queued_tokens
    if predicted <= slo_s or queued <= 0:
        return None
    rate = _rates(workers)[i]
    # the queue may hold this much when the prompt arrives and still start within the SLO
    room = max(0.0, slo_s * rate - prompt_tokens)
    wait = (queued - room) / rate
    return Shed(predicted, max(1, min(RETRY_AFTER_MAX_S, math.ceil(wait))), i)
