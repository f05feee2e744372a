"""Prefix caching through the engine: exact hit lengths and block ids (block_size 4)."""
from raypaged.core.sampling_params import SamplingParams

from core_engine import free_blocks, make_engine, run_to_completion

SP = SamplingParams(temperature=0, max_tokens=2)


def first_batch_for(engine, rid):
    return next(sr for b in engine.runner.batches for sr in b.requests if sr.request_id == rid)


def test_second_request_hits_exactly_the_shared_full_blocks():
    eng = make_engine(num_blocks=16)
    eng.add_request("a", list(range(10)), SP)
    run_to_completion(eng)
    assert first_batch_for(eng, "a").block_table[:3] == [0, 1, 2]
    # a freed blocks 2, 1, 0 (tail first); 0 and 1 are full and cached, 2 is partial.
    assert [b.block_id for b in free_blocks(eng.scheduler.kv.pool)][-3:] == [2, 1, 0]

    eng.add_request("b", list(range(8)) + [100, 101, 102], SP)
    run_to_completion(eng)
    sr = first_batch_for(eng, "b")
    assert sr.start_position == 8 and list(sr.token_ids) == [100, 101, 102]
    assert list(sr.block_table) == [0, 1, 3]  # two hits, then the LRU head (block 3)
    mem = eng.stats().memory
    assert (mem.prefix_queries, mem.prefix_hits) == (10 + 11, 8)


def test_fully_cached_prompt_still_computes_its_last_block():
    eng = make_engine(num_blocks=16)
    eng.add_request("a", list(range(8)), SP)
    run_to_completion(eng)
    deltas = []
    eng.add_request("b", list(range(8)), SP)
    while eng.has_unfinished():
        deltas += eng.step()
    assert deltas[0].num_cached_tokens == 4  # 8 tokens cached, but one block must be recomputed
    assert first_batch_for(eng, "b").start_position == 4


def test_different_cache_salt_never_hits():
    eng = make_engine(num_blocks=16)
    eng.add_request("a", list(range(12)), SP, cache_salt="tenant-1")
    run_to_completion(eng)
    eng.add_request("b", list(range(12)), SP, cache_salt="tenant-2")
    eng.add_request("c", list(range(12)), SP)
    eng.add_request("d", list(range(12)), SP, cache_salt="tenant-1")
    run_to_completion(eng)
    assert first_batch_for(eng, "b").start_position == 0
    assert first_batch_for(eng, "c").start_position == 0
    assert first_batch_for(eng, "d").start_position == 8


def test_prefix_caching_off_never_hits():
    eng = make_engine(num_blocks=16, prefix=False)
    eng.add_request("a", list(range(12)), SP)
    run_to_completion(eng)
    eng.add_request("b", list(range(12)), SP)
    run_to_completion(eng)
    assert first_batch_for(eng, "b").start_position == 0
    assert eng.stats().memory.prefix_queries == 0


def test_generated_tokens_are_cached_too():
    """A follow-up turn that repeats a finished conversation hits its output blocks as well."""
    eng = make_engine(num_blocks=32)
    eng.add_request("a", list(range(6)), SamplingParams(temperature=0, max_tokens=7))
    out = run_to_completion(eng)["a"]
    convo = list(range(6)) + out  # 13 tokens, of which 12 were computed: 3 full blocks
    eng.add_request("b", convo + [5, 5, 5], SP)
    run_to_completion(eng)
    assert first_batch_for(eng, "b").start_position == 12


def test_hit_revives_a_free_block_and_eviction_forgets_it():
    eng = make_engine(num_blocks=6)
    eng.add_request("a", list(range(9)), SP)  # blocks 0 1 2
    run_to_completion(eng)
    kv = eng.scheduler.kv
    assert [b.block_id for b in free_blocks(kv.pool)] == [3, 4, 5, 2, 1, 0]
    # 'x' needs 5 blocks for 17 prompt tokens + 1: takes 3 4 5 2 1, evicting the prefix in 1.
    eng.add_request("x", list(range(500, 517)), SamplingParams(temperature=0, max_tokens=1))
    run_to_completion(eng)
    assert kv.pool.num_evictions == 1
    assert kv.pool.lookup(kv.pool.blocks[0].block_hash) is kv.pool.blocks[0]  # 0 survived
    eng.add_request("b", list(range(9)), SP)
    run_to_completion(eng)
    assert first_batch_for(eng, "b").start_position == 4  # block 0 hits, block 1 was evicted
