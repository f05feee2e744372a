"""An engine pool in this process, for job tests that need no Ray: the real frontend, dispatcher
and router over one real Worker on the fake engine (tests/serve/fake_engine.py), whose streams
can be made to fail as a lost worker (WorkerUnavailable) or a bug (RuntimeError) would."""
from __future__ import annotations

from raypaged.serve.config import ServeOptions
from raypaged.serve.fleet import READY, FleetSnapshot, WorkerView
from raypaged.serve.frontend import ModelInfo, OpenAIFrontend
from raypaged.serve.dispatch import Dispatcher
from raypaged.serve.messages import WorkerUnavailable
from raypaged.serve.metrics import RequestMetrics
from raypaged.serve.routing import Router
from raypaged.serve.worker import Worker
from tests.serve.fake_engine import FakeEngine
from tests.serve.local_link import LocalLink, LocalLinks

ALWAYS = -1


class FlakyWorker:
    """A FleetClient over one in-process Worker. `failures`: prompt text -> how many of its
    streams fail before one works (ALWAYS: every one), and with what exception class."""

    def __init__(self, worker: Worker, failures: dict[str, tuple[int, type]]):
        self.worker, self.failures = worker, dict(failures)
        self.attempts: dict[str, int] = {}
        self._links = LocalLinks()

    def snapshot(self) -> FleetSnapshot:
        return FleetSnapshot(1, (WorkerView("w0", READY, self.worker, self.worker.stats()),))

    def link(self, view) -> LocalLink:
        return self._links.link(view, lambda w, wid: FlakyLink(w, wid, self))


class FlakyLink(LocalLink):
    def __init__(self, worker, worker_id, flaky: FlakyWorker):
        self.flaky = flaky
        super().__init__(worker, worker_id)

    async def _submit(self, router_id, request_id, token_ids, *rest):
        prompt = bytes(t for t in token_ids if t < 256).decode()
        for text, (times, error) in self.flaky.failures.items():
            if text in prompt:
                self.flaky.attempts[text] = self.flaky.attempts.get(text, 0) + 1
                if times == ALWAYS or self.flaky.attempts[text] <= times:
                    raise error(f"{text}: failed on purpose")
        return await super()._submit(router_id, request_id, token_ids, *rest)


class LocalPool:
    def __init__(self, failures: dict[str, tuple[int, type]] | None = None):
        engine = FakeEngine(max_model_len=256)
        self.worker = Worker(engine, "w0")
        self.fleet = FlakyWorker(self.worker, failures or {})
        info = ModelInfo(engine.model_name, engine.max_model_len, len(engine.tokenizer), 0)
        # suspect_s=0: a worker that failed a stream is offered to the next row at once
        dispatcher = Dispatcher(self.fleet, Router(ServeOptions(), engine.block_size),
                                RequestMetrics(), suspect_s=0)
        self.frontend = OpenAIFrontend(dispatcher, engine.tokenizer, info)
        self.block_size = engine.block_size

    def check_alive(self) -> None:
        pass  # one in-process worker: never gone for good

    async def stop(self) -> None:
        self.worker.shutdown()


def local_pool(failures: dict[str, tuple[int, type]] | None = None):
    """For BatchJob.start_pool: `async (serve_args) -> LocalPool`."""
    async def start(serve_args) -> LocalPool:
        return LocalPool(failures)
    return start


__all__ = ["ALWAYS", "LocalPool", "WorkerUnavailable", "local_pool"]
