"""WorkerLink: a router's one stream from one worker process, split once into its requests.

The router side of Worker.outputs (worker.py): each message holds every request's new outputs
of an engine step, keyed by request id, and goes to that request's sink as it is. A stream
that ends or breaks hands every request on it WorkerUnavailable (they fail over) and is
cancelled, so the worker cancels whatever of them it still runs; the fleet client then opens
a new link for later requests. `RayWorkerLink` talks to a worker actor; tests link in-process
Workers through the same four calls.
"""
from __future__ import annotations

import asyncio
import contextvars
import uuid
from typing import Callable

import ray
from ray.exceptions import RayActorError, RayTaskError

from raypaged.serve.messages import Rejected, WorkerUnavailable

Sink = Callable[[list], None]  # gets a request's outputs of a message, or WorkerUnavailable


class WorkerLink:
    """The four calls to the worker are a subclass's: `_messages()` (the stream),
    `_submit(*args)`, `_cancel(request_id)` and `_close_stream()`."""

    def __init__(self, worker_id: str, incarnation: str | None, owner: str):
        self.worker_id, self.incarnation = worker_id, incarnation
        self.router_id = f"{owner}-{uuid.uuid4().hex[:12]}"
        self.dead: WorkerUnavailable | None = None
        self._sinks: dict[str, Sink] = {}
        # the stream outlives the request that happens to open it
        self._pump = outside_requests(asyncio.get_running_loop().create_task, self._run())

    # -- requests ----------------------------------------------------------------------------
    async def submit(self, request_id: str, token_ids, params, cache_salt, continuation,
                     sink: Sink, block_hashes=()) -> Rejected | None:
        """Send the request; its outputs go to `sink` from now on (they may beat the reply).
        `block_hashes`: routing.PromptKeys.hashes, for the worker (Worker.submit)."""
        if self.dead is not None:
            raise WorkerUnavailable(str(self.dead), reached=False)
        self._sinks[request_id] = sink
        try:
            rejected = await self._submit(self.router_id, request_id, token_ids, params,
                                          cache_salt, continuation, block_hashes)
        except BaseException:  # cancelled, or the worker is gone: it may have accepted it
            self.leave(request_id)
            raise
        if rejected is not None:
            self.leave(request_id, cancel=False)
        return rejected

    def leave(self, request_id: str, cancel: bool = True) -> None:
        """Stop reading the request; the worker cancels it (frees its blocks). `cancel` False:
        every sample ended (or it was refused), the worker has forgotten it already."""
        if self._sinks.pop(request_id, None) is not None and cancel and self.dead is None:
            self._cancel(request_id)

    def close(self) -> None:
        self._pump.cancel()
        self._close_stream()

    async def _run(self) -> None:
        try:
            async for message in self._messages():
                for request_id, items in message.items():
                    sink = self._sinks.get(request_id)
                    if sink is not None:  # None: left; the worker has its cancel
                        sink(items)
            lost = WorkerUnavailable(f"{self.worker_id}: its output stream ended")
        except (RayActorError, RayTaskError) as exc:
            lost = WorkerUnavailable(f"{self.worker_id}: {type(exc).__name__}")
        except Exception as exc:  # noqa: BLE001 - any broken stream: fail over
            lost = WorkerUnavailable(f"{self.worker_id}: {exc!r}")
        self.dead = lost
        self._close_stream()  # a worker still alive cancels this router's requests
        sinks, self._sinks = self._sinks, {}
        for sink in sinks.values():
            sink(lost)


def outside_requests(call, *args):
    """`call(*args)` as no request's child. Ray cancels a task together with every call it
    submitted that is still pending, and Serve's Python proxy cancels a request so when its
    client leaves: the worker's cancel, sent by the request on its way out, was lost with it
    (the request ran on to max_tokens), and a link's stream would end with the request that
    opened it. Ray finds a call's parent in the context variables of the asyncio task that
    submits it; an empty context has none (a task created in it copies it)."""
    return contextvars.Context().run(call, *args)


class RayWorkerLink(WorkerLink):
    def __init__(self, handle, worker_id: str, incarnation: str | None, owner: str):
        self.handle = handle
        self._gen = None
        super().__init__(worker_id, incarnation, owner)

    async def _messages(self):
        self._gen = self.handle.outputs.remote(self.router_id)
        async for ref in self._gen:
            yield await ref

    async def _submit(self, *args) -> Rejected | None:
        try:
            return await self.handle.submit.remote(*args)
        except (RayActorError, RayTaskError) as exc:
            # reached: a process that dies during the call answers ActorUnavailableError as
            # one restarting before it does; only a link already down is sure it never ran
            raise WorkerUnavailable(f"{self.worker_id}: {type(exc).__name__}") from exc

    def _cancel(self, request_id: str) -> None:
        outside_requests(self.handle.cancel.remote, request_id)

    def _close_stream(self) -> None:
        if self._gen is not None:
            ray.cancel(self._gen)
