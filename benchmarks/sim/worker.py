"""A simulated worker: the real EngineCore + Scheduler + KVCacheManager + BlockPool, with a
runner that computes nothing and a cost model that says how long each step took.

EngineCore.step() is schedule -> runner.execute -> update in one call. Here the step is split at
its two ends in simulated time, so nothing a step produces is visible before it has run:

    start_step(t):   batch = scheduler.schedule()          (blocks allocated, prefix hits taken)
                     duration = cost(batch)
    finish_step():   scheduler.update(batch, runner.execute(batch))   at t + duration
                     (tokens appended, full blocks registered in the cache, finished freed)

Requests added between the two ends wait for the next schedule(), as they do in the engine.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from raypaged.core.contracts import ModelRunner, RequestDelta, ScheduledBatch, StepResult
from raypaged.core.engine_core import EngineCore
from raypaged.core.sampling_params import SamplingParams
from raypaged.core.scheduler import Scheduler
from benchmarks.sim.cost_model import step_shape

# What the simulated model samples: SIM_TOKEN, and SIM_EOS as a request's last output token.
SIM_TOKEN, SIM_EOS = 1, 2


class LengthRunner:
    """Computes nothing; samples SIM_TOKEN until a request has one token left of the output
    length its workload gives, then SIM_EOS. Requests leave max_tokens open, as chat clients
    do: the scheduler does not know how long an answer will be (headroom admission projects it
    from the lengths it has seen), and the answer still has exactly the trace's length."""

    def __init__(self) -> None:
        self.output_len: dict[str, int] = {}

    def execute(self, batch: ScheduledBatch) -> StepResult:
        sampled = {}
        for sr in batch.requests:
            if sr.num_samples:
                last = len(sr.output_token_ids) + 1 >= self.output_len[sr.request_id]
                sampled[sr.request_id] = (SIM_EOS if last else SIM_TOKEN,)
        return StepResult(sampled=sampled)


@dataclass(frozen=True)
class EngineShape:
    """The engine settings a simulated worker runs with (those of `raypaged serve`)."""

    num_blocks: int
    block_size: int = 16
    max_model_len: int = 131_072
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_prefix_caching: bool = True


class SimWorker:
    def __init__(self, worker_id: str, engine: EngineShape, cost, speedup: float = 1.0,
                 runner: ModelRunner | None = None) -> None:
        """cost: a cost model (cost_model.py); speedup divides its step times (the oracle)."""
        self.worker_id = worker_id
        scheduler = Scheduler(engine.num_blocks, engine.block_size, engine.max_model_len,
                              engine.max_num_seqs, engine.max_num_batched_tokens,
                              engine.enable_prefix_caching)
        self._lengths = LengthRunner()
        self.engine = EngineCore(scheduler, runner or self._lengths)
        self.scheduler = scheduler
        self.cost, self.speedup = cost, speedup
        self._batch: ScheduledBatch | None = None
        self.busy_s = 0.0  # simulated time spent in steps
        self.step_sampled = 0

    def add(self, request_id: str, prompt: list[int], output_len: int,
            block_hashes: Sequence[bytes] = ()) -> None:
        """Queue a request through EngineCore.add_request (the same validation as serving); it
        generates exactly output_len tokens, ending with SIM_EOS. `block_hashes`: the router's
        (PromptKeys.hashes), taken by the engine as serving's worker takes them."""
        if output_len < 1:
            raise ValueError(f"output_len must be >= 1, got {output_len} ({request_id})")
        self._lengths.output_len[request_id] = output_len
        self.engine.add_request(request_id, prompt, SamplingParams(max_tokens=None),
                                eos_token_id=SIM_EOS, block_hashes=block_hashes)

    @property
    def stepping(self) -> bool:
        return self._batch is not None

    def start_step(self) -> float | None:
        """Schedule a step; its duration in seconds, or None when there is nothing to run."""
        assert self._batch is None, "a step is already running"
        batch = self.scheduler.schedule()
        if not batch.requests:
            return None
        self._batch = batch
        shape = step_shape(batch)
        self.step_sampled = shape.sampled  # output tokens this step gives (Fleet's stretch)
        seconds = self.cost.seconds(shape) / self.speedup
        self.busy_s += seconds
        return seconds

    def finish_step(self) -> list[RequestDelta]:
        batch, self._batch = self._batch, None
        assert batch is not None, "no step is running"
        deltas = self.scheduler.update(batch, self.engine.runner.execute(batch))
        for d in deltas:
            if d.finished:
                self._lengths.output_len.pop(d.request_id, None)
        return deltas
