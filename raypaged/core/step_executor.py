"""StepExecutor: runs the model steps on a thread of their own, in order, one at a time.

Overlapped scheduling (SGLang's overlap scheduler, vLLM v1's async scheduling): while step N
runs here, the engine thread schedules step N+1 and queues it; step N+1 may feed placeholders
for the tokens step N samples, and this thread fills them in from step N's result just before
running N+1, so the model never waits for core to apply step N:

    engine thread:  schedule N+1 ─ submit ─ wait N ─ update N, outputs N │ schedule N+2 ─ ...
    this thread:    ......... run N ........│ fill N+1 from N ─ run N+1 ..........│ ...

Steps run strictly one after another, so a block freed (by a stop, abort or preemption) while
step N+1 is queued is written by a later step only after N+1 has run. After a step fails,
every later step is refused (StepRefused, nothing run) until `resume()`: the engine re-runs the
failed step request by request on its own thread while this one is idle.
"""
from __future__ import annotations

import dataclasses
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Mapping

from raypaged.core.contracts import ModelRunner, ScheduledBatch, StepResult


class StepRefused(Exception):
    """A step queued behind a failed one: it did not run."""


class StepExecutor:
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

