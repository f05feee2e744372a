"""The discrete-event fleet: arrivals -> the router (on a lagged snapshot) -> simulated workers.

Events, in simulated time, ordered (time, kind, sequence):

    step_end   a worker's step ends: its tokens are applied (first tokens, finished requests)
    arrival    a request reaches the router, which picks a worker from what it knows:
                 - requests in flight per worker: counted exactly (one router replica counts
                   its own requests, as raypaged.serve.generation.Dispatcher does)
                 - queued prompt tokens and the prefix-cache view: as of the last snapshot
    snapshot   every `snapshot_interval_s` the router's view catches up with every worker
               (stats + the cache summary's delta since the last one, as /fleet carries them;
               with `cache_sample` N > 1 only keys with key % N == 0, as the controller's
               mirrors keep them)
    kick       after everything at this instant: idle workers with work start a step

The snapshot's traffic is counted as the pickled bytes of what a router receives (each
worker's cache delta and its load counters), as Ray would ship them.
"""
from __future__ import annotations

import collections
import heapq
import pickle
import time
from dataclasses import dataclass, field
from typing import Sequence

from raypaged.core.cache_index import CacheIndex
from raypaged.core.cache_summary import sampled
from raypaged.serve.cost_routing import WorkerLoad
from raypaged.sim.policies import Policy
from raypaged.sim.trace import SimRequest
from raypaged.sim.worker import SimWorker

STEP_END, ARRIVAL, SNAPSHOT, KICK = 0, 1, 2, 3


@dataclass
class RequestRecord:
    arrival_s: float
    worker: str = ""
    prompt_tokens: int = 0
    output_len: int = 0
    cached_tokens: int = 0
    first_token_s: float | None = None
    finish_s: float | None = None


@dataclass
class FleetRun:
    records: list[RequestRecord]
    decision_s: list[float]                 # wall time of each routing decision (the policy)
    snapshot_bytes: int                     # what the router received over the run
    sim_seconds: float                      # simulated time from first arrival to last finish
    busy_s: dict[str, float] = field(default_factory=dict)  # per worker, time in steps
    preemptions: int = 0
    evictions: int = 0


class Fleet:
    def __init__(self, workers: Sequence[SimWorker], policy: Policy,
                 snapshot_interval_s: float = 0.75, cache_sample: int = 1) -> None:
        if not workers:
            raise ValueError("a fleet needs at least one worker")
        if snapshot_interval_s <= 0:
            raise ValueError(f"snapshot_interval_s must be > 0, got {snapshot_interval_s}")
        self.workers = {w.worker_id: w for w in workers}
        self.policy = policy
        self.snapshot_interval_s = snapshot_interval_s
        self.cache_sample = cache_sample  # ServeOptions.route_cache_sample
        self.cache_index = CacheIndex()  # the router's views, inverted (core/cache_index.py)
        self.views = {wid: self.cache_index.view(wid) for wid in self.workers}
        self.queued = {wid: 0 for wid in self.workers}   # queued tokens as of the snapshot
        self.sent_since = collections.Counter()           # prompt tokens sent since then
        self.inflight = collections.Counter()
        self.snapshot_bytes = 0

    def run(self, requests: Sequence[SimRequest]) -> FleetRun:
        records = [RequestRecord(r.arrival_s, prompt_tokens=r.num_prompt_tokens,
                                 output_len=r.output_len) for r in requests]
        waiting_on = collections.defaultdict(list)        # request index -> turns waiting for it
        owner: dict[str, int] = {}
        events: list[tuple[float, int, int, object]] = []
        seq = iter(range(1 << 62))
        push = lambda t, kind, what=None: heapq.heappush(events, (t, kind, next(seq), what))  # noqa: E731
        for i, r in enumerate(requests):
            if r.after is None:
                push(r.arrival_s, ARRIVAL, i)
            else:
                waiting_on[r.after].append(i)
        push(0.0, SNAPSHOT)
        decisions: list[float] = []
        done, kicked = 0, set()
        while events and done < len(requests):
            now, kind, _, what = heapq.heappop(events)
            if kind == STEP_END:
                for d in self.workers[what].finish_step():
                    i = owner[d.request_id]
                    rec = records[i]
                    if rec.first_token_s is None:
                        rec.first_token_s, rec.cached_tokens = now, d.num_cached_tokens
                    if d.finished:
                        rec.finish_s = now
                        done += 1
                        self.inflight[rec.worker] -= 1
                        for j in waiting_on.pop(i, ()):   # the next turn leaves now, or later
                            push(max(now, requests[j].arrival_s), ARRIVAL, j)
                kicked.add(what)
                push(now, KICK)
            elif kind == ARRIVAL:
                req, rec = requests[what], records[what]
                rec.arrival_s = now
                tokens = req.prompt()
                loads = {wid: WorkerLoad(self.inflight[wid],
                                         self.queued[wid] + self.sent_since[wid], self.views[wid])
                         for wid in self.workers}
                t0 = time.perf_counter()
                wid = self.policy.choose(tokens, loads)
                decisions.append(time.perf_counter() - t0)
                rid = f"r{what}"
                self.workers[wid].add(rid, tokens, req.output_len)
                owner[rid], rec.worker = what, wid
                self.inflight[wid] += 1
                self.sent_since[wid] += len(tokens)
                kicked.add(wid)
                push(now, KICK)
            elif kind == SNAPSHOT:
                self._take_snapshot()
                push(now + self.snapshot_interval_s, SNAPSHOT)
            else:  # KICK
                for wid in sorted(kicked):
                    worker = self.workers[wid]
                    if not worker.stepping:
                        seconds = worker.start_step()
                        if seconds is not None:
                            push(now + seconds, STEP_END, wid)
                kicked.clear()
        if done < len(requests):
            raise RuntimeError(f"the fleet stopped with {len(requests) - done} requests unfinished")
        start = min(r.arrival_s for r in records)
        return FleetRun(
            records, decisions, self.snapshot_bytes,
            max(r.finish_s for r in records) - start,
            {wid: w.busy_s for wid, w in self.workers.items()},
            sum(w.scheduler.num_preemptions for w in self.workers.values()),
            sum(w.scheduler.kv.pool.num_evictions for w in self.workers.values()))

    def _take_snapshot(self) -> None:
        for wid, worker in self.workers.items():
            view = self.views[wid]
            summary = worker.engine.cache_summary()
            stats = worker.engine.stats()
            self.queued[wid] = stats.num_queued_tokens
            if summary.version == view.version:  # the controller sends no delta (cache_deltas)
                self.snapshot_bytes += len(pickle.dumps((wid, stats)))
                continue
            delta = sampled(summary.delta_since(view.version), self.cache_sample)
            view.apply(delta)
            self.snapshot_bytes += len(pickle.dumps((wid, delta, stats)))
        self.sent_since.clear()
