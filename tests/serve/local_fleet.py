"""An in-process fleet for testing the HTTP layer without Ray: Workers on fake engines, and
workers that fail on command."""
from __future__ import annotations

import asyncio
import itertools

import httpx

from fake_engine import FakeEngine
from raypaged.core.cache_summary import CacheView
from raypaged.serve.config import ServeOptions
from raypaged.serve.fleet import (DEAD, READY, RESTARTING, UNRESPONSIVE, FleetSnapshot,
                                  WorkerView)
from raypaged.serve.frontend import ModelInfo, OpenAIFrontend
from local_link import LocalLink, LocalLinks
from raypaged.serve.dispatch import Dispatcher
from raypaged.serve.messages import WorkerUnavailable
from raypaged.serve.http_app import build_http_app
from raypaged.serve.metrics import RequestMetrics, render
from raypaged.serve.routing import Router
from raypaged.serve.worker import Worker

BEFORE_FIRST, MID_STREAM = "before_first", "mid_stream"
FROZEN, FROZEN_MID_STREAM = "frozen", "frozen_mid_stream"  # hang; the snapshot says unresponsive
DRAINED_MID_STREAM = "drained_mid_stream"  # leaves the snapshot, as a drained worker does
CRASH_AT = 15  # the message of a crashing request (LocalFleet.crash_seed) that kills its worker


class LocalFleet:
    def __init__(self, n: int = 2, max_queued: int = 1024, step_delay_s: float = 0.0,
                 restart_on_death: bool = False):
        self.step_delay_s, self.max_queued = step_delay_s, max_queued
        self.workers = {f"worker-{i}": self._new_worker(f"worker-{i}") for i in range(n)}
        self.failing: dict[str, str] = {}  # worker id -> one of the modes above
        self.frozen: set[str] = set()  # workers the snapshot reports as unresponsive
        self.drained: set[str] = set()  # workers the snapshot no longer lists
        # workers that died mid-stream: dead, or restarting until restart() when the fleet
        # restarts them (as Ray does)
        self.dead: set[str] = set()
        self.restarting: set[str] = set()
        self.node_lost: set[str] = set()  # down workers whose node the controller saw die
        # a request with this seed kills each worker it runs on at its CRASH_AT-th message (as
        # fake_engine.CRASH_SEED does a Ray worker's process): every request there loses it
        self.crash_seed: int | None = None
        self.crash_sent_to: list[str] = []  # the workers a request with it was sent to
        self.restart_on_death = restart_on_death
        self._versions = itertools.count()
        self._links = LocalLinks()

    def _new_worker(self, worker_id: str) -> Worker:
        return Worker(FakeEngine(step_delay_s=self.step_delay_s), worker_id, self.max_queued)

    def _state(self, worker_id: str) -> str:
        if worker_id in self.frozen:
            return UNRESPONSIVE
        return (RESTARTING if worker_id in self.restarting else
                DEAD if worker_id in self.dead else READY)

    def died(self, worker_id: str) -> None:
        (self.restarting if self.restart_on_death else self.dead).add(worker_id)

    def restart(self, worker_id: str) -> None:
        """A new process (a new incarnation) in place of one that died, healthy."""
        self.workers[worker_id].shutdown()
        self.workers[worker_id] = self._new_worker(worker_id)
        self.failing.pop(worker_id, None)
        self.restarting.discard(worker_id)

    def snapshot(self) -> FleetSnapshot:
        """A fresh view every time (the Ray fleet's is refreshed in the background)."""
        caches = {}
        for wid, w in self.workers.items():
            caches[wid] = CacheView()
            caches[wid].apply(w.engine.cache_summary().delta_since(-1))
        return FleetSnapshot(next(self._versions), tuple(
            WorkerView(wid, self._state(wid), w, w.stats(), node_lost=wid in self.node_lost)
            for wid, w in self.workers.items() if wid not in self.drained), caches=caches)

    def link(self, view) -> LocalLink:
        mode = self.failing.get(view.worker_id)
        return self._links.link(view, lambda w, wid: FaultyLink(w, wid, self, mode))

    async def _freeze(self, worker_id: str) -> None:
        """Never answer again; the controller's probe notices (the snapshot turns)."""
        self.frozen.add(worker_id)
        await asyncio.Event().wait()

    def shutdown(self) -> None:
        for w in self.workers.values():
            w.shutdown()


class FaultyLink(LocalLink):
    """A link that fails as its worker's mode says: at submit, or after two messages."""

    def __init__(self, worker, worker_id, fleet: LocalFleet, mode: str | None):
        self.fleet, self.mode = fleet, mode
        self.crashing: set[str] = set()  # request ids with the fleet's crash seed
        super().__init__(worker, worker_id)

    async def _submit(self, *args):  # (router id, request id, prompt, params, ...)
        if self.fleet.crash_seed is not None and args[3].seed == self.fleet.crash_seed:
            self.crashing.add(args[1])
            self.fleet.crash_sent_to.append(self.worker_id)
        if self.mode == BEFORE_FIRST:
            raise WorkerUnavailable(f"{self.worker_id} is gone", reached=False)
        if self.mode == FROZEN:
            await self.fleet._freeze(self.worker_id)
        return await super()._submit(*args)

    async def _messages(self):
        count = crashes = 0
        async for message in super()._messages():
            yield message
            count += 1
            crashed = sum(rid in self.crashing for rid in message)
            if crashed and (crashes := crashes + crashed) >= CRASH_AT:
                self.fleet.died(self.worker_id)
                raise WorkerUnavailable(f"{self.worker_id} crashed")
            if self.mode == MID_STREAM and count >= 2:
                self.fleet.died(self.worker_id)
                raise WorkerUnavailable(f"{self.worker_id} died mid-stream")
            if self.mode == FROZEN_MID_STREAM and count >= 2:
                await self.fleet._freeze(self.worker_id)
            if self.mode == DRAINED_MID_STREAM and count >= 2:
                self.fleet.drained.add(self.worker_id)
                await asyncio.Event().wait()


def local_app(fleet: LocalFleet, api_key: str | None = None, max_request_bytes: int = 1 << 20,
              options: ServeOptions = ServeOptions()):
    metrics = RequestMetrics()
    engine = next(iter(fleet.workers.values())).engine
    info = ModelInfo("fake-model", engine.max_model_len, len(engine.tokenizer), 0)
    dispatcher = Dispatcher(fleet, Router(options, engine.block_size), metrics)
    frontend = OpenAIFrontend(dispatcher, engine.tokenizer, info,
                              request_timeout_s=options.request_timeout_s)
    app = build_http_app(frontend, fleet.snapshot, metrics,
                         lambda: render(fleet.snapshot(), metrics.snapshot(), info.name),
                         api_key, max_request_bytes)
    return app, metrics


def client_for(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://local",
                             timeout=30)


def run_against(fleet: LocalFleet, test, options: ServeOptions = ServeOptions()):
    """(what `test(client)` returns, metrics), its client on a local app over `fleet`, which is
    shut down after."""
    app, metrics = local_app(fleet, options=options)

    async def main():
        async with client_for(app) as client:
            return await test(client)
    try:
        return asyncio.run(main()), metrics
    finally:
        fleet.shutdown()


def post_once(fleet: LocalFleet, body: dict, path: str = "/v1/completions",
              options: ServeOptions = ServeOptions()):
    """(response, metrics) of one POST to a local app over `fleet`, which is shut down after."""
    return run_against(fleet, lambda client: client.post(path, json=body), options)
