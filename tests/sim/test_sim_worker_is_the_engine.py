"""A simulated worker admits, preempts and evicts exactly as EngineCore does.

The same request sequence goes to EngineCore (core's KV-checking fake runner) and to a SimWorker
(the same runner, its step split in two around the cost model): every step's batch (requests,
tokens, positions, block tables), every output token, the preemptions and the evictions agree.
"""
from fake_runner import FakeRunner

from raypaged.core.engine_core import EngineCore
from raypaged.core.sampling_params import SamplingParams
from raypaged.core.scheduler import Scheduler
from benchmarks.sim.cost_model import LinearCost
from benchmarks.sim.worker import SIM_EOS, SIM_TOKEN, EngineShape, SimWorker

SHAPE = EngineShape(num_blocks=10, block_size=4, max_model_len=40, max_num_seqs=4,
                    max_num_batched_tokens=16)
COST = LinearCost("test", per_step=1.0, per_token=0.0, per_seq=0.0, per_kv=0.0)

SHARED = [5, 6, 7, 8, 9, 10, 11, 12]
# (step before which it arrives, request id, prompt, max tokens): shared prefixes hit the cache;
# a and c leave max_tokens open (up to max_model_len, as chat clients do), so no admission rule
# can know how far they grow: together they outgrow the 10-block pool (preemption); later
# requests evict cached blocks.
ARRIVALS = [
    (0, "a", SHARED + [1, 2], None),
    (0, "b", SHARED + [3], 8),
    (1, "c", [20 + i for i in range(13)], None),
    (3, "d", SHARED + [4, 4, 4, 4, 4], 5),
    (6, "e", [40 + i for i in range(9)], 4),
    (9, "f", SHARED + [1, 2], 3),
    (12, "g", [60 + i for i in range(17)], 6),
]


def _batch_view(batch):
    return [(r.request_id, list(r.token_ids), r.start_position, list(r.block_table),
             r.num_samples) for r in batch.requests]


def run_engine_core():
    runner = FakeRunner(SHAPE.num_blocks, SHAPE.block_size)
    sched = Scheduler(SHAPE.num_blocks, SHAPE.block_size, SHAPE.max_model_len,
                      SHAPE.max_num_seqs, SHAPE.max_num_batched_tokens)
    engine = EngineCore(sched, runner)
    out, step = {}, 0
    while step < 200:
        for at, rid, prompt, n in ARRIVALS:
            if at == step:
                engine.add_request(rid, prompt, SamplingParams(max_tokens=n))
        if step > max(a[0] for a in ARRIVALS) and not engine.has_unfinished():
            break
        for d in engine.step():
            out.setdefault(d.request_id, []).extend(d.new_token_ids)
        step += 1
    return runner.batches, out, sched


def run_sim_worker():
    runner = FakeRunner(SHAPE.num_blocks, SHAPE.block_size)
    worker = SimWorker("w0", SHAPE, COST, runner=runner)
    out, step = {}, 0
    while step < 200:
        for at, rid, prompt, n in ARRIVALS:
            if at == step:  # the worker's own EngineCore, as serving adds requests
                worker.engine.add_request(rid, prompt, SamplingParams(max_tokens=n))
        if step > max(a[0] for a in ARRIVALS) and not worker.engine.has_unfinished():
            break
        if worker.start_step() is not None:
            for d in worker.finish_step():
                out.setdefault(d.request_id, []).extend(d.new_token_ids)
        step += 1
    return runner.batches, out, worker.scheduler


def test_a_simulated_worker_schedules_every_step_as_engine_core_does():
    core_batches, core_out, core = run_engine_core()
    sim_batches, sim_out, sim = run_sim_worker()
    assert [_batch_view(b) for b in sim_batches] == [_batch_view(b) for b in core_batches]
    assert sim_out == core_out
    assert set(sim_out) == {"a", "b", "c", "d", "e", "f", "g"}


def test_the_shared_sequence_preempts_and_evicts_the_same_blocks():
    _, _, core = run_engine_core()
    _, _, sim = run_sim_worker()
    # Evictions are certain (the pool is recycled); whether a and c preempt each other is the
    # admission policy's call (core/admission.py may reserve their growth up front): either
    # way the simulated worker must do what the engine does.
    assert core.kv.pool.num_evictions > 0
    assert (sim.num_preemptions, sim.kv.pool.num_evictions) == (
        core.num_preemptions, core.kv.pool.num_evictions)
    assert sim.kv.memory_stats() == core.kv.memory_stats()
    assert sim.kv.pool.summary.keys == core.kv.pool.summary.keys


def test_a_simulated_request_generates_exactly_its_output_length_with_max_tokens_open():
    worker = SimWorker("w0", SHAPE, COST)
    worker.add("x", [1, 2, 3, 4, 5], 7)
    outputs = []
    while worker.start_step() is not None:
        outputs += [t for d in worker.finish_step() for t in d.new_token_ids]
    assert outputs == [SIM_TOKEN] * 6 + [SIM_EOS]
    assert worker.scheduler.num_finished == 1


def test_a_step_takes_the_cost_models_time_and_its_tokens_land_at_its_end():
    worker = SimWorker("w0", SHAPE, LinearCost("t", 0.5, 0.25, 0.0, 0.0))
    worker.add("x", [1, 2, 3, 4, 5, 6], 2)
    assert worker.start_step() == 0.5 + 0.25 * 6
    # Nothing is applied before the step's end: the prompt's full block is not cached yet.
    assert worker.engine.cache_summary().keys == set()
    (delta,) = worker.finish_step()
    assert delta.request_id == "x" and len(delta.new_token_ids) == 1
    assert len(worker.engine.cache_summary().keys) == 1
