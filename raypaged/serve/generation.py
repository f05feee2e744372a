"""Generation: one engine request (one prompt, n samples) from routing to its last token, on
as many workers as it takes; what its client sees.

    start():   the client's turn at the gate (client_gate.py) -> rank the ready workers
               (Dispatcher.rank) -> submit on the first (a "leg", leg.py) -> wait for its
               first outputs
               worker gone before the first outputs  -> the next worker
               worker's queue full                   -> next worker; all full -> 503 with the
                                                        soonest Retry-After they gave
               worker refuses the request (invalid)  -> 400
    stream():  the first outputs, then the rest as they come, every output waiting taken as one
               batch. A leg whose worker dies (its link says so), restarts or stops answering
               (the controller's snapshot says it is no longer ready) is failed over: nothing
               of it seen yet -> the same request again elsewhere; else each unfinished sample
               goes on elsewhere as a Continuation of the tokens the client already has, so
               the text goes on with no gap and no repeat. What a lost worker costs the
               request (503, suspected poison, the wait for a spare) is failover.py's; where
               it may go after a death, quarantine.py's.
    collect(): every output, for non-streaming responses.

The dispatcher (dispatch.py) holds what generations share and ranks the workers; progress.py
what the client has and the request metrics.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import time
import weakref
from typing import AsyncIterator

from raypaged.core.contracts import Continuation
from raypaged.core.engine_core import ERROR
from raypaged.core.sampling_params import SamplingParams
from raypaged.outputs import SequenceOutput
from raypaged.serve.client_gate import CLIENT
from raypaged.serve.dispatch import Dispatcher
from raypaged.serve.errors import APIError
from raypaged.serve.failover import WATCH_S, DeadlinePassed, LostWorkers
from raypaged.serve.fleet import WorkerView
from raypaged.serve.leg import Leg
from raypaged.serve.messages import Lost, Rejected, WorkerUnavailable
from raypaged.serve.poison import fingerprint
from raypaged.serve.progress import Progress
from raypaged.serve.quarantine import ALONE_WAIT_S
from raypaged.serve.responses import WORKER_HEADER


class Generation:
    def __init__(self, dispatcher: Dispatcher, request_id: str, token_ids: list[int],
                 params: SamplingParams, cache_salt: str | None, arrival: float):
        self.d = dispatcher
        self.request_id, self.token_ids, self.params = request_id, token_ids, params
        self.cache_salt = cache_salt
        self.worker_id: str | None = None   # the worker that served (or finished) it last
        self.progress = Progress(params.n, arrival, dispatcher.metrics)
        self._legs: list[Leg] = []
        self._opens = 0                 # legs opened (the first and every failover)
        self._fingerprint = functools.partial(fingerprint, token_ids, params, cache_salt)
        self._lost = LostWorkers(dispatcher, self._fingerprint, self._error)
        self._deadline: float | None = None  # the stream's, on the loop's clock (monotonic)
        self._queue: asyncio.Queue = asyncio.Queue()  # (leg, outputs | WorkerUnavailable)
        self._pending: collections.deque = collections.deque()  # first outputs, not yielded
        self._watched_at = time.monotonic()
        self.client = CLIENT.get()  # of the HTTP request that started it
        # its place in the gate, from start() to close(); each leg counts at its blocks
        self._ticket = self._unclosed = None
        self._closed = False  # close() ran (the output lengths are recorded once)

    @property
    def num_output_tokens(self) -> int:
        return self.progress.num_output_tokens

    @property
    def num_cached_tokens(self) -> int:
        return self.progress.num_cached_tokens

    # -- routing and retries -----------------------------------------------------------------
    async def start(self) -> None:
        # its client's turn first (client_gate.py): until then it holds no worker
        ticket = await self.d.gate.enter(self.client, len(self.token_ids),
                                         self.params.max_tokens, self.params.n)
        # given back by close(), or when this is collected without it: a stream whose client
        # left before its response started is never iterated, so never closed, and a ticket
        # kept for ever would shrink the fleet's room for everyone
        self._ticket, self._unclosed = ticket, weakref.finalize(self, self.d.gate.leave_later,
                                                                ticket)
        # costs a hash of the prompt only while something is remembered
        if self.d.poison and (reason := self.d.poison.refused(self._fingerprint())) is not None:
            self.d.metrics.inc("suspected_poison_requests", "refused_again")
            raise self._error(400, reason, code="suspected_poison_request")
        await self._open(tuple(range(self.params.n)), None)

    async def _open(self, indexes: tuple[int, ...], continuation: Continuation | None) -> None:
        """Open a leg on the best worker that takes it; its first outputs go to _pending."""
        tokens, params, blocks = self.token_ids, self.params, self._ticket.blocks
        if continuation is not None:  # route by everything the new worker will have to hold
            tokens = tokens + list(continuation.output_token_ids)
            params = dataclasses.replace(params, n=1)
            # the prompt and this one sample's output at its longest, not the whole request's
            blocks = self.d.gate.blocks(len(self.token_ids), self.params.max_tokens, 1)
        retry_after = None  # set once a worker said its queue is full
        alone_until = time.monotonic() + ALONE_WAIT_S
        while True:
            # a worker died serving it: to one serving no other such request (quarantine.py)
            quarantined = bool(self._lost.died_serving)
            snap, order, hashes = self.d.rank(tokens, self.cache_salt, self._lost.excluded,
                                              blocks, count=self._opens == 0)
            if not order and self._lost.readmit_renewed(snap):
                continue
            if not order:
                break
            if quarantined and time.monotonic() < alone_until:
                alone = [w for w in order if self.d.quarantine.free_for(w, self.request_id)]
                if not alone:
                    await asyncio.sleep(WATCH_S)
                    continue
                order = alone
            for worker_id in order:
                view = snap.worker(worker_id)
                leg = Leg(worker_id, view.stats.incarnation if view.stats else None, indexes,
                          continuation is not None, blocks=blocks, quarantined=quarantined)
                try:
                    rejected = await self._submit(leg, view, params, continuation, hashes)
                except WorkerUnavailable as lost:  # a worker can die of it before it replies
                    await self._lost.add(leg, lost.reached, self._deadline)
                    break  # rank again without it
                if rejected is None:
                    return
                if not rejected.queue_full:
                    raise self._error(400, rejected.message, code="invalid_request")
                retry_after = min(retry_after or rejected.retry_after_s, rejected.retry_after_s)
                self._lost.excluded.add(worker_id)
            else:
                break  # every ready worker refused: all queues full
        if retry_after is not None:
            raise self._error(503, "every worker's queue is full; retry later", code="queue_full",
                              retry_after=retry_after)
        raise self._error(503, "no worker is ready to serve requests", code="no_workers",
                          retry_after=1)

    async def _submit(self, leg: Leg, view: WorkerView, params: SamplingParams,
                      continuation: Continuation | None, block_hashes=()) -> Rejected | None:
        self._opens += 1
        leg.request_id = (self.request_id if self._opens == 1
                          else f"{self.request_id}-{self._opens - 1}")
        self.worker_id = leg.worker_id
        self.d.opened(leg.worker_id, leg.blocks)
        if leg.quarantined:
            self.d.quarantine.enter(leg.worker_id, self.request_id)
        self._legs.append(leg)
        try:
            leg.link = self.d.fleet.link(view)
            rejected = await self._watched(leg, leg.link.submit(
                leg.request_id, self.token_ids, params, self.cache_salt, continuation,
                self._sink(leg), block_hashes))
            if rejected is not None:
                self._close_leg(leg)
                return rejected
            outs = self._outputs(await self._watched(leg, leg.first))
        except BaseException:
            self._close_leg(leg)
            raise
        self._take(leg, outs)
        self._pending.append(outs)
        return None

    async def _watched(self, leg: Leg, awaitable):
        """Await it; WorkerUnavailable if the leg's worker leaves the fleet first (a worker
        frozen just before the request arrived never answers at all)."""
        task = asyncio.ensure_future(awaitable)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=WATCH_S)
                if done:
                    return task.result()
                if leg.is_lost(self.d.fleet.snapshot()):
                    raise WorkerUnavailable(f"{leg.worker_id} left the fleet")
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    def _sink(self, leg: Leg):
        """The leg's sink; the first leg's also gives the gate its place back once the worker
        has finished every sample, read or not: a request's prompts are read only once all of
        them have started, so a prompt waiting in the gate behind its own request's finished
        ones (more than 7/8 of the cache together) would otherwise wait for ever."""
        put = leg.sink(self._queue)
        if self._unclosed is None or leg.resumed or len(leg.indexes) != self.params.n:
            return put  # no place in the gate (not started through it), or not the whole
        # not `self`: the link holds the sink, and a generation never closed must stay
        # collectable (its finalizer gives the ticket back)
        n, leave, ended = self.params.n, functools.partial(_leave_gate, self.d.gate,
                                                            self._unclosed, self._ticket), set()

        def sink(items) -> None:
            put(items)
            if isinstance(items, WorkerUnavailable):
                return
            ended.update(o.index for o in items
                         if isinstance(o, SequenceOutput) and o.finish_reason is not None)
            if len(ended) == n:
                leave()
        return sink

    def _error(self, status: int, message: str, **kw) -> APIError:
        """An APIError naming the last worker chosen for this request, if any was."""
        headers = {WORKER_HEADER: self.worker_id} if self.worker_id else None
        return APIError(status, message, headers=headers, **kw)

    def _close_leg(self, leg: Leg) -> None:
        if leg.close(finished=all(self.progress.samples[i].finish_reason for i in leg.indexes)):
            self.d.opened(leg.worker_id, leg.blocks, -1)
            if leg.quarantined:
                self.d.quarantine.leave(leg.worker_id, self.request_id)

    async def close(self) -> None:
        """Leave every worker (cancelling unfinished requests) and the gate; idempotent."""
        for leg in self._legs:
            self._close_leg(leg)
        if self._ticket is not None and not self._closed:
            self._closed = True
            if all(s.finish_reason not in (None, "abort") for s in self.progress.samples):
                self.d.gate.finished([len(s.token_ids) for s in self.progress.samples])
            _leave_gate(self.d.gate, self._unclosed, self._ticket)

    # -- failover (failover.py) ---------------------------------------------------------------
    async def _fail_over(self, leg: Leg) -> None:
        """Carry the leg's unfinished samples on elsewhere from what the client already has;
        a stream's deadline ends the wait for their first outputs there (DeadlinePassed)."""
        self._close_leg(leg)
        timeout = asyncio.timeout_at(self._deadline)  # None: a whole request's cancels this
        try:
            async with timeout:
                await self._lost.add(leg, True, self._deadline)
                samples = self.progress.samples
                if not leg.resumed and not any(samples[i].token_ids for i in leg.indexes):
                    await self._open(leg.indexes, None)  # nothing of it seen: the same again
                    return
                todo = [i for i in leg.indexes if samples[i].finish_reason is None]
                await gather_or_cancel(*(self._open((i,), Continuation(
                    i, tuple(samples[i].token_ids), samples[i].text_chars)) for i in todo))
        except TimeoutError:
            if timeout.expired():
                raise DeadlinePassed() from None
            raise

    async def _watch(self) -> None:
        """Fail over every open leg whose worker was lost without its link saying so."""
        self._watched_at = time.monotonic()
        snap = self.d.fleet.snapshot()
        for leg in [g for g in self._legs if not g.closed and g.is_lost(snap)]:
            await self._fail_over(leg)

    # -- consuming ---------------------------------------------------------------------------
    def _outputs(self, items) -> list[SequenceOutput]:
        """A leg's items as outputs for the client; raises WorkerUnavailable (fail over) or a
        400 (the request broke an engine step: its own input, never retried)."""
        if isinstance(items, WorkerUnavailable):
            raise items
        for out in items:
            if isinstance(out, Lost):
                raise WorkerUnavailable(out.message)
            if out.finish_reason == ERROR:
                raise self._error(400, str(out.stop_reason), code="invalid_request")
        return items

    def _take(self, leg: Leg, outs: list[SequenceOutput]) -> None:
        self.progress.observe(outs, leg.resumed)
        if any(out.finish_reason is not None for out in outs):
            self.worker_id = leg.worker_id
            if all(self.progress.samples[i].finish_reason for i in leg.indexes):
                self._close_leg(leg)

    async def stream(self, deadline: float | None = None
                     ) -> AsyncIterator[list[SequenceOutput]]:
        """Every step's outputs, failing over lost workers on the way. Every item waiting is
        yielded as one batch (one SSE chunk for several engine steps when behind); a wait is one
        `queue.get()`, no task or timeout per token: two timers put markers in the queue, one
        every WATCH_S (the fleet watch) and one at `deadline` (then DeadlinePassed)."""
        loop = asyncio.get_running_loop()
        queue, ticker, alarm = self._queue, None, None
        self._deadline = deadline

        def tick() -> None:
            nonlocal ticker
            queue.put_nowait((None, _TICK))
            ticker = loop.call_later(WATCH_S, tick)
        ticker = loop.call_later(WATCH_S, tick)
        if deadline is not None:
            alarm = loop.call_at(deadline, queue.put_nowait, (None, _DEADLINE))
        try:
            while True:
                while self._pending:
                    yield self._pending.popleft()
                if self.progress.done:
                    break
                if time.monotonic() - self._watched_at >= WATCH_S:
                    await self._watch()
                    continue
                item = await queue.get()
                ready: list[SequenceOutput] = []
                while True:
                    leg, items = item
                    if leg is None:
                        if items is _DEADLINE:
                            raise DeadlinePassed()
                    elif not leg.closed:  # else left over from a leg already failed over
                        try:
                            outs = self._outputs(items)
                        except WorkerUnavailable:
                            if ready:
                                yield ready
                                ready = []
                            await self._fail_over(leg)
                            break
                        self._take(leg, outs)
                        ready.extend(outs)
                    if queue.empty():
                        break
                    item = queue.get_nowait()
                if ready:
                    yield ready
            self.progress.record_finished(len(self.token_ids))
        except (GeneratorExit, asyncio.CancelledError, DeadlinePassed):
            self.progress.record_finished(len(self.token_ids))  # the client left: an abort
            raise
        finally:
            for timer in (ticker, alarm):
                if timer is not None:
                    timer.cancel()
            await self.close()

    async def collect(self) -> list[SequenceOutput]:
        return [out async for batch in self.stream() for out in batch]


async def gather_or_cancel(*aws) -> list:
    """asyncio.gather, except that the first failure cancels the others and waits for them
    (gather leaves them running: for ever, when nobody reads what they wait for)."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _leave_gate(gate, unclosed: weakref.finalize, ticket) -> None:
    """Give the ticket back, once (detach(): None once given back)."""
    if unclosed.detach() is not None:
        gate.leave(ticket)


_TICK, _DEADLINE = object(), object()  # stream()'s timers' markers in the queue
