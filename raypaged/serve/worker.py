"""Worker: one engine (its own block pool, KV cache and prefix cache) behind async streams.

A plain class, usable and tested without Ray; `WorkerActor` (actors.py) is the one-line
Ray shell. `generate` is an async generator: it yields lists of SequenceOutput deltas (every
delta ready since the last yield, so a slow reader gets fewer, larger messages) until all n
samples finish. Leaving the generator early for any reason (the caller cancelled, disconnected,
or the Ray stream was cancelled) aborts the request, which frees its blocks.
"""
from __future__ import annotations

import asyncio
import os
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

from raypaged.core.cache_summary import SummaryDelta
from raypaged.core.contracts import Continuation, EngineStats
from raypaged.core.engine_core import ERROR
from raypaged.core.sampling_params import SamplingParams
from raypaged.outputs import SequenceOutput
from raypaged.serve.engine_loop import EngineLoop
from raypaged.serve.output_mux import OutputMux


@dataclass(frozen=True)
class Rejected:
    """The worker refused a request before admitting it (nothing was allocated)."""

    message: str
    queue_full: bool = False  # True: try another worker / later; False: the request is invalid
    # Rejected may also come after outputs: the request made a step fail (its own fault).


@dataclass(frozen=True)
class KVBudget:
    kv_budget_bytes: int
    bytes_per_token: int
    bytes_per_block: int
    num_blocks: int
    num_tokens: int
    max_seqs_at_max_model_len: int


@dataclass(frozen=True)
class WorkerStats:
    worker_id: str
    incarnation: str          # new for every process start: the controller sees restarts
    pid: int
    model_name: str
    max_model_len: int
    block_size: int
    budget: KVBudget
    engine: EngineStats
    num_active: int           # requests inside generate(): the routing load
    graph_steps: int = 0      # model steps replayed from a CUDA graph
    eager_steps: int = 0      # model steps run eagerly
    cache: SummaryDelta | None = None  # prefix-cache changes since the version asked for

    @property
    def kv_cache_usage(self) -> float:
        return self.engine.kv_cache_usage


@dataclass(frozen=True)
class Health:
    """The answer to the controller's liveness probe."""

    incarnation: str
    stalled_s: float  # how long the engine has had work but finished no step (0: progressing)


class WorkerError(RuntimeError):
    """The engine failed while running this request (the worker itself is still alive)."""


