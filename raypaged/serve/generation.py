"""Generation: one engine request (one prompt, n samples) from routing to its last token.

    start():   rank the ready workers -> open a stream on the first -> wait for its first batch
               worker gone before the first batch    -> retry once on the next worker
               worker's queue full                   -> next worker; all full -> 503 Retry-After
               worker refuses the request (invalid)  -> 400
    batches(): the first batch, then the rest; a worker lost now raises WorkerUnavailable
    collect(): everything, for non-streaming responses: a worker lost mid-way is retried once
               from scratch (the client has seen nothing yet)

Router-side request metrics (TTFT, inter-token latency, ...) are recorded here as batches pass.
"""
from __future__ import annotations

import collections
import time
from typing import AsyncIterator, Protocol

from raypaged.core.sampling_params import SamplingParams
from raypaged.outputs import SequenceOutput
from raypaged.serve.errors import APIError
from raypaged.serve.cost_routing import WorkerLoad
from raypaged.serve.fleet import FleetSnapshot, WorkerView
from raypaged.serve.metrics import RequestMetrics
from raypaged.serve.routing import Router
from raypaged.serve.worker import Rejected

MAX_ATTEMPTS = 2  # the first try and one retry on another worker


class WorkerUnavailable(Exception):
    """The worker died, is restarting, or its engine failed: the request may go elsewhere."""


class FleetClient(Protocol):
    def snapshot(self) -> FleetSnapshot: ...

    def stream(self, view: WorkerView, request_id: str, token_ids: list[int],
               params: SamplingParams, cache_salt: str | None
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


class Generation:
    def __init__(self, dispatcher: Dispatcher, request_id: str, token_ids: list[int],
                 params: SamplingParams, cache_salt: str | None, arrival: float):
        self.d = dispatcher
        self.request_id, self.token_ids, self.params = request_id, token_ids, params
        self.cache_salt = cache_salt
        self.arrival = arrival
        self.worker_id: str | None = None
        self.num_cached_tokens = 0
        self.num_output_tokens = 0
        self.finish_reasons: dict[int, str] = {}
        self._opens = 0                 # streams opened (the first try and retries)
        self._failures = 0              # workers lost while serving this request
        self._excluded: set[str] = set()
        self._stream: AsyncIterator | None = None
        self._first: list[SequenceOutput] | None = None
        self._first_token_at: float | None = None
        self._last_token_at: float | None = None
        self._routed = False

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        queue_full = False
        while True:
            snap, loads = self.d.candidates(self._excluded)
            if not loads:
                break
            order, reason = self.d.router.rank(self.token_ids, self.cache_salt, loads)
            if not self._routed:
                self.d.metrics.inc("routing_decisions", reason)
                self._routed = True
            for worker_id in order:
                try:
                    first = await self._open(snap.worker(worker_id))
                except WorkerUnavailable:
                    self._worker_failed(worker_id)
                    break  # rank again without it
                if isinstance(first, Rejected):
                    await self.close()
                    if not first.queue_full:
                        raise APIError(400, first.message, code="invalid_request")
                    queue_full = True
                    self._excluded.add(worker_id)
                    continue
                self._first = first
                return
            else:
                break  # every ready worker refused: all queues full
        if queue_full:
            raise APIError(503, "every worker's queue is full; retry later", code="queue_full",
                           retry_after=1)
        raise APIError(503, "no worker is ready to serve requests", code="no_workers",
                       retry_after=1)

    def _worker_failed(self, worker_id: str) -> None:
        self._excluded.add(worker_id)
        self.d.mark_suspect(worker_id)
        self._failures += 1
        if self._failures >= MAX_ATTEMPTS:
            raise APIError(503, "the worker serving this request failed, and so did the retry",
                           code="worker_unavailable", retry_after=1)
        self.d.metrics.inc("request_retries")

    async def _open(self, view: WorkerView):
        self._opens += 1
        rid = self.request_id if self._opens == 1 else f"{self.request_id}-retry{self._opens - 1}"
        self.worker_id = view.worker_id
        self.d.inflight[view.worker_id] += 1
        self._stream = self.d.fleet.stream(view, rid, self.token_ids, self.params, self.cache_salt)
        try:
            item = await self._stream.__anext__()
        except StopAsyncIteration:
            await self.close()
            raise WorkerUnavailable("the worker ended the stream without output") from None
        except BaseException:
            await self.close()
            raise
        if not isinstance(item, Rejected):
            self._observe(item)
        return item

    async def close(self) -> None:
        """Leave the worker (cancelling its stream if unfinished); safe to call twice."""
        stream, self._stream = self._stream, None
        if stream is not None:
            self.d.inflight[self.worker_id] -= 1
            await stream.aclose()

    # -- consuming -------------------------------------------------------------------------
    async def batches(self) -> AsyncIterator[list[SequenceOutput]]:
        """The first batch (received by start) and every later one; WorkerUnavailable if the
        worker is lost on the way."""
        first, self._first = self._first, None
        try:
            if first is not None:
                yield first
            while self._stream is not None and len(self.finish_reasons) < self.params.n:
                try:
                    batch = await self._stream.__anext__()
                except StopAsyncIteration:
                    break
                if isinstance(batch, Rejected):  # this request broke a step: its own input
                    raise APIError(400, batch.message, code="invalid_request")
                self._observe(batch)
                yield batch
        finally:
            await self.close()
        self._record_finished()

    async def collect(self) -> list[SequenceOutput]:
        """Every output; the client has seen nothing yet, so a lost worker means start over."""
        while True:
            outputs: list[SequenceOutput] = []
            try:
                async for batch in self.batches():
                    outputs.extend(batch)
                return outputs
            except WorkerUnavailable:
                self._worker_failed(self.worker_id)
                self.finish_reasons.clear()
                self.num_output_tokens = 0
                self._first_token_at = None
                await self.start()

    # -- metrics ---------------------------------------------------------------------------
    def _observe(self, batch: list[SequenceOutput]) -> None:
        now = time.monotonic()
        new_tokens = sum(len(o.new_token_ids) for o in batch)
        for out in batch:
            self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
            if out.finish_reason is not None:
                self.finish_reasons[out.index] = out.finish_reason
        if new_tokens:
            if self._first_token_at is None:
                self._first_token_at = now
                self.d.metrics.observe("time_to_first_token_seconds", now - self.arrival)
            else:
                gap = (now - self._last_token_at) / new_tokens
                for _ in range(new_tokens):
                    self.d.metrics.observe("inter_token_latency_seconds", gap)
            self._last_token_at = now
        self.num_output_tokens += new_tokens

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
