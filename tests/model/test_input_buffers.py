"""InputBuffers, updated incrementally, give exactly the inputs a from-scratch build gives.

The real scheduler drives random add / step / abort sequences through a pool small enough to
preempt, with n > 1 requests (forks, then copy-on-write replacing a shared block in the middle
of a running table); every step's buffers are checked against the batch itself.
"""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from raypaged.core.contracts import ScheduledBatch, StepResult
from raypaged.core.engine_core import EngineCore
from raypaged.core.sampling_params import SamplingParams
from raypaged.core.scheduler import Scheduler
from raypaged.model.input_buffers import InputBuffers

BS = 4
MAX_SEQS = 6
MAX_LEN = 48


def seq_len(r) -> int:
    return r.start_position + len(r.token_ids)


class CheckingRunner:
    def __init__(self) -> None:
        self.buffers = InputBuffers(MAX_SEQS, 16, MAX_LEN, BS, torch.device("cpu"))
        self.steps = 0

    def execute(self, batch: ScheduledBatch) -> StepResult:
        input_ids, positions, meta = self.buffers.prepare(batch)
        ids, pos, slots = [], [], []
        for b, r in enumerate(batch.requests):
            ids += r.token_ids
            for p in range(r.start_position, seq_len(r)):
                pos.append(p)
                slots.append(r.block_table[p // BS] * BS + p % BS)
            used = -(-seq_len(r) // BS)
            assert meta.block_tables[b, :used].tolist() == list(r.block_table[:used]), r.request_id
        assert input_ids.tolist() == ids
        assert positions.tolist() == pos
        assert meta.slot_mapping.tolist() == slots
        assert meta.seq_lens.tolist() == [seq_len(r) for r in batch.requests]
        starts = [0]
        for r in batch.requests:
            starts.append(starts[-1] + len(r.token_ids))
        assert meta.query_start_loc.tolist() == starts
        self.steps += 1
        return StepResult({r.request_id: tuple((seq_len(r) * 7 + j) % 5 for j in range(r.num_samples))
                           for r in batch.requests if r.num_samples})


ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.lists(st.integers(0, 2), min_size=1, max_size=14),
              st.integers(1, 10), st.integers(1, 3)),
    st.tuples(st.just("step")), st.tuples(st.just("abort"), st.integers(0, 20))), max_size=50)


@settings(max_examples=80, deadline=None)
@given(ops)
def test_incremental_buffers_equal_a_full_rebuild_every_step(operations):
    runner = CheckingRunner()
    engine = EngineCore(Scheduler(num_blocks=14, block_size=BS, max_model_len=MAX_LEN,
                                  max_num_seqs=MAX_SEQS, max_num_batched_tokens=16), runner)
    for k, op in enumerate(operations):
        if op[0] == "add":
            try:
                engine.add_request(f"r{k}", op[1], SamplingParams(n=op[3], max_tokens=op[2]))
            except ValueError:
                pass
        elif op[0] == "step":
            engine.step()
        else:
            engine.abort(f"r{op[1]}")
    while engine.has_unfinished():
        engine.step()
    assert len(runner.buffers._free_rows) + len(runner.buffers._row) == MAX_SEQS


def test_copy_on_write_rewrites_the_replaced_entry():
    runner = CheckingRunner()
    engine = EngineCore(Scheduler(num_blocks=14, block_size=BS, max_model_len=MAX_LEN,
                                  max_num_seqs=MAX_SEQS, max_num_batched_tokens=16), runner)
    engine.add_request("a", [1, 2, 3, 4, 5, 6], SamplingParams(n=2, max_tokens=4))  # partial 2nd block
    copies = []
    while engine.has_unfinished():
        batch = engine.scheduler.schedule()
        copies += batch.block_copies
        engine.scheduler.update(batch, runner.execute(batch))  # the runner's checks ran
    assert copies, "the forked samples wrote into their shared partial block"
