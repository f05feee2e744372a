"""Property-based: random add / step / abort / fork sequences keep the block accounting sound."""
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raypaged.core.sampling_params import SamplingParams
from raypaged.core.scheduling_policy import FIRST_RULES, FITS, SchedulingPolicy

from core_engine import free_blocks, make_engine

NUM_BLOCKS = 24
BLOCK_SIZE = 4

add_op = st.tuples(
    st.just("add"),
    st.lists(st.integers(0, 3), min_size=1, max_size=30),  # tiny vocab: prefixes collide often
    st.integers(1, 12),   # max_tokens
    st.integers(1, 3),    # n (> 1 forks)
)
ops = st.lists(st.one_of(add_op, st.tuples(st.just("step")), st.tuples(st.just("abort"), st.integers(0, 30))),
               max_size=60)


def check_invariants(eng):
    kv = eng.scheduler.kv
    pool = kv.pool
    in_queue = {b.block_id for b in free_blocks(pool)}
    refs = Counter(bid for table in kv.block_ids.values() for bid in table)
    for block in pool.blocks:
        # every block is either free or referenced, never both; refs match the tables exactly
        assert (block.ref_count == 0) == (block.block_id in in_queue), block
        assert block.ref_count == refs[block.block_id], block
    used, cached, free = pool.count_by_state()
    assert used + cached + free == NUM_BLOCKS
    # the O(1) counters agree with a full walk
    assert used == sum(1 for b in pool.blocks if b.ref_count > 0)
    assert cached == sum(1 for b in pool.blocks if b.ref_count == 0 and b.block_hash is not None)
    assert len(in_queue) == len(pool.free_queue) == pool.num_free
    for rid, table in kv.block_ids.items():
        assert len(table) == len(set(table)), f"{rid} holds a block twice"
        assert [b.block_id for b in kv.tables[rid]] == table
    for bh, block in pool.cached.items():
        assert block.block_hash == bh
    # the scheduler's queued-token counter agrees with a full walk of its queues
    sched = eng.scheduler
    assert sched.num_queued_tokens == sum(r.num_tokens + r.num_placeholders - r.num_computed_tokens
                                          for q in (sched.waiting, sched.running) for r in q)
    # bounded preemption: a preempted request waits at its arrival's place (FCFS on resume)
    if sched.policy.bounded:
        order = [(r.arrival, r.sample_index) for r in sched.waiting]
        assert order == sorted(order)
    p = eng.stats().preemption
    assert sum(p.preempted_per_request) == sched.num_finished
    assert p.recomputed_tokens <= p.computed_tokens


POLICIES = {
    "headroom_bounded": SchedulingPolicy(),
    "first_rules": FIRST_RULES,
    "fits_bounded": SchedulingPolicy(admission_policy=FITS),
    # reserving nothing for decodes: headroom admission that still preempts
    "headroom_no_reserve_bounded": SchedulingPolicy(decode_reserve=0.0),
}


@pytest.mark.parametrize("policy", POLICIES.values(), ids=POLICIES.keys())
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@settings(max_examples=150, deadline=None)
@given(operations=ops)
def test_random_operations_keep_invariants_and_free_everything(operations, overlap, policy):
    eng = make_engine(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_model_len=64,
                      max_num_batched_tokens=16, max_num_seqs=6, overlap=overlap, policy=policy)
    next_id = 0
    for op in operations:
        if op[0] == "add":
            _, prompt, max_tokens, n = op
            try:
                eng.add_request(f"r{next_id}", prompt, SamplingParams(n=n, temperature=1, max_tokens=max_tokens))
            except ValueError:
                pass  # can never fit: refused, nothing queued
            next_id += 1
        elif op[0] == "step":
            eng.step()
        else:
            eng.abort(f"r{op[1]}")
        check_invariants(eng)
    steps = 0
    while eng.has_unfinished():
        eng.step()
        check_invariants(eng)
        steps += 1
        assert steps < 5000
    assert eng.scheduler.kv.pool.num_free == NUM_BLOCKS
    assert not eng.scheduler.kv.tables
