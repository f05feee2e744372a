"""Generation: one engine request (one prompt, n samples) from routing to its last token, on
as many workers as it takes.

    start():   rank the ready workers -> open a stream (a "leg") on the first -> wait for its
               first batch
               worker gone before the first batch    -> the next worker
               worker's queue full                   -> next worker; all full -> 503 Retry-After
               worker refuses the request (invalid)  -> 400
    batches(): the first batch, then the rest as they come. A leg whose worker dies (the stream
               raises), restarts or stops answering (the controller's snapshot says it is no
               longer ready) is failed over: nothing of it seen yet -> the same request again
               elsewhere; else each unfinished sample goes on elsewhere as a Continuation of
               the tokens the client already has, so the text goes on with no gap and no
               repeat. After MAX_FAILOVERS lost workers the request ends with a 503.
    collect(): every batch, for non-streaming responses.

Router-side request metrics (TTFT, inter-token latency, ...) are recorded here as batches pass.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import time
from typing import AsyncIterator, Protocol

from raypaged.core.contracts import Continuation
from raypaged.core.sampling_params import SamplingParams
from raypaged.outputs import SequenceOutput
from raypaged.serve.errors import APIError
from raypaged.serve.cost_routing import WorkerLoad
from raypaged.serve.fleet import FleetSnapshot, WorkerView
from raypaged.serve.metrics import RequestMetrics
from raypaged.serve.responses import WORKER_HEADER
from raypaged.serve.routing import Router
from raypaged.serve.worker import Rejected

MAX_FAILOVERS = 2   # workers lost while serving one request before it gives up
WATCH_S = 0.25      # how often a waiting generation checks its workers are still in the fleet
_END = object()     # a leg's stream ended


class WorkerUnavailable(Exception):
    """The worker died, is restarting, or its engine failed: the request may go elsewhere."""


class FleetClient(Protocol):
    def snapshot(self) -> FleetSnapshot: ...

    def stream(self, view: WorkerView, request_id: str, token_ids: list[int],
               params: SamplingParams, cache_salt: str | None,
               continuation: Continuation | None = None
               ) -> AsyncIterator[list[SequenceOutput] | Rejected]: ...


class Dispatcher:
    """What every Generation of one router replica shares: the fleet, routing and local load."""

    def __init__(self, fleet: FleetClient, router: Router, metrics: RequestMetrics,
                 suspect_s: float = 2.0):
        self.fleet, self.router, self.metrics = fleet, router, metrics
        self.inflight: collections.Counter[str] = collections.Counter()  # ours, per worker
        self._suspect_until: dict[str, float] = {}
        self.suspect_s = suspect_s
        self._snapshot_version = -1
        self._ours_at_snapshot: dict[str, int] = {}

    def candidates(self, exclude: set[str]) -> tuple[FleetSnapshot, dict[str, WorkerLoad]]:
        """Ready workers and their load: this replica's own requests, counted exactly, plus the
        other replicas' as the last snapshot saw them (its load minus what was ours then); the
        tokens queued there and its prefix cache, as of the snapshot.

        The snapshot alone lags by up to a poll and a refresh: a burst would all see the same
        stale loads, and requests finished since would still count and push work away."""
        snap = self.fleet.snapshot()
        if snap.version != self._snapshot_version:
            self._snapshot_version = snap.version
            self._ours_at_snapshot = dict(self.inflight)
        now = time.monotonic()
        loads = {}
        for w in snap.ready():
            if w.worker_id in exclude or self._suspect_until.get(w.worker_id, 0) >= now:
                continue
            others = max(0, w.load - self._ours_at_snapshot.get(w.worker_id, 0))
            loads[w.worker_id] = WorkerLoad(others + self.inflight[w.worker_id],
                                            w.stats.engine.num_queued_tokens,
                                            snap.caches.get(w.worker_id))
        return snap, loads

    def mark_suspect(self, worker_id: str) -> None:
        """Skip a worker that just failed until the controller has had time to notice."""
        self._suspect_until[worker_id] = time.monotonic() + self.suspect_s


@dataclasses.dataclass
class _Sample:
    """What the client has of one of the n samples."""

    token_ids: list[int] = dataclasses.field(default_factory=list)
    text_chars: int = 0
    finish_reason: str | None = None
    last_token_at: float | None = None


@dataclasses.dataclass(eq=False)
class _Leg:
    """One stream on one worker, serving some of the request's samples."""

    worker_id: str
    incarnation: str | None          # the worker process it was opened on
    indexes: tuple[int, ...]         # the samples it serves
    resumed: bool                    # a Continuation (its prompt-cache figure is not the prompt's)
    stream: AsyncIterator | None = None
    pump: asyncio.Task | None = None
    closed: bool = False