class Worker:
    def __init__(self, engine, worker_id: str, max_queued: int = 1024):
        self.engine = engine
        self.worker_id = worker_id
        self.max_queued = max_queued
        self.incarnation = uuid.uuid4().hex[:12]
        self.started_at = time.time()
        plan = engine.plan
        self.budget = KVBudget(plan.kv_budget_bytes, plan.bytes_per_token, plan.bytes_per_block,
                               plan.num_blocks, plan.num_tokens, plan.max_seqs_at_max_model_len)
        self._loop: EngineLoop | None = None  # started on first use: it needs the event loop
        self._event_loop: asyncio.AbstractEventLoop | None = None  # generate's
        self._streams: dict[str, asyncio.Queue] = {}
        self._seen_stats = None           # the step loop's last published stats, and since when
        self._seen_at = time.monotonic()
        self._mux = OutputMux(self.generate)  # per-router streams (output_mux.py)

    # -- requests --------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams, cache_salt: str | None = None,
                       continuation: Continuation | None = None
                       ) -> AsyncIterator[list[SequenceOutput] | Rejected]:
        loop = self._engine_loop()
        if request_id in self._streams:
            yield Rejected(f"request id {request_id!r} is already in use")
            return
        if self._queue_full():
            yield Rejected(f"worker {self.worker_id} has {self.max_queued} requests waiting for "
                           "KV cache space", queue_full=True)
            return
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = queue
        remaining = params.n  # samples not finished yet
        try:
            try:
                await loop.call(lambda e: e.add_request(request_id, list(prompt_token_ids), params,
                                                        cache_salt, continuation))
            except ValueError as exc:
                remaining = 0
                yield Rejected(str(exc))
                return
            while remaining:
                batch = [await queue.get()]
                while not queue.empty():
                    batch.append(queue.get_nowait())
                for item in batch:
                    if isinstance(item, BaseException):
                        raise WorkerError(f"worker {self.worker_id}: {item!r}") from item
                failed = next((o for o in batch if o.finish_reason == ERROR), None)
                if failed is not None:
                    # This request broke a step (its own input): the engine has already
                    # dropped it and kept the others. Not a worker fault: never retried.
                    remaining = 0
                    yield Rejected(str(failed.stop_reason))
                    return
                remaining -= sum(1 for out in batch if out.finish_reason is not None)
                yield batch
        finally:
            self._streams.pop(request_id, None)
            if remaining:
                # FIFO inbox: runs after the add_request above even if that is still queued.
                loop.call_nowait(lambda e: e.abort(request_id))

    # -- the same requests, multiplexed: one stream per router (output_mux.py) ---------------
    async def submit(self, mux_id: str, request_id: str, prompt_token_ids: list[int],
                     params: SamplingParams, cache_salt: str | None = None,
                     continuation: Continuation | None = None) -> None:
        """Start `generate`; its items go out on the stream `outputs(mux_id)`."""
        self._mux.submit(mux_id, request_id, prompt_token_ids, params, cache_salt, continuation)

    async def cancel(self, mux_id: str, request_id: str) -> None:
        """The router left the request: leaving its generate aborts it."""
        self._mux.cancel(mux_id, request_id)

    async def outputs(self, mux_id: str) -> AsyncIterator[list[tuple[str, object]]]:
        """[(request_id, batch | Rejected | "end" | WorkerError), ...]: everything ready."""
        stream = self._mux.stream(mux_id)
        try:
            async for items in stream:
                yield items
        finally:  # closing it cancels the mux's requests (the router is gone)
            await stream.aclose()

    def abort(self, request_id: str) -> None:
        """A control call: it may run on another thread than generate (its own Ray concurrency
        group), so it hands the abort to generate's event loop; the request's stream ends with
        finish_reason "abort"."""
        if self._event_loop is not None:
            self._event_loop.call_soon_threadsafe(self._abort_now, request_id)

    def _abort_now(self, request_id: str) -> None:
        def deliver(fut: asyncio.Future) -> None:
            if not fut.cancelled() and fut.exception() is None:
                self._deliver(fut.result() or [])
        self._engine_loop().call(lambda e: e.abort(request_id)).add_done_callback(deliver)

    # -- what the controller and router read -----------------------------------------------
    def stats(self, cache_since: int | None = None) -> WorkerStats:
        """The engine's latest stats; with `cache_since`, also what its prefix cache gained and
        lost since that summary version (the controller mirrors it for routers)."""
        engine_stats = self._loop.stats if self._loop is not None else self.engine.stats()
        cache = None if cache_since is None else self.engine.cache_summary().delta_since(cache_since)
        runner = getattr(self.engine, "runner", None)  # counters are plain ints: safe to read
        return WorkerStats(
            worker_id=self.worker_id, incarnation=self.incarnation, pid=os.getpid(),
            model_name=self.engine.model_name, max_model_len=self.engine.max_model_len,
            block_size=self.engine.block_size, budget=self.budget, engine=engine_stats,
            num_active=len(self._streams),
            graph_steps=getattr(runner, "num_graph_steps", 0),
            eager_steps=getattr(runner, "num_eager_steps", engine_stats.num_steps), cache=cache)

    def health(self) -> Health:
        """Answered while the process lives; `stalled_s` tells a hung engine step from a busy
        one: the step thread publishes new stats after every step, so stats that stay the same
        object while requests wait mean no step has finished since."""
        now = time.monotonic()
        stats = self._loop.stats if self._loop is not None else None
        if stats is not self._seen_stats:
            self._seen_stats, self._seen_at = stats, now
        busy = stats is not None and (stats.num_running or stats.num_waiting)
        return Health(self.incarnation, now - self._seen_at if busy else 0.0)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def shutdown(self) -> None:
        if self._loop is not None:
            self._loop.stop()

    # -- internals -------------------------------------------------------------------------
    def _engine_loop(self) -> EngineLoop:
        if self._loop is None:
            self._event_loop = asyncio.get_running_loop()
            self._loop = EngineLoop(self.engine, asyncio.get_running_loop(),
                                    on_outputs=self._deliver, on_crash=self._fail_all)
        return self._loop

    def _queue_full(self) -> bool:
        """Whether max_queued requests already wait for KV space (as of the last step).

        Requests that arrived since, or wait only for a later step's token budget, do not
        count: a burst the KV cache can hold is admitted whole, however fast it comes."""
        blocked = self._loop.stats.num_blocked if self._loop is not None else 0
        return blocked > 0 and blocked >= self.max_queued

    def _deliver(self, outputs: list[SequenceOutput]) -> None:
        for out in outputs:
            queue = self._streams.get(out.request_id)
            if queue is not None:  # None: the caller left; its abort is queued
                queue.put_nowait(out)

    def _fail_all(self, exc: BaseException) -> None:
        for request_id, queue in list(self._streams.items()):
            queue.put_nowait(exc)
            self._loop.call_nowait(lambda e, rid=request_id: e.abort(rid))
