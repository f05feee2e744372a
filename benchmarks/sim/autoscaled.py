"""An autoscaled fleet in simulated time: the simulator's fleet (sim/fleet.py: real scheduler,
block pool, cost model, the serving Router) with the serving autoscaler's round
(core/autoscale_policy.ScaleRound, as serve/autoscaler.py runs it) as its poll hook:

    every poll   the router's view catches up (fleet.py's snapshot); the round turns the workers'
                 counters into a LoadSample and decides; new workers are added (they serve
                 cold_start_s later), surplus ones drain (no new requests; they finish what
                 they hold, then leave)

Worker-seconds count every worker from its spawn (cold start included) to its leaving.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from raypaged.core.autoscale_policy import ScalePolicy, ScaleRound, WorkerCounters
from raypaged.core.contracts import EngineStats
from benchmarks.sim.fleet import Fleet
from benchmarks.sim.policies import Policy
from benchmarks.sim.trace import SimRequest
from benchmarks.sim.worker import SimWorker


@dataclass
class ScaledRun:
    ttft_s: list[float]
    worker_seconds: float
    sim_seconds: float           # first arrival to last finish
    max_workers: int
    decisions: list[tuple[float, int, int, str]]  # (time, from, to, reason)
    timeline: list[tuple[float, int]]             # (time, workers allocated), at each poll


class AutoscaledFleet:
    def __init__(self, make_worker: Callable[[str], SimWorker], router: Policy,
                 scale: ScalePolicy, cold_start_s: float, poll_interval_s: float = 0.5,
                 initial: int | None = None) -> None:
        self.make_worker, self.router, self.scale = make_worker, router, scale
        self.cold_start_s, self.poll_interval_s = cold_start_s, poll_interval_s
        self.round = ScaleRound(scale, initial if initial is not None else scale.min_workers)
        self.born: dict[str, float] = {}
        self.worker_seconds = 0.0
        self.decisions: list[tuple[float, int, int, str]] = []
        self.timeline: list[tuple[float, int]] = []
        self._count = 0

    def _new_worker(self, now: float) -> SimWorker:
        wid = f"w{self._count:04d}"
        self._count += 1
        self.born[wid] = now
        return self.make_worker(wid)

    def run(self, requests: Sequence[SimRequest]) -> ScaledRun:
        if any(r.after is not None for r in requests):
            raise ValueError("conversation turns (after) are not supported here")
        initial = self.round.desired
        fleet = Fleet([self._new_worker(0.0) for _ in range(initial)], self.router,
                      self.poll_interval_s, hook=self)
        run = fleet.run(requests)
        end = max(r.finish_s for r in run.records)
        for wid in list(fleet.workers) + list(fleet.starting):
            self.worker_seconds += end - self.born.pop(wid)
        ttft = [r.first_token_s - r.arrival_s for r in run.records]
        peak = max([initial, *(n for _, n in self.timeline)])
        return ScaledRun(ttft, self.worker_seconds, run.sim_seconds, peak, self.decisions,
                         self.timeline)

    # -- the poll hook ------------------------------------------------------------------------
    def poll(self, fleet: Fleet, now: float, stats: dict[str, EngineStats]) -> None:
        counters = {wid: WorkerCounters(s.preemption.computed_tokens, s.num_preemptions,
                                        s.num_queued_tokens, wid not in fleet.serving)
                    for wid, s in stats.items()}
        sample = self.round.sample(now, self.poll_interval_s, counters, len(fleet.serving),
                                   len(fleet.starting), len(fleet.draining))
        previous, d = self.round.decide(sample)
        if d.changed:
            self.decisions.append((now, previous, d.desired, d.reason))
            current = len(fleet.serving) + len(fleet.starting)
            for _ in range(d.desired - current):
                fleet.add(self._new_worker(now), now, now + self.cold_start_s)
            for wid in sorted(fleet.serving, key=lambda w: (fleet.inflight[w], w))[
                    :max(0, current - d.desired)]:
                fleet.drain(wid, now)
        self.timeline.append((now, len(fleet.workers) + len(fleet.starting)))

    def left(self, worker_id: str, now: float) -> None:
        self.worker_seconds += now - self.born.pop(worker_id)
