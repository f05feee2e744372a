"""The autoscaling policy: how many workers the fleet should have, from its recent load samples.

A pure function of what the controller measured (one `LoadSample` per poll round), so the
controller, the simulator and the tests run the same decisions. The signals, and why these:
docs/autoscaling.md. The wait is `LoadSample.wait_s` (the part of TTFT more workers shorten):

    out   wait > target_wait_s at the last two polls, or preemptions at both: grow by the
          factor the wait is over its target (capped at doubling), at least one worker
    in    over a whole window: no preemption, wait never over half the target, and the tokens
          computed per second fit one worker fewer at scale_in_load of capacity: one leaves
    hold  anything else; and always while a worker starts or drains (its effect is not
          measured yet), within out_cooldown_s of the last worker joining or of a scale-out,
          and within in_cooldown_s of any change before scaling in

Never below min_workers or above max_workers; a desired count outside them is clamped first.
"""
from __future__ import annotations

import collections
import math
from dataclasses import dataclass
from typing import Mapping, Sequence

# Reasons, as metrics and /fleet label decisions.
QUEUE_WAIT = "queue_wait"
PREEMPTIONS = "preemptions"
LOW_LOAD = "low_load"
MIN_WORKERS = "min_workers"
MAX_WORKERS = "max_workers"
HOLD = "hold"


@dataclass(frozen=True)
class ScalePolicy:
    min_workers: int
    max_workers: int
    target_wait_s: float = 2.0    # predicted queue wait that calls for more workers
    scale_in_load: float = 0.5    # the load one worker fewer must carry, as a share of capacity
    window_s: float = 60.0        # history a scale-in looks at
    out_cooldown_s: float = 10.0  # after a scale-out or a worker joining, before another
    in_cooldown_s: float = 60.0   # after any change, before a scale-in

    def __post_init__(self) -> None:
        if not 0 <= self.min_workers <= self.max_workers or self.max_workers < 1:
            raise ValueError(f"need 0 <= min_workers <= max_workers and max_workers >= 1, got "
                             f"min_workers={self.min_workers}, max_workers={self.max_workers}")


@dataclass(frozen=True)
class LoadSample:
    """One poll round of the fleet, summed over the workers serving (ready, not draining)."""

    time_s: float
    interval_s: float             # since the previous sample
    serving: int
    starting: int = 0             # asked for, not serving yet
    draining: int = 0
    queued_tokens: int = 0        # admitted or held back by the routers, not computed yet
    computed_tokens: int = 0      # computed during the interval
    preemptions: int = 0          # during the interval
    capacity_tokens_per_s: float = 0.0  # one worker's, when saturated (0: not measured yet)

    @property
    def wait_s(self) -> float:
        """Predicted queue wait; 0 while capacity is unmeasured (nothing has queued yet)."""
        if self.capacity_tokens_per_s <= 0 or self.serving == 0:
            return 0.0
        return self.queued_tokens / (self.serving * self.capacity_tokens_per_s)


@dataclass(frozen=True)
class Decision:
    desired: int
    reason: str   # why it changed; HOLD (or the hold's cause) when it did not
    changed: bool


@dataclass(frozen=True)
class ScaleHistory:
    """What the policy remembers between decisions: times of the last changes."""

    last_out_s: float = -math.inf
    last_change_s: float = -math.inf


def decide(policy: ScalePolicy, desired: int, samples: Sequence[LoadSample],
           history: ScaleHistory, now_s: float) -> Decision:
    """The new desired worker count. `samples`: oldest first, the latest last."""
    if desired < policy.min_workers:
        return Decision(policy.min_workers, MIN_WORKERS, True)
    if desired > policy.max_workers:
        return Decision(policy.max_workers, MAX_WORKERS, True)
    if not samples:
        return Decision(desired, "no samples", False)
    last = samples[-1]
    if last.starting or last.draining:
        return Decision(desired, "starting" if last.starting else "draining", False)
    joined_s = max((s.time_s for s in samples if s.starting), default=-math.inf)
    recent = samples[-2:]
    waiting = len(recent) == 2 and all(s.wait_s > policy.target_wait_s for s in recent)
    preempting = len(recent) == 2 and all(s.preemptions > 0 for s in recent)
    if waiting or preempting:
        if desired >= policy.max_workers:
            return Decision(desired, "at max_workers", False)
        if now_s - max(history.last_out_s, joined_s) < policy.out_cooldown_s:
            return Decision(desired, "out cooldown", False)
        if waiting:  # the same queue over factor x the workers waits target_wait_s
            factor = min(2.0, last.wait_s / policy.target_wait_s)
            grow = max(1, math.ceil(last.serving * factor) - last.serving)
            return Decision(min(policy.max_workers, desired + grow), QUEUE_WAIT, True)
        return Decision(desired + 1, PREEMPTIONS, True)
    if desired <= policy.min_workers:
        return Decision(desired, HOLD, False)
    if now_s - max(history.last_change_s, joined_s) < policy.in_cooldown_s:
        return Decision(desired, "in cooldown", False)
    window = [s for s in samples if s.time_s > now_s - policy.window_s]
    if sum(s.interval_s for s in window) < policy.window_s * 0.9:
        return Decision(desired, "short history", False)
    capacity = last.capacity_tokens_per_s
    if capacity <= 0 or last.serving < 2 or last.serving < desired:
        return Decision(desired, HOLD, False)
    demand = sum(s.computed_tokens for s in window) / sum(s.interval_s for s in window)
    calm = all(s.preemptions == 0 and s.wait_s <= policy.target_wait_s / 2 for s in window)
    if calm and demand <= (last.serving - 1) * capacity * policy.scale_in_load:
        return Decision(desired - 1, LOW_LOAD, True)
    return Decision(desired, HOLD, False)


