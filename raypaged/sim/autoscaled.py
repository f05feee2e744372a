"""An autoscaled fleet in simulated time: the simulator's workers (real scheduler, block pool and
cost model) and the serving Router, with the serving autoscaler's policy
(core/autoscale_policy.py) choosing the fleet's size at every poll, as serve/autoscaler.py does.

Events, in simulated time, ordered (time, kind, sequence):

    step_end   a worker's step ends: first tokens, finished requests; a draining worker with
               nothing left leaves the fleet
    arrival    the router picks one of the serving workers (in flight: exact; queued tokens
               and prefix caches: as of the last poll)
    poll       every poll_interval_s: the router's view catches up; the policy decides; new
               workers are spawned (they serve cold_start_s later), surplus ones drain (no new
               requests; they finish what they hold)
    join       a spawned worker starts serving
    kick       idle workers with work start a step

Worker-seconds count every worker from its spawn (cold start included) to its leaving.
"""
from __future__ import annotations

import collections
import heapq
from dataclasses import dataclass
from typing import Callable, Sequence

from raypaged.core.autoscale_policy import (CapacityMeter, LoadSample, ScaleHistory, ScalePolicy,
                                            decide, remember)
from raypaged.core.cache_index import CacheIndex
from raypaged.serve.cost_routing import WorkerLoad
from raypaged.sim.policies import Policy
from raypaged.sim.trace import SimRequest
from raypaged.sim.worker import SimWorker

STEP_END, ARRIVAL, POLL, JOIN, KICK = 0, 1, 2, 3, 4


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
        self.index = CacheIndex()
        self.workers: dict[str, SimWorker] = {}     # alive: serving, draining
        self.serving: set[str] = set()
        self.starting: dict[str, float] = {}        # spawned, not serving yet -> since
        self.draining: set[str] = set()
        self.born: dict[str, float] = {}
        self.views, self.queued = {}, {}
        self.sent_since = collections.Counter()
        self.inflight = collections.Counter()
        self.capacity = CapacityMeter()
        self.samples: collections.deque[LoadSample] = collections.deque()
        self.prev: dict[str, tuple[int, int, int]] = {}
        self.history = ScaleHistory()
        self.desired = initial if initial is not None else scale.min_workers
        self._count = 0
        self.worker_seconds = 0.0

    def _spawn(self, now: float, ready: bool) -> str:
        wid = f"w{self._count:04d}"
        self._count += 1
        self.born[wid] = now
        if ready:
            self._join(wid)
        else:
            self.starting[wid] = now
        return wid

    def _join(self, wid: str) -> None:
        self.starting.pop(wid, None)
        self.workers[wid] = self.make_worker(wid)
        self.serving.add(wid)
        self.views[wid] = self.index.view(wid)
        self.queued[wid] = 0

    def _leave(self, wid: str, now: float) -> None:
        self.worker_seconds += now - self.born.pop(wid)
        del self.workers[wid]
        self.draining.discard(wid)

    def run(self, requests: Sequence[SimRequest]) -> ScaledRun:
        if any(r.after is not None for r in requests):
            raise ValueError("conversation turns (after) are not supported here")
        for _ in range(self.desired):
            self._spawn(0.0, ready=True)
        events: list = []
        seq = iter(range(1 << 62))
        push = lambda t, kind, what=None: heapq.heappush(events, (t, kind, next(seq), what))  # noqa: E731
        for i, r in enumerate(requests):
            push(r.arrival_s, ARRIVAL, i)
        push(0.0, POLL)
        first_token: dict[int, float] = {}
        owner: dict[str, tuple[int, str]] = {}
        decisions, timeline = [], []
        done, kicked, peak, end = 0, set(), self.desired, 0.0
        while done < len(requests):
            now, kind, _, what = heapq.heappop(events)
            if kind == STEP_END:
                for d in self.workers[what].finish_step():
                    i, wid = owner[d.request_id]
                    first_token.setdefault(i, now)
                    if d.finished:
                        done += 1
                        end = now
                        self.inflight[wid] -= 1
                if what in self.draining and not self.inflight[what]:
                    self._leave(what, now)
                else:
                    kicked.add(what)
                push(now, KICK)
            elif kind == ARRIVAL:
                tokens = requests[what].prompt()
                loads = {wid: WorkerLoad(self.inflight[wid], self.queued[wid]
                                         + self.sent_since[wid], self.views[wid])
                         for wid in sorted(self.serving)}
                wid = self.router.choose(tokens, loads)
                rid = f"r{what}"
                self.workers[wid].add(rid, tokens, requests[what].output_len)
                owner[rid] = (what, wid)
                self.inflight[wid] += 1
                self.sent_since[wid] += len(tokens)
                kicked.add(wid)
                push(now, KICK)
            elif kind == POLL:
                decision = self._poll(now)
                if decision is not None:
                    decisions.append(decision)
                for wid, since in list(self.starting.items()):
                    if since == now:
                        push(now + self.cold_start_s, JOIN, wid)
                alive = len(self.workers) + len(self.starting)
                peak = max(peak, alive)
                timeline.append((now, alive))
                push(now + self.poll_interval_s, POLL)
            elif kind == JOIN:
                self._join(what)
            else:  # KICK
                for wid in sorted(kicked):
                    worker = self.workers.get(wid)
                    if worker is not None and not worker.stepping:
                        seconds = worker.start_step()
                        if seconds is not None:
                            push(now + seconds, STEP_END, wid)
                kicked.clear()
        for wid in list(self.workers) + list(self.starting):
            self.worker_seconds += end - self.born.pop(wid)
        start = min(r.arrival_s for r in requests)
        ttft = [first_token[i] - r.arrival_s for i, r in enumerate(requests)]
        return ScaledRun(ttft, self.worker_seconds, end - start, peak, decisions, timeline)

    def _poll(self, now: float):
        """The router's view catches up; one autoscaling round (serve/autoscaler.py's)."""
        computed = preemptions = queued = 0
        interval = self.poll_interval_s
        for wid, worker in self.workers.items():
            view = self.views[wid]
            view.apply(worker.engine.cache_summary().delta_since(view.version))
            stats = worker.engine.stats()
            self.queued[wid] = stats.num_queued_tokens
            mine = (stats.preemption.computed_tokens, stats.num_preemptions,
                    stats.num_queued_tokens)
            before = self.prev.get(wid)
            self.prev[wid] = mine
            if before is None:
                continue
            computed += mine[0] - before[0]
            preemptions += mine[1] - before[1]
            self.capacity.observe(before[2], mine[0] - before[0], interval)
            if wid in self.serving:
                queued += stats.num_queued_tokens
        self.sent_since.clear()
        sample = LoadSample(now, interval, len(self.serving), len(self.starting),
                            len(self.draining), queued, computed, preemptions,
                            self.capacity.tokens_per_s)
        self.samples.append(sample)
        while self.samples[0].time_s < now - 2 * self.scale.window_s:
            self.samples.popleft()
        previous = self.desired
        d = decide(self.scale, previous, list(self.samples), self.history, now)
        if not d.changed:
            return None
        self.history = remember(self.history, d, previous, now)
        self.desired = d.desired
        current = len(self.serving) + len(self.starting)
        for _ in range(self.desired - current):
            self._spawn(now, ready=False)
        for wid in sorted(self.serving, key=lambda w: (self.inflight[w], w))[
                :max(0, current - self.desired)]:
            self.serving.discard(wid)
            self.draining.add(wid)
            if not self.inflight[wid] and not self.workers[wid].stepping:
                self._leave(wid, now)
        return (now, previous, d.desired, d.reason)