class Generation:
    def __init__(self, dispatcher: Dispatcher, request_id: str, token_ids: list[int],
                 params: SamplingParams, cache_salt: str | None, arrival: float):
        self.d = dispatcher
        self.request_id, self.token_ids, self.params = request_id, token_ids, params
        self.cache_salt = cache_salt
        self.arrival = arrival
        self.worker_id: str | None = None   # the worker that served (or finished) it last
        self.num_cached_tokens = 0
        self.num_output_tokens = 0
        self.samples = [_Sample() for _ in range(params.n)]
        self._legs: list[_Leg] = []
        self._opens = 0                 # streams opened (the first and every failover)
        self._failovers = 0             # workers lost while serving this request
        self._excluded: set[str] = set()
        self._queue: asyncio.Queue = asyncio.Queue()  # (leg, batch | exception | _END)
        self._pending: collections.deque = collections.deque()  # first batches not yet yielded
        self._first_token_at: float | None = None
        self._last_token_at: float | None = None
        self._routed = False
        self._watched_at = time.monotonic()

    @property
    def finish_reasons(self) -> dict[int, str]:
        return {i: s.finish_reason for i, s in enumerate(self.samples) if s.finish_reason}

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        await self._open(tuple(range(self.params.n)), None)

    async def _open(self, indexes: tuple[int, ...], continuation: Continuation | None) -> None:
        """Open a leg on the best worker that takes it; its first batch goes to _pending."""
        tokens = self.token_ids
        params = self.params
        if continuation is not None:  # route by everything the new worker will have to hold
            tokens = tokens + list(continuation.output_token_ids)
            params = dataclasses.replace(params, n=1)
        queue_full = False
        while True:
            snap, loads = self.d.candidates(self._excluded)
            if not loads:
                break
            order, reason = self.d.router.rank(tokens, self.cache_salt, loads)
            if not self._routed:
                self.d.metrics.inc("routing_decisions", reason)
                self._routed = True
            for worker_id in order:
                view = snap.worker(worker_id)
                leg = _Leg(worker_id, view.stats.incarnation if view.stats else None, indexes,
                           continuation is not None)
                try:
                    first = await self._first(leg, view, params, continuation)
                except WorkerUnavailable:
                    self._worker_lost(worker_id)
                    break  # rank again without it
                if isinstance(first, Rejected):
                    if not first.queue_full:
                        raise self._error(400, first.message, code="invalid_request")
                    queue_full = True
                    self._excluded.add(worker_id)
                    continue
                return
            else:
                break  # every ready worker refused: all queues full
        if queue_full:
            raise self._error(503, "every worker's queue is full; retry later", code="queue_full",
                              retry_after=1)
        raise self._error(503, "no worker is ready to serve requests", code="no_workers",
                          retry_after=1)

    def _error(self, status: int, message: str, **kw) -> APIError:
        """An APIError naming the last worker chosen for this request, if any was."""
        headers = {WORKER_HEADER: self.worker_id} if self.worker_id else None
        return APIError(status, message, headers=headers, **kw)

    async def _first(self, leg: _Leg, view: WorkerView, params: SamplingParams,
                     continuation: Continuation | None):
        self._opens += 1
        rid = self.request_id if self._opens == 1 else f"{self.request_id}-{self._opens - 1}"
        self.worker_id = leg.worker_id
        self.d.inflight[leg.worker_id] += 1
        leg.stream = self.d.fleet.stream(view, rid, self.token_ids, params, self.cache_salt,
                                         continuation)
        self._legs.append(leg)
        try:
            item = await self._watched(leg, leg.stream.__anext__())
        except StopAsyncIteration:
            await self._close_leg(leg)
            raise WorkerUnavailable("the worker ended the stream without output") from None
        except BaseException:
            await self._close_leg(leg)
            raise
        if isinstance(item, Rejected):
            await self._close_leg(leg)
            return item
        self._observe(leg, item)
        self._pending.append(item)
        leg.pump = asyncio.get_running_loop().create_task(self._pump(leg))
        return item

    async def _watched(self, leg: _Leg, awaitable):
        """Await the leg's first batch; WorkerUnavailable if its worker leaves the fleet first
        (a worker frozen just before the request arrived never answers at all)."""
        task = asyncio.ensure_future(awaitable)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=WATCH_S)
                if done:
                    return task.result()
                if self._is_lost(leg, self.d.fleet.snapshot()):
                    raise WorkerUnavailable(f"{leg.worker_id} left the fleet")
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def _pump(self, leg: _Leg) -> None:
        try:
            async for batch in leg.stream:
                self._queue.put_nowait((leg, batch))
            self._queue.put_nowait((leg, _END))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - handed to the reader
            self._queue.put_nowait((leg, exc))

    async def _close_leg(self, leg: _Leg) -> None:
        """Leave the worker, cancelling its stream if unfinished; safe to call twice."""
        if leg.closed:
            return
        leg.closed = True
        self.d.inflight[leg.worker_id] -= 1
        if leg.pump is not None and not leg.pump.done():
            leg.pump.cancel()  # inside the stream: its cleanup cancels the worker's task
            await asyncio.gather(leg.pump, return_exceptions=True)
        elif leg.stream is not None:
            await leg.stream.aclose()

    async def close(self) -> None:
        """Leave every worker (cancelling unfinished streams); safe to call twice."""
        for leg in self._legs:
            await self._close_leg(leg)

    def _worker_lost(self, worker_id: str) -> None:
        self._excluded.add(worker_id)
        self.d.mark_suspect(worker_id)
        self._failovers += 1
        if self._failovers > MAX_FAILOVERS:
            raise self._error(503, f"{self._failovers} workers failed while serving this "
                              "request", code="worker_unavailable", retry_after=1)
        self.d.metrics.inc("request_retries")

    async def _fail_over(self, leg: _Leg) -> None:
        """Carry the leg's unfinished samples on elsewhere from what the client already has."""
        await self._close_leg(leg)
        self._worker_lost(leg.worker_id)
        todo = [i for i in leg.indexes if self.samples[i].finish_reason is None]
        if not leg.resumed and not any(self.samples[i].token_ids for i in leg.indexes):
            await self._open(leg.indexes, None)  # nothing of it seen: the same request again
            return
        await asyncio.gather(*(self._open((i,), Continuation(
            i, tuple(self.samples[i].token_ids), self.samples[i].text_chars)) for i in todo))

    @staticmethod
    def _is_lost(leg: _Leg, snap: FleetSnapshot) -> bool:
        """The fleet no longer counts the leg's worker as ready, or it is a new process."""
        view = snap.worker(leg.worker_id)
        return view is None or not view.ready or (
            leg.incarnation is not None and view.stats is not None
            and view.stats.incarnation != leg.incarnation)

    async def _watch(self) -> None:
        """Fail over every open leg whose worker was lost without its stream saying so."""
        self._watched_at = time.monotonic()
        snap = self.d.fleet.snapshot()
        for leg in [g for g in self._legs if not g.closed and self._is_lost(g, snap)]:
            await self._fail_over(leg)

    # -- consuming -------------------------------------------------------------------------
    async def batches(self) -> AsyncIterator[list[SequenceOutput]]:
        """Every batch of outputs, failing over lost workers on the way."""
        completed = False
        try:
            while True:
                while self._pending:
                    yield self._pending.popleft()
                if all(s.finish_reason is not None for s in self.samples):
                    break
                if time.monotonic() - self._watched_at >= WATCH_S:
                    await self._watch()
                    continue
                try:
                    leg, item = await asyncio.wait_for(self._queue.get(), WATCH_S)
                except asyncio.TimeoutError:
                    continue
                if leg.closed:
                    continue  # left over from a leg already failed over
                if item is _END and all(self.samples[i].finish_reason for i in leg.indexes):
                    await self._close_leg(leg)
                elif isinstance(item, WorkerUnavailable) or item is _END:
                    # _END with samples unfinished: the worker stopped short (it was restarted)
                    await self._fail_over(leg)
                elif isinstance(item, BaseException):
                    raise item
                elif isinstance(item, Rejected):  # the request broke a step: its own input
                    raise self._error(400, item.message, code="invalid_request")
                else:
                    self._observe(leg, item)
                    yield item
            completed = True
        except (GeneratorExit, asyncio.CancelledError):
            self._record_finished()  # the client left: an abort, and its latency counts
            raise
        finally:
            await self.close()
        if completed:
            self._record_finished()

    async def collect(self) -> list[SequenceOutput]:
        return [out async for batch in self.batches() for out in batch]

    # -- metrics ---------------------------------------------------------------------------
    def _observe(self, leg: _Leg, batch: list[SequenceOutput]) -> None:
        now = time.monotonic()
        for out in batch:
            sample = self.samples[out.index]
            if not leg.resumed:
                self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
            if out.new_token_ids:
                if sample.last_token_at is not None:  # this sample's gap, per token it brought
                    gap = (now - sample.last_token_at) / len(out.new_token_ids)
                    for _ in out.new_token_ids:
                        self.d.metrics.observe("inter_token_latency_seconds", gap)
                sample.last_token_at = now
                sample.token_ids.extend(out.new_token_ids)
                self.num_output_tokens += len(out.new_token_ids)
                if self._first_token_at is None:
                    self._first_token_at = now
                    self.d.metrics.observe("time_to_first_token_seconds", now - self.arrival)
                self._last_token_at = now
            sample.text_chars += len(out.new_text)
            if out.finish_reason is not None:
                sample.finish_reason = out.finish_reason
                self.worker_id = leg.worker_id

    def _record_finished(self) -> None:
        m = self.d.metrics
        now = time.monotonic()
        m.observe("e2e_request_latency_seconds", now - self.arrival)
        if self._first_token_at is not None and self.num_output_tokens > self.params.n:
            per_seq = self.num_output_tokens / self.params.n
            m.observe("time_per_output_token_seconds",
                      (self._last_token_at - self._first_token_at) / (per_seq - 1))
        m.inc("prompt_tokens", value=len(self.token_ids))
        m.inc("generation_tokens", value=self.num_output_tokens)
        m.inc("request_success", self.finish_reasons.get(0, "abort"))
