"""TTFT-SLO load shedding over real HTTP (uvicorn in a thread, a slow fake engine, the real
Controller polling it, no Ray): with requests queued behind a full KV cache the fleet predicts a
TTFT over --ttft-slo-s, and a new request gets 503 + Retry-After naming the setting before
anything is queued; the same request with the fleet idle again gets 200."""
from __future__ import annotations

import asyncio
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from starlette.applications import Starlette
from starlette.routing import Mount

from http_server import serving
from local_fleet import LocalFleet
from serve_testing import wait_for
from raypaged.core.ttft_slo import WorkerQueue, best_worker
from raypaged.serve.config import ServeOptions
from raypaged.serve.controller import Controller
from raypaged.serve.dispatch import Dispatcher
from raypaged.serve.frontend import ModelInfo, OpenAIFrontend
from raypaged.serve.http_app import build_http_app
from raypaged.serve.metrics import RequestMetrics, render
from raypaged.serve.routing import Router
from raypaged.serve.ttft_shed import TTFTShedder

SLO_S = 0.5
# 200 prompt + 40 output tokens: 15 of the fake engine's 64 blocks, so 4 run at once and the
# rest wait for KV blocks; a request runs 40 steps of 20 ms
# (distinct prompts: a shared one would be prefilled once and cached)
LOAD = [{"model": "fake-model", "prompt": chr(ord("a") + i) * 200, "max_tokens": 40,
         "ignore_eos": True} for i in range(16)]
PROBE = {"model": "fake-model", "prompt": "a short question", "max_tokens": 4,
         "ignore_eos": True}


class ControlledFleet(LocalFleet):
    """LocalFleet whose snapshot is the real Controller's, polled every 0.1 s in a thread of
    its own (the router reads the last one, as RayFleetClient does)."""

    def __init__(self, **kw):
        super().__init__(**kw)

        async def probe(worker, cache_since):
            return worker.stats()

        self.controller = Controller(list(self.workers.items()), probe, poll_interval_s=0.1)
        self._snap = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=asyncio.run, args=(self._poll(),), daemon=True)
        self._thread.start()
        while self._snap is None or not self._snap.ready():
            time.sleep(0.01)

    async def _poll(self):
        while not self._stop.is_set():
            await self.controller.poll_once()
            self._snap = await self.controller.snapshot()
            await asyncio.sleep(self.controller.poll_interval_s)

    def snapshot(self):
        return self._snap

    def shutdown(self):
        self._stop.set()
        self._thread.join(5)
        super().shutdown()


def make_app(fleet, shed: bool):
    metrics = RequestMetrics()
    engine = next(iter(fleet.workers.values())).engine
    info = ModelInfo("fake-model", engine.max_model_len, len(engine.tokenizer), 0)
    frontend = OpenAIFrontend(Dispatcher(fleet, Router(ServeOptions(), engine.block_size),
                                         metrics), engine.tokenizer, info)
    if shed:
        frontend.shedder = TTFTShedder(SLO_S, fleet.snapshot, metrics)
    return build_http_app(frontend, fleet.snapshot, metrics,
                          lambda: render(fleet.snapshot(), metrics.snapshot(), info.name),
                          None, 1 << 20)


def predicted_s(fleet) -> float | None:
    """What the rule predicts for PROBE on the current snapshot (None: no rate measured)."""
    ready = [w for w in fleet.snapshot().ready()]
    found = best_worker(len(PROBE["prompt"]), [
        WorkerQueue(w.stats.engine.num_queued_tokens, w.drain_tokens_per_s) for w in ready])
    return None if found is None else found[1]


def test_a_request_predicted_over_the_ttft_slo_gets_503_and_the_idle_fleet_serves_it():
    fleet = ControlledFleet(n=1, step_delay_s=0.02)
    # /load: another router of the same fleet, without shedding (it brings the queue); /: ours
    app = Starlette(routes=[Mount("/load", app=make_app(fleet, shed=False)),
                            Mount("/", app=make_app(fleet, shed=True))])
    try:
        with serving(app) as url, ThreadPoolExecutor(16) as pool:
            load = [pool.submit(httpx.post, url + "/load/v1/completions", json=body, timeout=120)
                    for body in LOAD]
            # the controller has measured the drain rate, and the queue behind the KV cache
            # predicts a TTFT over the SLO (16 x 200 tokens, ~4 admitted per 0.8 s)
            assert wait_for(lambda: (predicted_s(fleet) or 0) > 2 * SLO_S, 30), predicted_s(fleet)
            busy = httpx.post(url + "/v1/completions", json=PROBE, timeout=60)
            metrics = httpx.get(url + "/metrics", timeout=60).text
            assert all(f.result().status_code == 200 for f in load)
            # idle: nothing waiting in the snapshot; the measured rate stays
            assert wait_for(lambda: all(w.stats.engine.num_queued_tokens == 0
                                        for w in fleet.snapshot().ready()), 30)
            assert predicted_s(fleet) is not None
            idle = httpx.post(url + "/v1/completions", json=PROBE, timeout=60)
    finally:
        fleet.shutdown()
    assert busy.status_code == 503, busy.text
    retry_after = int(busy.headers["retry-after"])
    assert 1 <= retry_after <= 60
    err = busy.json()["error"]
    assert err["code"] == "ttft_slo_exceeded" and err["type"] == "service_unavailable"
    assert "ttft_slo_s" in err["message"] and "--ttft-slo-s" in err["message"]
    assert f"retry after {retry_after} s" in err["message"]
    assert re.search(r'raypaged:shed_requests_total\{model_name="fake-model",reason="ttft_slo"\} '
                     r'1\.0', metrics), metrics
    assert idle.status_code == 200, idle.text
    assert idle.json()["usage"]["completion_tokens"] == 4
