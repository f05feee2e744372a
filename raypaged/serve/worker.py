"""Worker: one engine (its own block pool, KV cache and prefix cache) streaming to routers.

A plain class, usable and tested without Ray; `WorkerActor` (actors.py) is the Ray shell.
Each router holds one stream per worker, and a step's outputs are split once, by router:

    router                                   worker (one event loop)
    outputs(router_id) ───── stream ──────>  outbox[router_id]: {request_id: [outputs]}
    submit(router_id, request_id, ...) ───>  admission (QueueBound) -> engine.add_request
      <── None (accepted) | Rejected            the step thread runs the engine (engine_loop.py)
    cancel(request_id) ───────────────────>  abort in the engine, blocks freed
      <── {request_id: [SequenceOutput | Lost], ...}: everything ready since the last message,
          one message per step when the router keeps up, several steps' worth when it does not

A request counts from its accepted submit until its last sample finishes or it is cancelled;
a router's stream that ends for any reason (closed, cancelled, broken) cancels its requests.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import math
import os
import time
import uuid
from typing import AsyncIterator

from raypaged.core.contracts import Continuation
from raypaged.core.engine_core import ERROR
from raypaged.core.fair_admission import blocks_needed
from raypaged.core.sampling_params import SamplingParams
from raypaged.core.ttft_slo import RETRY_AFTER_MAX_S
from raypaged.outputs import SequenceOutput
from raypaged.serve.engine_loop import EngineLoop
from raypaged.serve.messages import Health, Lost, Rejected, WorkerStats

PACE_WINDOW = 64  # finishes QueueBound's pace is measured over


class QueueBound:
    """A worker's admission, counting every request from the router's submit until it
    finishes, in O(1) per request.

    The engine's own counters lag: they change only at the next step, so a flood of submits
    between two steps would all see the same empty queue. This counts a request the moment the
    worker accepts it, with the KV blocks it may grow to (prompt + max_tokens, each of n
    samples); the requests of average size that fit in the pool at once can run, the rest are
    queued:

        fit    = count x num_blocks // blocks   (blocks: what every accepted request may need)
        queued = count - fit

    A burst the KV cache can hold is admitted whole, whatever `max_queued`; past it, a request
    is refused while `max_queued` (>= 1 of them) are queued, with a Retry-After from the pace at
    which this worker has been finishing requests."""

    def __init__(self, max_queued: int, num_blocks: int):
        self.max_queued, self.num_blocks = max_queued, num_blocks
        self.count = 0     # requests accepted and not finished
        self.blocks = 0    # the KV blocks they may grow to, together
        self._finished_at: collections.deque[float] = collections.deque(maxlen=PACE_WINDOW)

    def queued(self) -> int:
        return self.count - min(self.count, self.count * self.num_blocks // max(self.blocks, 1))

    def full(self) -> bool:
        return self.queued() >= max(self.max_queued, 1)

    def add(self, blocks: int) -> None:
        self.count += 1
        self.blocks += blocks

    def remove(self, blocks: int) -> None:
        self.count -= 1
        self.blocks -= blocks
        self._finished_at.append(time.monotonic())

    def retry_after_s(self) -> int:
        """Seconds until the queue, at the pace requests have been finishing, has room."""
        done = self._finished_at
        if len(done) < 2 or done[-1] <= done[0]:
            return 1
        per_s = (len(done) - 1) / (done[-1] - done[0])
        wait = (self.queued() - self.max_queued + 1) / per_s
        return max(1, min(RETRY_AFTER_MAX_S, math.ceil(wait)))


@dataclasses.dataclass(slots=True)
class _Accepted:
    """A request between its accepted submit and its end."""

    outbox: _Outbox
    samples_left: int
    blocks: int


class _Outbox:
    """What one router has not taken yet; `ready` is set while there is some."""

    def __init__(self):
        self.pending: dict[str, list] = {}
        self.ready = asyncio.Event()
        self.request_ids: set[str] = set()  # its requests in flight: cancelled with it
        self.closed = False  # its stream ended: a submit still on its way is refused

    def put(self, request_id: str, item) -> None:
        items = self.pending.get(request_id)  # per output: no throwaway list per call
        if items is None:
            self.pending[request_id] = [item]
        else:
            items.append(item)
        self.ready.set()


class Worker:
    def __init__(self, engine, worker_id: str, max_queued: int = 1024, node_id: str = ""):
        self.engine = engine
        self.worker_id = worker_id
        self.node_id = node_id
        self.incarnation = uuid.uuid4().hex[:12]
        self.bound = QueueBound(max_queued, engine.plan.num_blocks)
        self._loop: EngineLoop | None = None  # started on first use: it needs the event loop
        self._requests: dict[str, _Accepted] = {}
        self._outboxes: dict[str, _Outbox] = {}  # router id -> its outbox
        self._seen_stats = None           # the step loop's last published stats, and since when
        self._seen_at = time.monotonic()

    # -- the transport -----------------------------------------------------------------------
    async def submit(self, router_id: str, request_id: str, prompt_token_ids: list[int],
                     params: SamplingParams, cache_salt: str | None = None,
                     continuation: Continuation | None = None,
                     block_hashes: tuple[bytes, ...] | list[bytes] = ()) -> Rejected | None:
        """Admit the request (None) or refuse it before any work (Rejected); its outputs go
        out on `outputs(router_id)`. `block_hashes`: the router's hashes of the prompt's
        leading blocks, which the engine then does not compute again on its step thread."""
        loop = self._engine_loop()
        if request_id in self._requests:
            return Rejected(f"request id {request_id!r} is already in use")
        if self.bound.full():
            return Rejected(f"worker {self.worker_id} has {self.bound.max_queued} requests "
                            "waiting for KV cache space", queue_full=True,
                            retry_after_s=self.bound.retry_after_s())
        # what it may hold at its longest (no max_tokens: the rest of max_model_len)
        done = len(continuation.output_token_ids) if continuation else 0
        blocks = blocks_needed(len(prompt_token_ids) + done,
                               params.max_tokens and params.max_tokens - done, params.n,
                               self.engine.plan.block_size, self.engine.plan.max_model_len)
        outbox = self._outboxes.setdefault(router_id, _Outbox())  # the stream may come second
        if outbox.closed:
            return Rejected(f"the stream of router {router_id} has ended", queue_full=True)
        self._requests[request_id] = _Accepted(outbox, params.n, blocks)
        outbox.request_ids.add(request_id)
        self.bound.add(blocks)
        try:
            await loop.call(lambda e: e.add_request(request_id, list(prompt_token_ids), params,
                                                    cache_salt, continuation, block_hashes))
        except ValueError as exc:
            self._forget(request_id)
            return Rejected(str(exc))
        except BaseException:  # the router left (cancelled), or the engine failed: it goes
            self.cancel(request_id)  # from the engine too, if it got that far, and from the bound
            raise
        return None

    async def outputs(self, router_id: str) -> AsyncIterator[dict[str, list]]:
        """{request_id: [SequenceOutput | Lost, ...]}: everything ready for this router."""
        outbox = self._outboxes.setdefault(router_id, _Outbox())
        try:
            while True:
                await outbox.ready.wait()
                outbox.ready.clear()
                message, outbox.pending = outbox.pending, {}
                yield message
        finally:  # the router left (closed, cancelled or broke the stream): nobody reads these
            outbox.closed = True  # kept (a few bytes per stream ever opened) to refuse late submits
            for request_id in list(outbox.request_ids):
                self.cancel(request_id)

    def cancel(self, request_id: str) -> None:
        """The router left the request: abort it, freeing its blocks; no more outputs."""
        if self._forget(request_id):
            # FIFO inbox: runs after the request's add_request even if that is still queued
            self._loop.call_nowait(lambda e: e.abort(request_id))

    # -- what the controller and router read -----------------------------------------------
    def stats(self, cache_since: int | None = None) -> WorkerStats:
        """The engine's latest stats; with `cache_since`, also what its prefix cache gained and
        lost since that summary version (the controller mirrors it for routers)."""
        engine_stats = self._loop.stats if self._loop is not None else self.engine.stats()
        cache = None if cache_since is None else self.engine.cache_summary().delta_since(cache_since)
        runner = self.engine.runner  # None: built without one; int counters, safe to read
        return WorkerStats(
            worker_id=self.worker_id, incarnation=self.incarnation, pid=os.getpid(),
            model_name=self.engine.model_name, max_model_len=self.engine.max_model_len,
            block_size=self.engine.block_size, budget=self.engine.plan, engine=engine_stats,
            num_active=len(self._requests),
            graph_steps=0 if runner is None else runner.num_graph_steps,
            eager_steps=engine_stats.num_steps if runner is None else runner.num_eager_steps,
            cache=cache, node_id=self.node_id)

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
            self._loop = EngineLoop(self.engine, asyncio.get_running_loop(),
                                    on_outputs=self._deliver, on_crash=self._fail_all)
        return self._loop

    def _forget(self, request_id: str) -> bool:
        """The request no longer counts (finished, refused, cancelled); False if it did not."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        req.outbox.request_ids.discard(request_id)
        self.bound.remove(req.blocks)
        return True

    def _deliver(self, outputs: list[SequenceOutput]) -> None:
        """A step's outputs, split once: into each router's outbox."""
        for out in outputs:
            req = self._requests.get(out.request_id)
            if req is None:  # cancelled: its abort is queued
                continue
            req.outbox.put(out.request_id, out)
            if out.finish_reason is None:
                continue
            req.samples_left -= 1
            if out.finish_reason == ERROR:
                # The request broke a step (its own input): the engine dropped that sample;
                # the router answers 400, so its other samples go too.
                self.cancel(out.request_id)
            elif not req.samples_left:
                self._forget(out.request_id)

    def _fail_all(self, exc: BaseException) -> None:
        """The engine's step raised: every request goes (the router carries them on)."""
        for request_id, req in list(self._requests.items()):
            req.outbox.put(request_id, Lost(request_id, f"worker {self.worker_id}: {exc!r}"))
            self.cancel(request_id)
