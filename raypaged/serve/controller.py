"""Controller: fleet membership and the fleet view, refreshed by polling every worker at once.

A plain class; `ControllerActor` (actors.py) is its Ray shell, created by Serve once per
application. Each poll round asks every worker for `stats()` concurrently, with a timeout:

    answer, same incarnation   -> ready
    answer, new incarnation    -> ready, restarts += 1 (the process was restarted: re-admitted)
    timeout                    -> unresponsive (keeps its last stats; routers skip it)
    WorkerDown(state)          -> restarting / dead (routers skip it until it answers again)
    unresponsive for `unresponsive_timeout_s` -> killed (`kill`: Ray starts a new process, which
                                  answers as a new incarnation; `overdue`)
    restarting / unresponsive, its node dead -> node_lost (`live_nodes`: it will not come back
                                  there, so nobody waits for it: failover.wait_for_spare)

Each poll also brings the worker's prefix-cache changes since the last one; the controller keeps
a mirror of every worker's cache summary, and routers catch up with it by deltas
(`cache_deltas`), so the cache-aware router knows which blocks each worker holds without ever
calling a worker itself. With `cache_sample` N > 1 the mirrors keep only the keys at
published depths (cache_summary.published): fewer bytes to every router, hits at N-block grain.

Routers push their request metrics here so /metrics on any replica shows the whole fleet, and
with them the suspected poison requests they refused, which every router then refuses too.

The worker lifecycle rules are small pure functions here (the controller and the worker's Ray
shell apply them; tests check them on numbers):

    unresponsive for worker_unresponsive_timeout_s  -> killed (ray.kill); Ray starts a new process
    a process restarted after a crash               -> waits restart_delay_s(crashes in a row)
                                                       before it loads the model again

Crashes count "in a row" while each incarnation lived less than HEALTHY_S: a worker that served
for five minutes and then crashed restarts at once, as the first time. The delays (0, 1, 2, 4,
... 60 s) are Kubernetes' CrashLoopBackOff shape (10 s doubling to 5 min) scaled to a model
reload: one crash costs no wait, a crash loop costs at most one reload a minute.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from typing import Any, Awaitable, Callable, Sequence

from raypaged.core.cache_summary import CacheSummary, SummaryDelta, sampled
from raypaged.core.ttft_slo import DrainRate
from raypaged.serve.fleet import (DEAD, READY, RESTARTING, STARTING, UNRESPONSIVE,
                                  FleetSnapshot, WorkerView)
from raypaged.serve.poison import PoisonMemory
from raypaged.serve.messages import WorkerStats

logger = logging.getLogger(__name__)
HELD_FRESH_S = 3.0  # routers push every second (ray_fleet.py)
NODES_EVERY_S = 2.0  # how often the live nodes are asked for while a worker is down
BACKOFF_FIRST_S = 1.0   # the wait before the second restart in a row
BACKOFF_CAP_S = 60.0    # the longest wait
HEALTHY_S = 300.0       # an incarnation that lived this long ends a crash streak


class WorkerDown(Exception):
    """Raised by a probe when the worker is known to be restarting or dead."""

    def __init__(self, state: str, cause: str | None = None):
        super().__init__(state)
        self.state = state
        self.cause = cause  # why, when known (the error that killed a worker's constructor)


# probe(handle, cache_since): the worker's stats, with its cache changes since that version
Probe = Callable[[Any, int], Awaitable[WorkerStats]]
# live_nodes(): the ids of the cluster's nodes that are alive (WorkerStats.node_id)
LiveNodes = Callable[[], Awaitable[set]]


class Controller:
    def __init__(self, workers: Sequence[tuple[str, Any]], probe: Probe,
                 poll_interval_s: float = 0.5, poll_timeout_s: float = 5.0,
                 cache_sample: int = 1, kill: Callable[[Any], None] | None = None,
                 unresponsive_timeout_s: float = 30.0, live_nodes: LiveNodes | None = None):
        now = time.time()
        self._views = {wid: WorkerView(wid, STARTING, handle, since=now) for wid, handle in workers}
        self._probe = probe
        self.poll_interval_s = poll_interval_s
        self.poll_timeout_s = poll_timeout_s
        self._version = 0
        # routers hold (epoch, version): a new controller (Serve recreated it) counts versions
        # afresh, and its epoch says so
        self.epoch = uuid.uuid4().hex
        self._handle_at = {wid: 0 for wid, _ in workers}  # worker -> version its handle came at
        self._router_metrics: dict[str, dict] = {}
        # replica -> (prompt tokens its gate holds, when it said so): pushed every second
        self._router_held: dict[str, tuple[int, float]] = {}
        self._poller: asyncio.Task | None = None
        self._caches = {wid: CacheSummary() for wid, _ in workers}  # mirrors, for routers
        self._cache_from: dict[str, tuple[str, int]] = {}  # worker -> (incarnation, version)
        self.cache_sample = cache_sample  # ServeOptions.route_cache_sample
        self.autoscaler = None  # serve/autoscaler.py: set by the Ray shell when scaling
        self._kill = kill  # kill(handle): end the worker's process so that Ray starts a new one
        self.unresponsive_timeout_s = unresponsive_timeout_s
        self._live_nodes, self._nodes_asked_at = live_nodes, float("-inf")
        self._drain = {wid: DrainRate() for wid, _ in workers}  # per worker, for TTFT shedding
        self.poison = PoisonMemory()  # every router's suspected poison requests (poison.py)

    async def snapshot(self, known: tuple[str, int] | None = None) -> FleetSnapshot | None:
        """The fleet view for a router holding snapshot `known` = (epoch, version) (None: none
        yet): None when it holds this one; else the views, without the handles it already has
        (docs/fleet_sim.md). The router's own request metrics and the autoscaler's state go
        out with the next version (a poll)."""
        self._ensure_polling()
        if known == (self.epoch, self._version):
            return None
        views = tuple(self._views.values())
        if known is not None and known[0] == self.epoch:  # it holds the handles given by then
            views = tuple(v if self._handle_at.get(v.worker_id, 0) > known[1]
                          else dataclasses.replace(v, handle=None) for v in views)
        scaling = self.autoscaler.to_json(views) if self.autoscaler is not None else {}
        return FleetSnapshot(self._version, views, dict(self._router_metrics), scaling=scaling,
                             epoch=self.epoch)

    async def cache_deltas(self, versions: dict[str, int]) -> dict[str, SummaryDelta]:
        """For a router whose copies are at `versions` (worker id -> version; -1: none yet):
        the deltas of the workers whose cache changed since (it keeps the others as they are)."""
        return {wid: summary.delta_since(versions.get(wid, -1), depths=False)
                for wid, summary in self._caches.items()
                if summary.version != versions.get(wid, -1)}

    async def report_router_metrics(self, replica_id: str, metrics: dict,
                                    poison: list = (), held_tokens: int = 0) -> list:
        """A router's metrics, the suspected poison requests it remembers and the prompt tokens
        its gate holds back (client_gate.py); returns what every router has reported of the
        poison requests, for it to refuse too (poison.py)."""
        self._ensure_polling()
        self._router_metrics[replica_id] = metrics
        self._router_held[replica_id] = (held_tokens, time.monotonic())
        self.poison.learn(poison)
        return self.poison.shared()

    def held_prompt_tokens(self) -> int:
        """Prompt tokens the routers hold back waiting for room in the fleet, as of their last
        pushes: demand the workers' queues do not show. A replica silent for HELD_FRESH_S (gone,
        or cut off) no longer counts."""
        since = time.monotonic() - HELD_FRESH_S
        return sum(tokens for tokens, at in self._router_held.values() if at >= since)

    async def poll_once(self) -> None:
        for new in await asyncio.gather(*(self._poll(v) for v in self.views())):
            old = self._views.get(new.worker_id)
            if old is None:
                continue  # removed (drained) while the poll was out
            if new.state != old.state:
                logger.info("worker %s: %s -> %s", new.worker_id, old.state, new.state)
            if new.stats is not None and new.stats is not old.stats:  # a new answer
                rate = self._drain.setdefault(new.worker_id, DrainRate()).observe(
                    time.monotonic(), new.stats.engine.num_prefill_tokens,
                    new.stats.engine.num_waiting, new.stats.incarnation)
                new = dataclasses.replace(new, drain_tokens_per_s=rate)
            self._views[new.worker_id] = new
        if self._live_nodes is not None:
            await self._mark_lost_nodes()
        if self._kill is not None:
            self._kill_unresponsive(time.time())
        self._version += 1

    async def _mark_lost_nodes(self) -> None:
        """A worker that is down and whose node is dead will not come back there (Ray restarts
        it elsewhere only if some node has room): say so, so that requests stop waiting for it.
        The cluster learns of a dead node by its health checks (~15 s with Ray's defaults);
        asked at most every NODES_EVERY_S, and only while some worker is down."""
        down = [v for v in self._views.values()
                if v.state in (RESTARTING, UNRESPONSIVE) and not v.node_lost
                and v.stats is not None and v.stats.node_id]
        now = time.monotonic()
        if not down or now - self._nodes_asked_at < NODES_EVERY_S:
            return
        self._nodes_asked_at = now
        try:
            live = await asyncio.wait_for(self._live_nodes(), self.poll_timeout_s)
        except Exception as exc:  # noqa: BLE001 - asked again in NODES_EVERY_S
            logger.warning("listing the cluster's live nodes failed: %r", exc)
            return
        for v in down:
            if v.stats.node_id not in live:
                logger.warning("worker %s: its node %s is dead", v.worker_id, v.stats.node_id)
                self._views[v.worker_id] = dataclasses.replace(
                    v, node_lost=True, error=f"its node {v.stats.node_id} is dead")

    def _kill_unresponsive(self, now: float) -> None:
        """Its requests failed over when it turned unresponsive; what it still holds (an
        accelerator, a step that never ends) comes back only with a new process. Checked
        once a round, and a round with a silent worker lasts poll_timeout_s + poll_interval_s:
        killed in the last round before the deadline, so never unresponsive past it."""
        ahead = self.poll_timeout_s + self.poll_interval_s
        for v in list(self._views.values()):
            if v.state != UNRESPONSIVE or not overdue(v.since, v.killed_at, now + ahead,
                                                      self.unresponsive_timeout_s):
                continue
            silent = now - max(v.since, v.killed_at or 0.0)
            logger.warning("worker %s unresponsive for %.0f s: killing it for a new process",
                           v.worker_id, silent)
            try:
                self._kill(v.handle)
            except Exception as exc:  # noqa: BLE001 - try again after another timeout
                logger.warning("killing worker %s failed: %r", v.worker_id, exc)
            self._views[v.worker_id] = dataclasses.replace(
                v, kills=v.kills + 1, killed_at=now,
                error=f"killed after {silent:.0f} s unresponsive ({v.error or 'no answer'})")

    async def _poll(self, view: WorkerView) -> WorkerView:
        now = time.time()
        incarnation, version = self._cache_from.get(view.worker_id, ("", -1))
        try:
            stats = await asyncio.wait_for(self._probe(view.handle, version),
                                           self.poll_timeout_s)
        except asyncio.TimeoutError:
            state = STARTING if view.state == STARTING else UNRESPONSIVE
            return _moved(view, state, now)
        except WorkerDown as down:  # a lost node's error stays: it says why nobody waits
            return dataclasses.replace(_moved(view, down.state, now),
                                       error=down.cause or (view.error if view.node_lost else None))
        except Exception as exc:  # noqa: BLE001 - an unknown failure: treat the worker as gone
            logger.warning("polling worker %s failed: %r", view.worker_id, exc)
            return dataclasses.replace(_moved(view, DEAD, now), error=repr(exc))
        restarted = view.stats is not None and stats.incarnation != view.stats.incarnation
        if stats.cache is not None:
            self._mirror_cache(view.worker_id, incarnation, stats)
            stats = dataclasses.replace(stats, cache=None)  # routers get it by cache_deltas
        view = _moved(view, READY, now)
        return dataclasses.replace(view, stats=stats, restarts=view.restarts + restarted,
                                   error=None, node_lost=False)

    def _mirror_cache(self, worker_id: str, incarnation: str, stats: WorkerStats) -> None:
        delta = stats.cache
        # A restarted process counts versions afresh: a delta against our old version would
        # apply to the wrong base. Ask for everything next time.
        usable = stats.incarnation == incarnation or delta.full
        if usable:
            self._caches[worker_id].mirror(sampled(delta, self.cache_sample))
        self._cache_from[worker_id] = (stats.incarnation, delta.version if usable else -1)

    # -- membership changes (the autoscaler's) ------------------------------------------------
    def views(self) -> list[WorkerView]:
        return list(self._views.values())

    def add_worker(self, worker_id: str, handle: Any) -> None:
        self._views[worker_id] = WorkerView(worker_id, STARTING, handle, since=time.time())
        self._caches[worker_id] = CacheSummary()
        self._version += 1
        self._handle_at[worker_id] = self._version

    def set_draining(self, worker_id: str, since: float) -> None:
        self._views[worker_id] = dataclasses.replace(self._views[worker_id], draining_since=since)
        self._version += 1

    def remove_worker(self, worker_id: str) -> None:
        del self._views[worker_id]
        for per_worker in (self._caches, self._drain, self._cache_from, self._handle_at):
            per_worker.pop(worker_id, None)
        self._version += 1

    def _ensure_polling(self) -> None:
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(self._poll_forever())

    async def _poll_forever(self) -> None:
        while True:
            try:
                await self.poll_once()
                if self.autoscaler is not None:
                    self.autoscaler.step(self, time.time())
            except Exception:  # noqa: BLE001 - keep polling whatever one round did
                logger.exception("poll round failed")
            await asyncio.sleep(self.poll_interval_s)


def _moved(view: WorkerView, state: str, now: float) -> WorkerView:
    return view if view.state == state else dataclasses.replace(view, state=state, since=now)


def restart_delay_s(crashes_in_a_row: int) -> float:
    """0 for the first crash, then 1, 2, 4, ... capped at BACKOFF_CAP_S."""
    if crashes_in_a_row <= 1:
        return 0.0
    return min(BACKOFF_CAP_S, BACKOFF_FIRST_S * 2.0 ** (crashes_in_a_row - 2))


def next_start(ledger: dict | None, now: float) -> tuple[float, dict]:
    """(seconds to wait, the ledger to keep) for a worker process starting at `now`.

    `ledger` is what the previous incarnation of the same actor kept ({"crashes", "started"}),
    None for the actor's first start. A start that follows one means the last process died."""
    if ledger is None:
        return 0.0, {"crashes": 0, "started": now}
    lived = now - ledger["started"]
    crashes = ledger["crashes"] + 1 if lived < HEALTHY_S else 1
    delay = restart_delay_s(crashes)
    return delay, {"crashes": crashes, "started": now + delay}


def overdue(state_since: float, killed_at: float | None, now: float, timeout_s: float) -> bool:
    """An unresponsive worker is killed once it has been silent `timeout_s`, counted from when
    it turned unresponsive or from the last kill, whichever is later (a kill takes a few
    seconds to land on a stopped process: it is not repeated meanwhile)."""
    return now - max(state_since, killed_at or 0.0) >= timeout_s
