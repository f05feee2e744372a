"""The HTTP API in this process, on one real engine: what a batch line's body must equal."""
from __future__ import annotations

import httpx

from raypaged.config import EngineArgs
from raypaged.engine import Engine
from raypaged.serve.config import ServeOptions
from raypaged.serve.fleet import READY, FleetSnapshot, WorkerView
from raypaged.serve.frontend import ModelInfo, OpenAIFrontend
from raypaged.serve.dispatch import Dispatcher
from raypaged.serve.http_app import build_http_app
from raypaged.serve.metrics import RequestMetrics
from raypaged.serve.routing import Router
from raypaged.serve.worker import Worker
from tests.serve.local_link import LocalLink, LocalLinks


class OneWorker:
    """A FleetClient over one in-process Worker."""

    def __init__(self, worker: Worker):
        self.worker = worker
        self._links = LocalLinks()

    def snapshot(self) -> FleetSnapshot:
        return FleetSnapshot(0, (WorkerView("w0", READY, self.worker, self.worker.stats()),))

    def link(self, view) -> LocalLink:
        return self._links.link(view)


async def http_answers(engine_kwargs: dict, requests: list[tuple[str, dict]]
                       ) -> list[tuple[int, dict]]:
    """(status, body) of POSTing each (url, body) in turn to the HTTP app."""
    engine = Engine.from_args(EngineArgs(**engine_kwargs))
    worker = Worker(engine, "w0")
    fleet, metrics = OneWorker(worker), RequestMetrics()
    info = ModelInfo(engine.model_name, engine.max_model_len, len(engine.tokenizer), 0)
    frontend = OpenAIFrontend(Dispatcher(fleet, Router(ServeOptions(), engine.block_size),
                                         metrics), engine.tokenizer, info)
    app = build_http_app(frontend, fleet.snapshot, metrics, lambda: b"", None, 1 << 20)
    answers = []
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://local", timeout=120) as client:
            for url, body in requests:
                r = await client.post(url, json=body)
                answers.append((r.status_code, r.json()))
    finally:
        worker.shutdown()
    return answers
