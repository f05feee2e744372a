"""OutputMux: every request of one router on one worker, streamed back as one message per step.

Per-request streams cost one Ray streaming item per request per engine step: at 16 running
requests, 16 items (serialize, report to the owner, resolve and deserialize on the router) for
one step's tokens. A mux is one long-lived stream per router: each request is still driven by
`Worker.generate` (same coalescing, abort on leaving, refusals and engine failures), but its
items go into the router's inbox, and the router's stream yields everything in the inbox at
once: every request's new tokens of a step arrive as one message, and when the router reads
slower than the engine steps, several steps' worth. At low load a message still leaves as soon
as a step's outputs are delivered: nothing waits to fill a batch.

    router                         worker (one event loop)
    open(mux_id)  ── stream ──>    mux inbox ──> [(request_id, item), ...] per wake-up
    submit(mux_id, request...) ──> task: async for item in generate(...): inbox.put((rid, item))
                                         then (rid, END), or (rid, WorkerError) if it failed
    cancel(mux_id, request_id) ──> that task cancelled: generate's exit aborts the request
    the stream closed (router gone) -> every task of that mux cancelled
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

END = "end"  # a request's stream finished: no more items for it


class OutputMux:
    def __init__(self, generate):
        self._generate = generate   # Worker.generate
        self._inboxes: dict[str, asyncio.Queue] = {}
        self._tasks: dict[str, dict[str, asyncio.Task]] = {}  # mux id -> request id -> task

    def submit(self, mux_id: str, request_id: str, *args) -> None:
        """Start the request; its items go to the mux's inbox (created here if the router's
        stream has not arrived yet: the two calls race)."""
        inbox = self._inboxes.setdefault(mux_id, asyncio.Queue())
        tasks = self._tasks.setdefault(mux_id, {})
        task = asyncio.get_running_loop().create_task(
            self._drive(inbox, request_id, self._generate(request_id, *args)))
        tasks[request_id] = task
        task.add_done_callback(lambda _t: tasks.pop(request_id, None))

    def cancel(self, mux_id: str, request_id: str) -> None:
        task = self._tasks.get(mux_id, {}).get(request_id)
        if task is not None:
            task.cancel()

    async def stream(self, mux_id: str) -> AsyncIterator[list[tuple[str, object]]]:
        inbox = self._inboxes.setdefault(mux_id, asyncio.Queue())
        try:
            while True:
                items = [await inbox.get()]
                while not inbox.empty():
                    items.append(inbox.get_nowait())
                yield items
        finally:  # the router left (or died): nobody reads these requests any more
            self._inboxes.pop(mux_id, None)
            for task in list(self._tasks.pop(mux_id, {}).values()):
                task.cancel()

    @staticmethod
    async def _drive(inbox: asyncio.Queue, request_id: str, stream) -> None:
        try:
            async for item in stream:
                inbox.put_nowait((request_id, item))
        except asyncio.CancelledError:
            await stream.aclose()  # generate's finally aborts the request
            raise
        except Exception as exc:  # noqa: BLE001 - the router fails this request over
            inbox.put_nowait((request_id, exc))
            return
        inbox.put_nowait((request_id, END))
