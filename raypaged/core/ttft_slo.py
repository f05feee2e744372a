"""TTFT-SLO load shedding: refuse a request at the edge when no worker could start it in time.

A request's time to first token is, on a loaded worker, mostly the wait for the tokens queued
ahead of it (prompts admitted, prompts blocked on KV blocks, preempted work to recompute):

    predicted TTFT on w = (queued_w + prompt) / drain_rate_w

`queued_w` is the scheduler's num_queued_tokens (EngineStats); `drain_rate_w` is how fast that
queue shrinks while it has work (`DrainRate`), so KV pressure shows there: a worker whose blocks
are full admits a queued prompt only as running requests finish.

The request is shed (503 + Retry-After) when even the best worker predicts more than the SLO and
something is queued there: a request the idle fleet would serve late anyway (its own prompt
longer than the SLO's worth of prefill) is never shed, since retrying it could not help.
Workers whose rate is not measured yet take the mean of the measured ones; a fleet with none
measured sheds nothing.
"""
from __future__ import annotations

import collections
import math
from dataclasses import dataclass
from typing import Sequence


RETRY_AFTER_MAX_S = 60


class DrainRate:
    """One worker's queue drain rate in tokens per second: the queue tokens it computed
    (EngineStats.num_prefill_tokens: prompt and recompute, not decode) over its last `window_s`
    seconds of backlogged poll intervals (requests waiting at both ends), divided by their
    length. A sum over intervals, not an average of their rates: a worker whose KV cache is
    full admits prompts in bursts, and the intervals between them weigh as much. Sticky
    through idle polls; starts afresh with the worker's process. None until `min_s` of backlog
    is measured; 0.0 is a measurement (requests waited that long and none started)."""

    def __init__(self, window_s: float = 10.0, min_s: float = 1.0) -> None:
        self.window_s, self.min_s = window_s, min_s
        self._intervals: collections.deque[tuple[float, int]] = collections.deque()
        self._seconds = 0.0
        self._tokens = 0
        self._last: tuple[float, int, int, str] | None = None  # time, counter, waiting, process

    @property
    def tokens_per_s(self) -> float | None:
        return self._tokens / self._seconds if self._seconds >= self.min_s else None

    def observe(self, now_s: float, prefill_tokens: int, num_waiting: int,
                incarnation: str) -> float | None:
        """One poll's counters (EngineStats.num_prefill_tokens, num_waiting); returns the rate
        after it."""
        last, self._last = self._last, (now_s, prefill_tokens, num_waiting, incarnation)
        if last is not None and last[3] != incarnation:
            self._intervals.clear()  # a new process: its speed is measured again
            self._seconds, self._tokens = 0.0, 0
        elif last is not None and last[2] > 0 and num_waiting > 0 and now_s > last[0]:
            dt, n = now_s - last[0], max(0, prefill_tokens - last[1])
            self._intervals.append((dt, n))
            self._seconds += dt
            self._tokens += n
            while self._seconds - self._intervals[0][0] >= self.window_s:
                old_dt, old_n = self._intervals.popleft()
                self._seconds -= old_dt
                self._tokens -= old_n
        return self.tokens_per_s


@dataclass(frozen=True)
class WorkerQueue:
    """One ready worker as the shedding rule sees it."""

    queued_tokens: int
    tokens_per_s: float | None  # its drain rate; None: not measured


@dataclass(frozen=True)
class Shed:
    """The rule's refusal: the best worker's prediction and when to come back."""

    predicted_s: float
    retry_after_s: int


def best_worker(prompt_tokens: int, workers: Sequence[WorkerQueue]
                ) -> tuple[int, float, float] | None:
    """(index, predicted TTFT, drain rate) of the worker that would start this prompt soonest;
    None when no worker's rate is measured (module docstring)."""
    measured = [w.tokens_per_s for w in workers if w.tokens_per_s is not None]
    if not measured:
        return None
    fallback = sum(measured) / len(measured)
    rates = [fallback if w.tokens_per_s is None else w.tokens_per_s for w in workers]
    predicted = [(w.queued_tokens + prompt_tokens) / r if r > 0 else math.inf  # 0: never drains
                 for w, r in zip(workers, rates)]
    # ties (two workers measured at 0 drain) go to the shorter queue
    i = min(range(len(workers)), key=lambda k: (predicted[k], workers[k].queued_tokens))
    return i, predicted[i], rates[i]


def decide(slo_s: float, prompt_tokens: int, workers: Sequence[WorkerQueue]
           ) -> tuple[int, Shed | None] | None:
    """(the worker that would start this prompt soonest, a Shed if even it is predicted to start
    later than `slo_s` because of the work queued there, else None to admit); None when no
    worker's rate is measured."""
    best = best_worker(prompt_tokens, workers)
    if best is None:
        return None
    i, predicted, rate = best
    queued = workers[i].queued_tokens
    if predicted <= slo_s or queued <= 0:
        return i, None
    if rate <= 0:
        return i, Shed(predicted, RETRY_AFTER_MAX_S)
    # the queue may hold this much when the prompt arrives and still start within the SLO
    room = max(0.0, slo_s * rate - prompt_tokens)
    wait = (queued - room) / rate
    return i, Shed(predicted, max(1, min(RETRY_AFTER_MAX_S, math.ceil(wait))))

