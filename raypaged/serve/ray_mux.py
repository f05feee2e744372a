"""WorkerMux: a router's one output stream from one worker process, fanned out to its requests.

The router side of raypaged/serve/output_mux.py. `stream()` has the shape of a per-request Ray
stream (batches, a Rejected, WorkerUnavailable when the worker is lost), so Generation and its
failover do not know the difference. The worker stream ending or failing fails every request
on it over (WorkerUnavailable); the fleet client then opens a new mux for later requests.
"""
from __future__ import annotations

import asyncio
import uuid

import ray
from ray.exceptions import RayActorError, RayTaskError

from raypaged.serve.generation import WorkerUnavailable
from raypaged.serve.output_mux import END


class WorkerMux:
    def __init__(self, handle, worker_id: str, incarnation: str | None, owner: str):
        self.handle, self.worker_id, self.incarnation = handle, worker_id, incarnation
        self.mux_id = f"{owner}-{uuid.uuid4().hex[:12]}"
        self.dead: WorkerUnavailable | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._gen = handle.outputs.remote(self.mux_id)
        self._pump = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        try:
            async for ref in self._gen:
                for request_id, item in await ref:
                    queue = self._queues.get(request_id)
                    if queue is not None:  # None: the request was left; its cancel is sent
                        queue.put_nowait(item)
            lost = WorkerUnavailable(f"{self.worker_id}: its output stream ended")
        except asyncio.CancelledError:
            raise
        except (RayActorError, RayTaskError) as exc:
            lost = WorkerUnavailable(f"{self.worker_id}: {type(exc).__name__}")
        except Exception as exc:  # noqa: BLE001 - any broken stream: fail over
            lost = WorkerUnavailable(f"{self.worker_id}: {exc!r}")
        self.dead = lost
        for queue in self._queues.values():
            queue.put_nowait(lost)

    async def stream(self, request_id: str, token_ids, params, cache_salt, continuation=None):
        if self.dead is not None:
            raise self.dead
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue  # before submit: the first batch may beat its reply
        complete = False
        try:
            try:
                await self.handle.submit.remote(self.mux_id, request_id, token_ids, params,
                                                cache_salt, continuation)
            except (RayActorError, RayTaskError) as exc:
                raise WorkerUnavailable(f"{self.worker_id}: {type(exc).__name__}") from exc
            while True:
                item = await queue.get()
                if isinstance(item, str) and item == END:
                    complete = True
                    return
                if isinstance(item, WorkerUnavailable):
                    raise item
                if isinstance(item, BaseException):  # the engine failed (WorkerError)
                    raise WorkerUnavailable(f"{self.worker_id}: {item!r}") from item
                yield item
        finally:
            self._queues.pop(request_id, None)
            if not complete and self.dead is None:
                self.handle.cancel.remote(self.mux_id, request_id)  # aborts it there

    def close(self) -> None:
        self._pump.cancel()
        ray.cancel(self._gen)
