"""In-process links to Workers (no Ray): the router's WorkerLink over a Worker's own calls,
`generate`, one request's outputs read the way a router reads them, for worker tests, and
`abort`, the engine's abort of a request in flight."""
from __future__ import annotations

import asyncio

from raypaged.serve.messages import Lost, Rejected, WorkerUnavailable
from raypaged.serve.worker import Worker
from raypaged.serve.worker_link import WorkerLink


class LocalLink(WorkerLink):
    def __init__(self, worker: Worker, worker_id: str, owner: str = "local"):
        self.worker = worker
        self._stream = None
        super().__init__(worker_id, worker.incarnation, owner)

    def _messages(self):
        self._stream = self.worker.outputs(self.router_id)
        return self._stream

    async def _submit(self, *args) -> Rejected | None:
        return await self.worker.submit(*args)

    def _cancel(self, request_id: str) -> None:
        self.worker.cancel(request_id)

    def _close_stream(self) -> None:
        if self._stream is not None:  # its finally cancels this router's requests
            asyncio.get_running_loop().create_task(self._aclose(self._stream))

    @staticmethod
    async def _aclose(stream) -> None:
        try:
            await stream.aclose()
        except RuntimeError:  # still running: the pump's cancellation closes it
            pass


class LocalLinks:
    """One live link per worker, as RayFleetClient keeps them."""

    def __init__(self):
        self._links: dict[str, WorkerLink] = {}

    def link(self, view, make=LocalLink) -> WorkerLink:
        link = self._links.get(view.worker_id)
        if link is None or link.dead is not None or link.worker is not view.handle:
            link = self._links[view.worker_id] = make(view.handle, view.worker_id)
        return link


async def generate(worker: Worker, request_id: str, prompt, params, cache_salt=None,
                   continuation=None):
    """Each message's outputs of this one request, until its n samples finish; a Rejected if
    refused; WorkerUnavailable if the engine failed. Leaving early cancels it."""
    router_id = f"solo-{request_id}"
    stream = worker.outputs(router_id)
    left = params.n
    try:
        rejected = await worker.submit(router_id, request_id, prompt, params, cache_salt,
                                       continuation)
        if rejected is not None:
            yield rejected
            return
        async for message in stream:
            outs = message.get(request_id)
            if not outs:
                continue
            for out in outs:
                if isinstance(out, Lost):
                    raise WorkerUnavailable(out.message)
            left -= sum(out.finish_reason is not None for out in outs)
            yield outs
            if left <= 0 or any(out.finish_reason == "error" for out in outs):
                return
    finally:
        await stream.aclose()  # cancels the request if it still runs


def abort(worker: Worker, request_id: str) -> None:
    """Abort the request in the worker's engine (from its event loop): its outputs end with
    finish_reason "abort", as a router's cancel does not end them."""
    def deliver(fut: asyncio.Future) -> None:
        if not fut.cancelled() and fut.exception() is None:
            worker._deliver(fut.result() or [])
    worker._engine_loop().call(lambda e: e.abort(request_id)).add_done_callback(deliver)
