"""Dispatcher: what every Generation of one router replica shares: the fleet, its routing and
this replica's own load per worker. FleetClient is what it needs of the fleet: the snapshot,
and the link to a worker (worker_link.py; ray_fleet.py keeps one per worker)."""
from __future__ import annotations

import collections
import time
from typing import Protocol

from raypaged.serve.client_gate import ClientGate
from raypaged.serve.fleet import FleetSnapshot, WorkerView
from raypaged.serve.fleet_loads import FleetLoads
from raypaged.serve.metrics import RequestMetrics
from raypaged.serve.poison import PoisonMemory
from raypaged.serve.quarantine import Quarantine
from raypaged.serve.routing import Router
from raypaged.serve.worker_link import WorkerLink


class FleetClient(Protocol):
    def snapshot(self) -> FleetSnapshot: ...

    def link(self, view: WorkerView) -> WorkerLink:
        """The worker's live link; a new one after the last broke or the worker restarted.
        Raises WorkerUnavailable if none can be had."""


class Dispatcher:
    def __init__(self, fleet: FleetClient, router: Router, metrics: RequestMetrics,
                 suspect_s: float = 2.0, gate: ClientGate | None = None):
        self.fleet, self.router, self.metrics = fleet, router, metrics
        # per-client cap and fair admission; none given: no cap, every request sent at once
        self.gate = gate or ClientGate(0, False, fleet.snapshot, metrics)
        self.inflight: collections.Counter[str] = collections.Counter()  # ours, per worker
        self.blocks: collections.Counter[str] = collections.Counter()  # theirs at their longest
        # worker id -> (until when, the incarnation that failed: its new process is not)
        self._suspect_until: dict[str, tuple[float, str | None]] = {}
        self.suspect_s = suspect_s
        self.poison = PoisonMemory()  # requests refused as suspected poison (generation.py)
        self.quarantine = Quarantine()  # workers serving a request retried after a death
        self._snapshot_version = -1  # none yet (versions count from 0)
        self._loads = FleetLoads((), ())

    def candidates(self, exclude: set[str]) -> tuple[FleetSnapshot, FleetLoads]:
        """Ready workers and their load: this replica's own requests, counted exactly, plus the
        other replicas' as the last snapshot saw them (its load minus what was ours then); the
        tokens queued there and its prefix cache, as of the snapshot. The snapshot alone lags
        by up to a poll and a refresh: a burst would all see the same stale loads, and requests
        finished since would still count and push work away.

        The arrays are built once per controller poll (snapshot version), not on each refresh
        of the same poll, and kept up to date by opened/closed and the routing's charges
        (fleet_loads.py): a rebuild would drop the prefill charged since the poll
        (cost_routing.py) while the workers' queues still show none of it, and a burst would
        herd onto the worker that looked idle."""
        snap = self.fleet.snapshot()
        if snap.version != self._snapshot_version:
            self._snapshot_version = snap.version
            ready = sorted(snap.ready(), key=lambda w: w.worker_id)
            # max(0, load - ours) + ours: the others' part of its load, plus ours
            self._loads = FleetLoads(
                [w.worker_id for w in ready],
                [max(w.load, self.inflight[w.worker_id]) for w in ready],
                [w.stats.engine.num_queued_tokens for w in ready],
                [snap.caches.get(w.worker_id) for w in ready])
        now = time.monotonic()
        if self._suspect_until:  # drop the ones whose time is up, or back as a new process
            self._suspect_until = {w: (t, inc) for w, (t, inc) in self._suspect_until.items()
                                   if t >= now and not snap.renewed(w, inc)}
        skip = [*exclude, *self._suspect_until]
        return snap, (self._loads.excluding(skip) if skip else self._loads)

    def rank(self, tokens: list[int], cache_salt: str | None, exclude: set[str], blocks: int,
             count: bool) -> tuple[FleetSnapshot, list[str], tuple]:
        """The ready workers outside `exclude` and the suspects, best first for this prompt,
        and the prompt's block hashes (the chosen worker is told them, so it hashes nothing
        twice); `count`: this request's first routing decision, counted in the metrics."""
        snap, loads = self.candidates(exclude)
        if not loads:
            return snap, [], ()
        keys = self.router.prompt_keys(tokens, cache_salt, loads)
        order, reason = self.router.choose(keys, loads)
        if self.gate.fair:
            order = self.room_first(order, snap, blocks)
        if count:
            self.metrics.inc("routing_decisions", reason)
        return snap, order, keys.hashes

    def mark_suspect(self, worker_id: str, incarnation: str | None = None) -> None:
        """Skip a worker that just failed until the controller has had time to notice."""
        self._suspect_until[worker_id] = (time.monotonic() + self.suspect_s, incarnation)

    def opened(self, worker_id: str, blocks: int = 0, n: int = 1) -> None:
        """A leg of `blocks` (its request at its longest, as the gate counts it) opened on the
        worker; n=-1: closed."""
        self.inflight[worker_id] += n
        self.blocks[worker_id] += n * blocks
        self._loads.opened(worker_id, n)

    def room_first(self, order: list[str], snap: FleetSnapshot, blocks: int) -> list[str]:
        """The routing order with the workers whose KV cache this replica has not filled
        (its requests there at their longest, with this one) first, in the same order: the
        gate kept room in the fleet for a newcomer (client_gate.py), which is no use to it on a
        worker that a flood already holds whole (it would wait there behind the flood)."""
        def has_room(worker_id: str) -> bool:
            view = snap.worker(worker_id)
            return (view is None or view.stats is None
                    or self.blocks[worker_id] + blocks <= view.stats.budget.num_blocks)
        return sorted(order, key=lambda w: not has_room(w))  # stable: the same order otherwise