def remember(history: ScaleHistory, decision: Decision, previous: int,
             now_s: float) -> ScaleHistory:
    """The history after applying `decision` (made when the desired count was `previous`)."""
    if not decision.changed:
        return history
    out = now_s if decision.desired > previous else history.last_out_s
    return ScaleHistory(last_out_s=out, last_change_s=now_s)


def saturated_rate(queued_before: int, computed: int, interval_s: float) -> float | None:
    """A worker's tokens per second over an interval in which it never lacked work: it had at
    least as many tokens queued at the start as it computed by the end, so it computed as fast
    as it can. None for an interval that says nothing about its capacity."""
    if interval_s <= 0 or computed <= 0 or queued_before < computed:
        return None
    return computed / interval_s


class CapacityMeter:
    """One worker's capacity in tokens per second: a moving average over the saturated
    intervals of every worker (the fleet's workers are alike). Sticky: it keeps its value
    through idle hours, when nothing measures it."""

    def __init__(self, alpha: float = 0.2) -> None:
        self.alpha = alpha
        self.tokens_per_s = 0.0

    def observe(self, queued_before: int, computed: int, interval_s: float) -> None:
        rate = saturated_rate(queued_before, computed, interval_s)
        if rate is None:
            return
        self.tokens_per_s = rate if self.tokens_per_s == 0 else (
            (1 - self.alpha) * self.tokens_per_s + self.alpha * rate)


@dataclass(frozen=True)
class WorkerCounters:
    """What one poll read of a worker that computes (serving or draining), for the policy."""

    computed_tokens: int          # EngineStats.preemption.computed_tokens: monotonic
    preemptions: int              # monotonic
    queued_tokens: int
    draining: bool = False        # its queue no longer counts: new requests never wait on it
    incarnation: str | None = None  # a new process restarts its counters


class ScaleRound:
    """The round after every poll, the same in the controller (serve/autoscaler.py) and the
    simulator (sim/autoscaled.py): the workers' counters since the last poll -> a LoadSample
    -> `decide` -> the desired count. Pure: the caller turns the count into workers."""

    def __init__(self, policy: ScalePolicy, desired: int) -> None:
        self.policy, self.desired = policy, desired
        self.history = ScaleHistory()
        self.capacity = CapacityMeter()
        self.samples: collections.deque[LoadSample] = collections.deque()
        self._prev: dict[str, WorkerCounters] = {}

    def sample(self, now_s: float, interval_s: float, workers: Mapping[str, WorkerCounters],
               serving: int, starting: int, draining: int, held_tokens: int = 0) -> LoadSample:
        """The fleet over the last interval; `workers` in a stable order (the capacity meter's
        moving average depends on it). `held_tokens`: prompt tokens the routers hold back
        (fair admission): they wait as surely as the workers' queues, which never see them."""
        computed = preemptions = 0
        queued = held_tokens
        prev, self._prev = self._prev, dict(workers)
        for worker_id, now in workers.items():
            if not now.draining:  # a level, not a counter: counted from its first poll
                queued += now.queued_tokens
            before = prev.get(worker_id)
            if before is None or before.incarnation != now.incarnation:
                continue  # new here, or a new process: its counters start afresh
            done = max(0, now.computed_tokens - before.computed_tokens)
            computed += done
            preemptions += max(0, now.preemptions - before.preemptions)
            self.capacity.observe(before.queued_tokens, done, interval_s)
        return LoadSample(now_s, interval_s, serving, starting, draining, queued, computed,
                          preemptions, self.capacity.tokens_per_s)

    def decide(self, sample: LoadSample) -> tuple[int, Decision]:
        """(the desired count before, the decision), with `sample` the latest."""
        self.samples.append(sample)
        now = sample.time_s
        while self.samples[0].time_s < now - 2 * self.policy.window_s:
            self.samples.popleft()
        previous = self.desired
        decision = decide(self.policy, previous, list(self.samples), self.history, now)
        self.history = remember(self.history, decision, previous, now)  # kept if unchanged
        self.desired = decision.desired
        return previous, decision
