"""The discrete-event fleet: arrivals -> the router (on a lagged snapshot) -> simulated workers.

Events, in simulated time, ordered (time, kind, sequence):

    step_end   a worker's step ends: its tokens are applied (first tokens, finished requests);
               on cores shared with the serving path (shared_cores.py) a step's end moves
               when others start or end, and the event of an end moved since is dropped
    arrival    a request reaches the router, which picks a worker from what it knows:
                 - requests in flight per worker: counted exactly (one router replica counts
                   its own requests, as raypaged.serve.dispatch.Dispatcher does)
                 - queued prompt tokens and the prefix-cache view: as of the last snapshot
    deliver    the request reaches its worker's engine `path_s` after the decision (the cost
               model's per-request serving path: HTTP, routing, the submit; 0 = at once)
    snapshot   every `snapshot_interval_s` the router's view catches up with every worker
               (stats + the cache summary's delta since the last one, as /fleet carries them;
               with `cache_sample` N > 1 only the keys at the depths cache_summary.published
               keeps, as the controller's mirrors keep them)
    join       a worker added by the poll hook starts serving (its cold start is over)
    kick       after everything at this instant: idle workers with work start a step

A `PollHook` (sim/autoscaled.py's autoscaler) runs after every snapshot and may add and drain
workers: the fleet with a hook is the autoscaled fleet, with the same loop.

The snapshot's traffic is counted as the pickled bytes of what a router receives (each
worker's cache delta and its load counters), as Ray would ship them.
"""
from __future__ import annotations

import collections
import heapq
import itertools
import pickle
import time
from dataclasses import dataclass, field
from typing import Protocol, Sequence

from raypaged.core.cache_index import CacheIndex
from raypaged.core.cache_summary import sampled
from raypaged.core.contracts import EngineStats
from raypaged.serve.fleet_loads import FleetLoads
from benchmarks.sim.policies import Policy
from benchmarks.sim.shared_cores import SharedCores
from benchmarks.sim.trace import SimRequest
from benchmarks.sim.worker import SimWorker

STEP_END, ARRIVAL, DELIVER, SNAPSHOT, JOIN, KICK = 0, 1, 2, 3, 4, 5


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


class PollHook(Protocol):
    """What runs the fleet's size (sim/autoscaled.py): called at every snapshot, after the
    router's view caught up, with each live worker's stats; it may `add` and `drain` workers."""

    def poll(self, fleet: Fleet, now: float, stats: dict[str, EngineStats]) -> None: ...

    def left(self, worker_id: str, now: float) -> None: ...


