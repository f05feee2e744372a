"""Helpers for core tests: an EngineCore over the KV-simulating fake runner."""
import time

from raypaged.core.engine_core import EngineCore
from raypaged.core.scheduler import Scheduler

from fake_runner import FakeRunner


def free_blocks(pool) -> list:
    """The pool's free queue, head (evicted first) to tail."""
    return list(pool.free_queue.values())


def make_engine(num_blocks=64, block_size=4, max_model_len=4096, max_num_seqs=256,
                max_num_batched_tokens=2048, prefix=True, overlap=False, runner=None,
                policy=None, clock=time.monotonic) -> EngineCore:
    """overlap: async scheduling (the runner runs on the engine's step executor thread);
    policy: core.scheduling_policy.SchedulingPolicy (FIRST_RULES: admit what fits, preempt the
    newest, for tests that need preemptions to happen)."""
    sched = Scheduler(num_blocks, block_size, max_model_len, max_num_seqs,
                      max_num_batched_tokens, prefix, policy, clock)
    return EngineCore(sched, runner or FakeRunner(num_blocks, block_size), overlap)


def run_to_completion(engine: EngineCore, max_steps: int = 100_000) -> dict[str, list[int]]:
    """Step until idle; returns each sequence's output tokens and checks each finished once."""
    out: dict[str, list[int]] = {}
    finished: set[str] = set()
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return out
        for d in engine.step():
            assert d.request_id not in finished, f"{d.request_id} produced after finishing"
            out.setdefault(d.request_id, []).extend(d.new_token_ids)
            if d.finished:
                finished.add(d.request_id)
    raise AssertionError("engine did not finish")
