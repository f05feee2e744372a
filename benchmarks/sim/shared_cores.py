"""Steps on cores shared with the serving path: processor sharing in simulated time.

A step needs `alone` seconds on a core of its own. While steps run, each progresses at the
speed the cost model gives for the set running (LinearCost.stretch: the serving path's CPU per
output token takes the cores the steps leave free, then a share of theirs). When a step starts
or ends, every running step's remaining work is carried over at the old speed and its end
rescheduled at the new one; the fleet drops an end event whose step was rescheduled since.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

Ends = list[tuple[float, str, int]]  # (end time, worker id, the event's token)


@dataclass
class _Step:
    sampled: int    # output tokens it gives
    alone: float    # its seconds on a core of its own
    left: float     # of those, still to do at `since`
    started: float
    since: float
    token: int      # its current end event's


class SharedCores:
    def __init__(self, cost) -> None:
        self.cost = cost
        self._steps: dict[str, _Step] = {}
        self._speed = 1.0
        self._tokens = itertools.count(1)

    def start(self, worker_id: str, sampled: int, alone: float, now: float) -> Ends:
        """A step begins: the end events of every running step, itself included."""
        self._advance(now)
        self._steps[worker_id] = _Step(sampled, alone, alone, now, now, 0)
        return self._reschedule(now)

    def finish(self, worker_id: str, token: int, now: float) -> tuple[float, Ends] | None:
        """The step's end event came: None if it was rescheduled since (stale); else its
        seconds beyond `alone` and the others' end events at their new speed."""
        step = self._steps.get(worker_id)
        if step is None or step.token != token:
            return None
        self._advance(now)
        del self._steps[worker_id]
        return now - step.started - step.alone, self._reschedule(now)

    def _advance(self, now: float) -> None:
        for step in self._steps.values():
            step.left = max(0.0, step.left - (now - step.since) * self._speed)
            step.since = now

    def _reschedule(self, now: float) -> Ends:
        if not self._steps:
            return []
        self._speed = 1.0 / self.cost.stretch([(s.sampled, s.alone) for s in self._steps.values()])
        ends = []
        for worker_id, step in self._steps.items():
            step.token = next(self._tokens)
            ends.append((now + step.left / self._speed, worker_id, step.token))
        return ends
