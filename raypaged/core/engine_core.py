"""EngineCore: schedule -> run the model -> apply the sampled tokens. No torch, no ray.

With `async_scheduling`, the model runs on a StepExecutor thread and step() schedules the next
step before waiting for the running one (see StepExecutor): each call returns the outputs of
the step before, and the host's scheduling and output work overlap the model's. A sequence that
ends (stop, length, abort) in step N may already sit in step N+1: its slot there is computed and
dropped, never emitted. Tokens are the same either way.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Mapping, Sequence

from raypaged.core.block_hash import DIGEST_SIZE, BlockHash, hash_block_tokens
from raypaged.core.cache_summary import CacheSummary
from raypaged.core.contracts import (Continuation, EngineStats, ModelRunner, RequestDelta,
                                     ScheduledBatch, StepResult)
from raypaged.core.request import Request
from raypaged.core.sampling_params import SamplingParams
from raypaged.core.scheduler import Scheduler

logger = logging.getLogger(__name__)

# finish_reason of a request that made a step fail; its RequestDelta.stop_reason says why.
ERROR = "error"


class StepRefused(Exception):
    """A step queued behind a failed one: it did not run."""


class StepExecutor:
    """Runs the model steps on a thread of their own, in order, one at a time.

    Overlapped scheduling (SGLang's overlap scheduler, vLLM v1's async scheduling): while step N
    runs here, the engine thread schedules step N+1 and queues it; step N+1 may feed placeholders
    for the tokens step N samples, and this thread fills them in from step N's result just before
    running N+1, so the model never waits for core to apply step N:

        engine thread:  schedule N+1 ─ submit ─ wait N ─ update N, outputs N │ schedule N+2 ─ ...
        this thread:    ......... run N ........│ fill N+1 from N ─ run N+1 ..........│ ...

    Steps run strictly one after another, so a block freed (by a stop, abort or preemption) while
    step N+1 is queued is written by a later step only after N+1 has run. After a step fails,
    every later step is refused (StepRefused, nothing run) until `resume()`: the engine re-runs the
    failed step request by request on its own thread while this one is idle."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="raypaged-steps")
        # the sampled ids of the last step that ran (the one a queued step's placeholders need)
        self.last: Mapping[str, tuple[int, ...]] = {}
        self._failed = False

    def submit(self, batch: ScheduledBatch) -> Future:
        return self._pool.submit(self._run, batch)

    def resume(self, last_sampled: Mapping[str, tuple[int, ...]]) -> None:
        """After a failure (the thread is idle): accept steps again, as if the previous step
        had sampled `last_sampled`."""
        self._failed, self.last = False, last_sampled

    def shutdown(self) -> None:
        """Wait for the queued step (benchmarks between configurations)."""
        self._pool.shutdown(wait=True)

    def _run(self, batch: ScheduledBatch) -> StepResult:
        if self._failed:
            raise StepRefused("a step before this one failed")
        try:
            result = self.runner.execute(fill_placeholders(batch, self.last))
        except BaseException:
            self._failed = True
            raise
        self.last = result.sampled
        return result


def fill_placeholders(batch: ScheduledBatch, sampled: Mapping[str, tuple[int, ...]]
                      ) -> ScheduledBatch:
    """Each placeholder becomes the token the previous step sampled for that request. A request
    whose previous step sampled nothing for it (it failed there) leaves the batch."""
    if not any(r.num_placeholders for r in batch.requests):
        return batch
    requests = []
    for r in batch.requests:
        if r.num_placeholders:
            tokens = sampled.get(r.request_id)
            if tokens is None:
                continue
            assert len(tokens) == r.num_placeholders == 1, "forks never run with placeholders"
            known = len(r.token_ids) - r.num_placeholders
            r = dataclasses.replace(
                r, token_ids=[*r.token_ids[:known], *tokens], num_placeholders=0,
                output_token_ids=r.output_token_ids.extended(tuple(tokens)))
        requests.append(r)
    return dataclasses.replace(batch, requests=tuple(requests))


