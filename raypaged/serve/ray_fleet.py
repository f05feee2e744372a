"""RayFleetClient: a router replica's view of the fleet, and its streams to workers.

The fleet snapshot is refreshed from the controller by a background task (requests never wait
on the controller, and nothing here blocks the event loop); the same task ships this replica's
request metrics to the controller. While the controller is away (it died; Serve recreates it,
and the new one adopts the same workers) the last snapshot stays in use: requests go on being
routed to the workers it names, and streams, which go router -> worker directly, go on.
Requests reach a worker over its link (worker_link.py): one Ray stream per worker, one message
per engine step carrying every request's new outputs.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Awaitable, Callable

from ray.exceptions import RayActorError

from raypaged.core.cache_index import CacheIndex, IndexedCacheView
from raypaged.core.cache_summary import SummaryDelta
from raypaged.serve.fleet import FleetSnapshot, WorkerView
from raypaged.serve.metrics import RequestMetrics
from raypaged.serve.poison import PoisonMemory
from raypaged.serve.worker_link import RayWorkerLink

logger = logging.getLogger(__name__)


class RayFleetClient:
    def __init__(self, resolve_controller: Callable[[], Awaitable], replica_id: str,
                 metrics: RequestMetrics, refresh_s: float = 0.25, push_metrics_s: float = 1.0):
        self._resolve = resolve_controller
        self._controller = None
        self.replica_id = replica_id
        self.metrics = metrics
        self.refresh_s, self.push_metrics_s = refresh_s, push_metrics_s
        self._snapshot = FleetSnapshot()
        self._cache_index = CacheIndex()  # one walk per prompt finds every worker's hit
        self._caches: dict[str, IndexedCacheView] = {}
        self._task: asyncio.Task | None = None
        self._links: dict[str, RayWorkerLink] = {}  # worker id -> its live link
        self.poison: PoisonMemory | None = None  # the Dispatcher's, shared through the controller
        self.held_tokens: Callable[[], int] = lambda: 0  # the ClientGate's waiting prompt tokens

    def snapshot(self) -> FleetSnapshot:
        return self._snapshot

    async def start(self) -> FleetSnapshot:
        """Start refreshing; returns once at least one worker is ready."""
        await self._refresh()
        self._task = asyncio.get_running_loop().create_task(self._refresh_forever())
        while not self._snapshot.ready():
            if self._snapshot.all_dead():  # e.g. the engine refused its config: say why
                causes = sorted({w.error or "unknown" for w in self._snapshot.workers})
                raise RuntimeError(f"every worker failed to start: {'; '.join(causes)}")
            await asyncio.sleep(0.2)
        return self._snapshot

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for link in self._links.values():
            link.close()
        self._links.clear()

    async def _refresh(self) -> None:
        if self._controller is None:
            self._controller = await self._resolve()
        try:
            ours = self._snapshot
            snapshot = await self._controller.snapshot.remote(
                (ours.epoch, ours.version) if ours.epoch else None)
            # None: ours is the controller's latest; so are our cache views. Version 0: a new
            # controller that has not polled its workers yet knows less than we do (every
            # worker "starting"): keep ours until it has.
            if snapshot is None or (snapshot.version == 0 and ours.workers):
                return
            snapshot = (with_handles(snapshot, ours)
                        or await self._controller.snapshot.remote(None))  # (not expected)
            versions = {wid: view.version for wid, view in self._caches.items()}
            for wid, delta in (await self._controller.cache_deltas.remote(versions)).items():
                if wid not in self._caches:
                    self._caches[wid] = self._cache_index.view(wid)
                self._caches[wid].apply(delta)
            present = {v.worker_id for v in snapshot.workers}
            for wid in [w for w in self._caches if w not in present]:  # drained: it left
                # its keys leave the index; back under this id, it is synced whole (-1)
                self._caches.pop(wid).apply(SummaryDelta(-1, full=True))
            for wid in [w for w in self._links if w not in present]:  # and its link goes too
                self._links.pop(wid).close()
            self._snapshot = dataclasses.replace(snapshot, caches=dict(self._caches))
        except RayActorError:
            # Recreated by Serve: resolve it again next time. Its cache mirrors count versions
            # afresh, so ask it for whole summaries (the views serve routing until then).
            self._controller = None
            for view in self._caches.values():
                view.version = -1
            raise

    async def _push(self) -> None:
        """This replica's request metrics, suspected poison requests and the prompt tokens its
        gate holds to the controller; back, the poison requests every replica has reported (a
        replica refuses them as its own within a push of another refusing one)."""
        mine = self.poison.shared() if self.poison is not None else []
        shared = await self._controller.report_router_metrics.remote(
            self.replica_id, self.metrics.snapshot(), mine, self.held_tokens())
        if self.poison is not None and shared:
            self.poison.learn(shared)

    async def _refresh_forever(self) -> None:
        last_push, failing = 0.0, False
        while True:
            try:
                await self._refresh()
                if time.monotonic() - last_push >= self.push_metrics_s:
                    await self._push()
                    last_push = time.monotonic()
                if failing:
                    logger.info("fleet refresh works again")
                failing = False
            except Exception as exc:  # noqa: BLE001 - keep the last snapshot, try again
                if not failing:  # once per outage, not every refresh_s
                    logger.warning("fleet refresh failed, routing from the last snapshot: %r",
                                   exc)
                failing = True
            await asyncio.sleep(self.refresh_s)

    def link(self, view: WorkerView) -> RayWorkerLink:
        """The worker's live link; a new one after the last broke or the worker restarted."""
        incarnation = view.stats.incarnation if view.stats is not None else None
        link = self._links.get(view.worker_id)
        if link is None or link.dead is not None or link.incarnation != incarnation:
            if link is not None:
                link.close()
            link = self._links[view.worker_id] = RayWorkerLink(
                view.handle, view.worker_id, incarnation, self.replica_id)
        return link


def with_handles(snapshot: FleetSnapshot, ours: FleetSnapshot) -> FleetSnapshot | None:
    """`snapshot` with the worker handles the controller left out (ours is of the same epoch:
    we hold them) put back from `ours`; None if one is not there after all."""
    have = {v.worker_id: v.handle for v in ours.workers}
    if any(v.handle is None and have.get(v.worker_id) is None for v in snapshot.workers):
        return None
    return dataclasses.replace(snapshot, workers=tuple(
        v if v.handle is not None else dataclasses.replace(v, handle=have[v.worker_id])
        for v in snapshot.workers))