class Fleet:
    """Live workers are `workers`; the router chooses among `serving` (not draining); a
    draining worker leaves once nothing is in flight there; `starting` ones join later."""

    def __init__(self, workers: Sequence[SimWorker], policy: Policy,
                 snapshot_interval_s: float = 0.75, cache_sample: int = 1,
                 hook: PollHook | None = None) -> None:
        if not workers:
            raise ValueError("a fleet needs at least one worker")
        if snapshot_interval_s <= 0:
            raise ValueError(f"snapshot_interval_s must be > 0, got {snapshot_interval_s}")
        self.policy, self.hook = policy, hook
        self.snapshot_interval_s = snapshot_interval_s
        self.cache_sample = cache_sample  # ServeOptions.route_cache_sample
        self.cache_index = CacheIndex()  # the router's views, inverted (core/cache_index.py)
        self.workers: dict[str, SimWorker] = {}
        self.serving: set[str] = set()
        self.draining: set[str] = set()
        self.starting: dict[str, float] = {}              # worker id -> when it was added
        self.views: dict = {}
        self.queued: dict[str, int] = {}                  # queued tokens as of the snapshot
        self.sent_since = collections.Counter()           # tokens charged since then
        self.inflight = collections.Counter()
        self.snapshot_bytes = 0
        self._loads: FleetLoads | None = None             # the router's arrays (fleet_loads.py)
        self._events: list[tuple[float, int, int, object]] = []
        # steps on cores shared with the serving path, where the cost model says so
        cost = workers[0].cost
        self.shared = SharedCores(cost) if cost.shares_cores else None
        self._seq = itertools.count()
        for w in workers:
            self._join(w)

    # -- membership (the hook's hands) --------------------------------------------------------
    def add(self, worker: SimWorker, now: float, ready_s: float) -> None:
        """`worker` serves from `ready_s` on (its cold start ends then)."""
        self.starting[worker.worker_id] = now
        self._push(ready_s, JOIN, worker)

    def drain(self, worker_id: str, now: float) -> None:
        """No new requests for it; it leaves when nothing is in flight there."""
        self.serving.discard(worker_id)
        self.draining.add(worker_id)
        self._loads = None
        if not self.inflight[worker_id] and not self.workers[worker_id].stepping:
            self._leave(worker_id, now)

    def _join(self, worker: SimWorker) -> None:
        wid = worker.worker_id
        self.starting.pop(wid, None)
        self.workers[wid] = worker
        self.serving.add(wid)
        self.views[wid] = self.cache_index.view(wid)
        self.queued[wid] = 0
        self._loads = None

    def _leave(self, worker_id: str, now: float) -> None:
        del self.workers[worker_id]
        self.draining.discard(worker_id)
        if self.hook is not None:
            self.hook.left(worker_id, now)

    def _push(self, t: float, kind: int, what=None) -> None:
        heapq.heappush(self._events, (t, kind, next(self._seq), what))

    def loads(self) -> FleetLoads:
        """What the router chooses from: in flight (exact), queued tokens (as of the snapshot,
        plus what the policy charged for what it sent since) and cache views; rebuilt after each snapshot or change of
        membership, kept up to date in between as requests come and go."""
        if self._loads is None:
            ids = sorted(self.serving)
            self._loads = FleetLoads(ids, [self.inflight[w] for w in ids],
                                     [self.queued[w] + self.sent_since[w] for w in ids],
                                     [self.views[w] for w in ids])
        return self._loads

    def run(self, requests: Sequence[SimRequest]) -> FleetRun:
        records = [RequestRecord(r.arrival_s, prompt_tokens=r.num_prompt_tokens,
                                 output_len=r.output_len) for r in requests]
        waiting_on = collections.defaultdict(list)        # request index -> turns waiting for it
        owner: dict[str, int] = {}
        events, push = self._events, self._push
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
                what, token = what
                if self.shared is not None:
                    finished = self.shared.finish(what, token, now)
                    if finished is None:  # rescheduled since: its new end event comes later
                        continue
                    extra, ends = finished
                    self.workers[what].busy_s += extra
                    for t, wid, tok in ends:
                        push(t, STEP_END, (wid, tok))
                for d in self.workers[what].finish_step():
                    i = owner[d.request_id]
                    rec = records[i]
                    if rec.first_token_s is None:
                        rec.first_token_s, rec.cached_tokens = now, d.num_cached_tokens
                    if d.finished:
                        rec.finish_s = now
                        done += 1
                        self.inflight[rec.worker] -= 1
                        if self._loads is not None:
                            self._loads.opened(rec.worker, -1)
                        for j in waiting_on.pop(i, ()):   # the next turn leaves now, or later
                            push(max(now, requests[j].arrival_s), ARRIVAL, j)
                if what in self.draining and not self.inflight[what]:
                    self._leave(what, now)
                else:
                    kicked.add(what)
                push(now, KICK)
            elif kind == ARRIVAL:
                req, rec = requests[what], records[what]
                rec.arrival_s = now
                tokens = req.prompt()
                loads = self.loads()
                queued_before = int(loads.queued.sum())
                t0 = time.perf_counter()
                wid = self.policy.choose(tokens, loads)
                decisions.append(time.perf_counter() - t0)
                rid = f"r{what}"
                owner[rid], rec.worker = what, wid
                self.inflight[wid] += 1
                # what the policy charged the worker (the Router: the prefill it predicts
                # there), kept for a rebuild of the arrays before the next snapshot
                self.sent_since[wid] += int(loads.queued.sum()) - queued_before
                loads.requests[loads.at[wid]] += 1
                hashes = self.policy.last_hashes  # the router's, sent with the request
                path_s = self.workers[wid].cost.path_s
                if path_s:
                    push(now + path_s, DELIVER, (wid, rid, tokens, req.output_len, hashes))
                else:
                    self.workers[wid].add(rid, tokens, req.output_len, hashes)
                    kicked.add(wid)
                    push(now, KICK)
            elif kind == DELIVER:
                wid, rid, tokens, output_len, hashes = what
                self.workers[wid].add(rid, tokens, output_len, hashes)
                kicked.add(wid)
                push(now, KICK)
            elif kind == SNAPSHOT:
                stats = self._take_snapshot()
                if self.hook is not None:
                    self.hook.poll(self, now, stats)
                push(now + self.snapshot_interval_s, SNAPSHOT)
            elif kind == JOIN:
                self._join(what)
            else:  # KICK
                for wid in sorted(kicked):
                    worker = self.workers.get(wid)  # (it may have left)
                    if worker is not None and not worker.stepping:
                        seconds = worker.start_step()
                        if seconds is None:
                            continue
                        if self.shared is None:
                            push(now + seconds, STEP_END, (wid, 0))
                            continue
                        for t, w, token in self.shared.start(wid, worker.step_sampled, seconds,
                                                             now):
                            push(t, STEP_END, (w, token))
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

    def _take_snapshot(self) -> dict[str, EngineStats]:
        every = {}
        for wid, worker in self.workers.items():
            view = self.views[wid]
            summary = worker.engine.cache_summary()
            stats = every[wid] = worker.engine.stats()
            self.queued[wid] = stats.num_queued_tokens
            if summary.version == view.version:  # the controller sends no delta (cache_deltas)
                self.snapshot_bytes += len(pickle.dumps((wid, stats)))
                continue
            delta = sampled(summary.delta_since(view.version), self.cache_sample)
            view.apply(delta)
            self.snapshot_bytes += len(pickle.dumps((wid, delta, stats)))
        self.sent_since.clear()
        self._loads = None
        return every