class EngineCore:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner,
                 async_scheduling: bool = False) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.num_steps = 0
        self.executor = StepExecutor(runner) if async_scheduling else None
        self._running = None  # (batch, future) of the step on the executor, not applied yet

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                    eos_token_id: int | None = None, cache_salt: str | None = None,
                    continuation: Continuation | None = None, held: bool = False,
                    block_hashes: Sequence[BlockHash] = ()) -> None:
        """Queue a request; raises ValueError (nothing queued) if it can never be served.
        `held`: not scheduled until release(request_id) (its grammar is still compiling).
        `block_hashes`: the router's hashes of the prompt's leading full blocks (with a
        continuation: of prompt + outputs), so admission need not hash them (`_router_hashes`).
        With a continuation, one sample (n = 1) resumes after the outputs it already has.
        Token ids are the caller's to check against the vocabulary (Engine.add_request does)."""
        max_tokens = sampling.max_tokens or self.scheduler.max_model_len - len(prompt_token_ids)
        outputs, index = (), 0
        if continuation is not None:
            outputs, index = continuation.output_token_ids, continuation.sample_index
            _check_continuation(continuation, sampling, max_tokens)
        hashes = _router_hashes(block_hashes, [*prompt_token_ids, *outputs],
                                self.scheduler.kv.block_size, cache_salt)
        self.scheduler.add(Request(request_id, prompt_token_ids, sampling, max_tokens,
                                   eos_token_id, cache_salt, sample_index=index,
                                   output_token_ids=outputs, block_hashes=hashes), held)

    def release(self, request_id: str) -> None:
        """A held request may be scheduled from the next step on."""
        self.scheduler.release(request_id)

    def only_held(self) -> bool:
        """Every unfinished request is held and no step is running: step() has nothing to do."""
        s = self.scheduler
        return bool(s.held) and len(s.held) == len(s.requests) and self._running is None

    def step(self) -> list[RequestDelta]:
        batch = self.scheduler.schedule()
        if self.executor is None:
            if not batch.requests:
                return []
            try:
                result = self.runner.execute(batch)
            except Exception as exc:  # noqa: BLE001 - find who caused it; the rest go on
                return self._step_isolating(batch, exc)
        else:  # queue step N+1, then wait for step N and apply it: N+1 runs while we do
            queued = (batch, self.executor.submit(batch)) if batch.requests else None
            running, self._running = self._running, queued
            if running is None:
                return []
            batch, future = running
            try:
                result = future.result()
            except Exception as exc:  # noqa: BLE001 - as above; the queued step was refused
                return self._recover(batch, exc)
        self.num_steps += 1
        return self.scheduler.update(batch, result)

    def _recover(self, batch: ScheduledBatch, exc: Exception) -> list[RequestDelta]:
        """Step N failed, and step N+1 (queued behind it) was refused without running. Isolate
        N on this thread while the executor is idle, then queue N+1 again, its placeholders
        filled from N's isolated result (requests that failed in N leave it)."""
        queued, self._running = self._running, None
        if queued is not None:
            with contextlib.suppress(StepRefused):
                queued[1].result()
        # N's own placeholders come from the step before it, which the executor still holds
        deltas = self._step_isolating(batch, exc, fill_placeholders(batch, self.executor.last))
        sampled = {d.request_id: d.new_token_ids for d in deltas if d.new_token_ids}
        self.executor.resume(sampled)
        if queued is not None:
            self._running = (queued[0], self.executor.submit(queued[0]))
        return deltas

    def _step_isolating(self, batch: ScheduledBatch, exc: Exception,
                        runnable: ScheduledBatch | None = None) -> list[RequestDelta]:
        """The batched step raised. Run each request of it alone: those that fail alone caused
        it and finish with finish_reason "error" (blocks freed); every other request gets this
        step's tokens as if nothing had happened. Re-running is safe: nothing was committed
        (update() never ran), K/V rewrites put the same values in the same slots, and each
        copy-on-write copy runs again with the request it copies for, before that one writes.
        If every request fails alone and they are samples of two or more requests, the engine
        itself is broken: raise (the samples of one request are one culprit).
        `runnable`: the batch as the runner runs it (placeholders filled), when it differs."""
        sampled, logprobs, culprits = {}, {}, {}
        for sr in (runnable or batch).requests:
            # only the copies into its own blocks: run again after the destination's owner
            # wrote there, a copy would put the shared block's KV back over that write
            copies = tuple(c for c in batch.block_copies if c[1] in sr.block_table)
            single = ScheduledBatch((sr,), copies, batch.finished_request_ids)
            try:
                one = self.runner.execute(single)
            except Exception as single_exc:  # noqa: BLE001
                culprits[sr.request_id] = f"{type(single_exc).__name__}: {single_exc}"
                continue
            sampled.update(one.sampled)
            logprobs.update(one.logprobs)
        get = self.scheduler.requests.get  # None: aborted during the step
        # the requests whose samples the batch holds (a sample's parent, or itself)
        users = {getattr(get(sr.request_id), "parent_id", None) or sr.request_id
                 for sr in batch.requests}
        if len(culprits) == len(batch.requests) and len(users) > 1:
            raise exc
        logger.warning("a step failed; failing only the request(s) that fail alone: %s",
                       culprits, exc_info=exc)
        deltas = [d for request_id, why in culprits.items() for d in self.abort(
            request_id, ERROR, stop_reason=f"the request failed in the engine: {why}")]
        self.num_steps += 1
        # update() skips the requests aborted above, as it does for any abort during a step.
        return deltas + self.scheduler.update(batch, StepResult(sampled, logprobs))

    def abort(self, request_id: str, reason: str = "abort", with_samples: bool = True,
              stop_reason: str | None = None) -> list[RequestDelta]:
        """Finish the request (and its forked samples) in any state, freeing their blocks; a
        request that failed finishes with reason ERROR and `stop_reason` saying why."""
        return [RequestDelta(r.request_id, (), finish_reason=reason, stop_reason=stop_reason,
                             parent_id=r.parent_id, sample_index=r.sample_index,
                             num_cached_tokens=r.num_cached_tokens)
                for r in self.scheduler.abort(request_id, reason, with_samples)]

    def has_unfinished(self) -> bool:
        """Requests to serve, or a step still running (its result is applied by one more step)."""
        return bool(self.scheduler.requests) or self._running is not None

    def cache_summary(self) -> CacheSummary:
        """What the prefix cache holds, for routers (see core/cache_summary.py)."""
        return self.scheduler.kv.pool.summary

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(memory=s.kv.memory_stats(), num_running=len(s.running),
                           num_waiting=s.num_waiting, num_blocked=s.num_blocked,
                           num_queued_tokens=s.num_queued_tokens,
                           num_prefill_tokens=s.num_prefill_tokens,
                           num_preemptions=s.num_preemptions, num_finished=s.num_finished,
                           num_steps=self.num_steps, preemption=s.preemption.stats())


