"""Dispatcher: what every Generation of one router replica shares: the fleet, its routing and
this replica's own load per worker. FleetClient is what it needs of the fleet: the snapshot,
and the link to a worker (worker_link.py; ray_fleet.py keeps one per worker)."""
from __future__ import annotations

import collections
import time
from typing import Protocol

from raypaged.serve.cost_routing import WorkerLoad
from raypaged.serve.fleet import FleetSnapshot, WorkerView
from raypaged.serve.metrics import RequestMetrics
from raypaged.serve.poison import PoisonMemory
from raypaged.serve.routing import Router
from raypaged.serve.worker_link import WorkerLink


class FleetClient(Protocol):
    def snapshot(self) -> FleetSnapshot: ...

    def link(self, view: WorkerView) -> WorkerLink:
        """The worker's live link; a new one after the last broke or the worker restarted.
        Raises WorkerUnavailable if none can be had."""


class Dispatcher:
    def __init__(self, fleet: FleetClient, router: Router, metrics: RequestMetrics,
                 suspect_s: float = 2.0):
        self.fleet, self.router, self.metrics = fleet, router, metrics
        self.inflight: collections.Counter[str] = collections.Counter()  # ours, per worker
        self._suspect_until: dict[str, float] = {}
        self.suspect_s = suspect_s
        self.poison = PoisonMemory()  # requests refused as suspected poison (generation.py)
        self._snapshot_version = -1
        self._ours_at_snapshot: dict[str, int] = {}

    def candidates(self, exclude: set[str]) -> tuple[FleetSnapshot, dict[str, WorkerLoad]]:
        """Ready workers and their load: this replica's own requests, counted exactly, plus the
        other replicas' as the last snapshot saw them (its load minus what was ours then); the
        tokens queued there and its prefix cache, as of the snapshot.

        The snapshot alone lags by up to a poll and a refresh: a burst would all see the same
        stale loads, and requests finished since would still count and push work away."""
        snap = self.fleet.snapshot()
        if snap.version != self._snapshot_version:
            self._snapshot_version = snap.version
            self._ours_at_snapshot = dict(self.inflight)
        now = time.monotonic()
        loads = {}
        for w in snap.ready():
            if w.worker_id in exclude or self._suspect_until.get(w.worker_id, 0) >= now:
                continue
            others = max(0, w.load - self._ours_at_snapshot.get(w.worker_id, 0))
            loads[w.worker_id] = WorkerLoad(others + self.inflight[w.worker_id],
                                            w.stats.engine.num_queued_tokens,
                                            snap.caches.get(w.worker_id))
        return snap, loads

    def mark_suspect(self, worker_id: str) -> None:
        """Skip a worker that just failed until the controller has had time to notice."""
        self._suspect_until[worker_id] = time.monotonic() + self.suspect_s

    def opened(self, worker_id: str) -> None:
        self.inflight[worker_id] += 1

    def closed(self, worker_id: str) -> None:
        self.inflight[worker_id] -= 1