def _check_continuation(c: Continuation, sampling: SamplingParams, max_tokens: int) -> None:
    if sampling.n != 1:
        raise ValueError(f"a continuation carries one sample: n must be 1, got {sampling.n}")
    if not isinstance(c.sample_index, int) or c.sample_index < 0:
        raise ValueError(f"continuation sample_index must be an integer >= 0, got {c.sample_index!r}")
    if len(c.output_token_ids) >= max_tokens:
        raise ValueError(f"the continuation already has {len(c.output_token_ids)} output tokens, "
                         f"max_tokens is {max_tokens}: nothing is left to generate")


def _router_hashes(block_hashes: Sequence[BlockHash], tokens: Sequence[int], block_size: int,
                   cache_salt: str | None) -> Sequence[BlockHash]:
    """The router's hashes of `tokens` (prompt + outputs), if they can be this engine's; else
    none (the engine hashes the prompt itself). A wrong hash would hand its block's KV to every
    request sharing the prefix, so two BLAKE2b calls check them whatever the length: block 0's
    (another block size or salt fails) and the last block's under the hash before it (other
    tokens fail). The chain is deterministic, so the hashes between are trusted
    (tests/serve/test_router_block_hashes.py)."""
    if not isinstance(block_hashes, (list, tuple)) or not block_hashes:
        return ()
    n = len(block_hashes)
    if (n > len(tokens) // block_size
            or any(type(h) is not bytes or len(h) != DIGEST_SIZE for h in block_hashes)):
        return ()
    if hash_block_tokens(tokens, block_size, cache_salt, max_blocks=1) != [block_hashes[0]]:
        return ()
    if n > 1 and hash_block_tokens(tokens, block_size, cache_salt, max_blocks=n, start=n - 1,
                                   parent=block_hashes[-2]) != [block_hashes[-1]]:
        return ()
    return block_hashes
