"""A worker's published cache summary matches its block pool, step after step, through prefix
hits, evictions, preemptions and aborts; readers catch up by deltas (or a full copy when they
fell behind the log) and answer "how many leading blocks of this prompt are cached here"."""
import random

import pytest

from core_engine import make_engine
from raypaged.core.block_hash import hash_block_tokens
from raypaged.core.cache_summary import CacheSummary, CacheView, SummaryDelta, block_key
from raypaged.core.sampling_params import SamplingParams
from raypaged.core.scheduling_policy import FIRST_RULES


def pool_keys(engine) -> set[int]:
    return {block_key(h) for h in engine.scheduler.kv.pool.cached}


@pytest.mark.parametrize("log_size", [65536, 7])  # 7: readers often fall behind the log
def test_a_view_synced_by_deltas_equals_the_pool_after_every_step(log_size):
    rng = random.Random(log_size)
    # the first rules (admit what fits, preempt the newest): this workload must preempt
    engine = make_engine(num_blocks=16, block_size=4, max_num_batched_tokens=64, policy=FIRST_RULES)
    pool = engine.scheduler.kv.pool
    pool.summary = CacheSummary(log_size)
    view, fulls = CacheView(), 0
    prefixes = [[rng.randrange(1, 900) for _ in range(12)] for _ in range(4)]
    for i in range(60):
        prompt = rng.choice(prefixes) + [rng.randrange(1, 900) for _ in range(rng.randrange(1, 9))]
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=rng.randrange(1, 24),
                                                           ignore_eos=True, temperature=0))
        if rng.random() < 0.1:
            engine.abort(f"r{rng.randrange(i + 1)}")
        for _ in range(rng.randrange(1, 3)):
            engine.step()
            delta = pool.summary.delta_since(view.version)
            fulls += delta.full
            view.apply(delta)
            assert view.keys == pool_keys(engine) and view.version == pool.summary.version
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.memory.evictions > 0  # the run exercised both
    assert (fulls > 1) == (log_size == 7)


def test_cached_prefix_blocks_is_the_prefix_hit_the_worker_would_give():
    engine = make_engine(num_blocks=32, block_size=4)
    shared = list(range(100, 120))  # 5 full blocks
    engine.add_request("a", shared + [1, 2, 3], SamplingParams(max_tokens=1, temperature=0))
    while engine.has_unfinished():
        engine.step()
    view = CacheView()
    view.apply(engine.scheduler.kv.pool.summary.delta_since(view.version))
    probe = shared[:12] + [7, 7, 7, 7, 7]  # 3 shared blocks, then a different one
    keys = [block_key(h) for h in hash_block_tokens(probe, 4)]
    assert view.cached_prefix_blocks(keys) == 3
    assert view.cached_prefix_blocks([block_key(h) for h in hash_block_tokens(shared, 4)]) == 5
    salted = [block_key(h) for h in hash_block_tokens(shared, 4, cache_salt="tenant-b")]
    assert view.cached_prefix_blocks(salted) == 0
    engine.add_request("b", probe, SamplingParams(max_tokens=1, temperature=0))
    [delta] = engine.step()
    assert delta.num_cached_tokens == 3 * 4


def test_a_delta_nets_out_a_key_added_and_removed_meanwhile():
    summary = CacheSummary()
    summary.add(b"a" * 16)
    start = summary.version
    summary.add(b"b" * 16)
    summary.remove(b"b" * 16)
    summary.remove(b"a" * 16)
    summary.add(b"c" * 16)
    delta = summary.delta_since(start)
    assert (delta.added, delta.removed, delta.full) == ((block_key(b"c" * 16),),
                                                        (block_key(b"a" * 16),), False)
    assert summary.delta_since(summary.version).added == ()
    assert summary.delta_since(summary.version + 5).full  # a reader from another incarnation


def test_a_mirror_serves_its_readers_the_same_set_by_its_own_versions():
    worker, mirror = CacheSummary(), CacheSummary()
    seen, router = -1, CacheView()
    for i in range(30):
        worker.add(bytes([i]) * 16)
        if i % 3 == 0:
            worker.remove(bytes([i // 2]) * 16)
        if i % 4 == 0:  # the controller polls the worker, a router polls the controller
            delta = worker.delta_since(seen)
            mirror.mirror(delta)
            seen = delta.version
            router.apply(mirror.delta_since(router.version))
            assert router.keys == mirror.keys == worker.keys
    restarted = CacheSummary()  # a new incarnation: its versions start again at 0
    restarted.add(b"z" * 16)
    delta = restarted.delta_since(seen)
    assert delta.full
    mirror.mirror(delta)
    router.apply(mirror.delta_since(router.version))
    assert router.keys == {block_key(b"z" * 16)} and not router.version < mirror.version


def test_a_sampled_delta_keeps_the_keys_at_published_depths_and_drops_the_depths():
    from raypaged.core.cache_summary import published, sampled, sampled_positions
    # every = 4: blocks 1, 2, 4, 8 (depths 0, 1, 3, 7) and every 4th (depths 3, 7, 11, 15)
    assert [d for d in range(16) if published(d, 4)] == [0, 1, 3, 7, 11, 15]
    delta = SummaryDelta(9, added=(50, 51, 52, 53), removed=(60, 61), depths=(0, 2, 3, 5, 11, 6))
    assert sampled(delta, 4) == SummaryDelta(9, (50, 52), (60,))
    assert sampled(delta, 1) == SummaryDelta(9, (50, 51, 52, 53), (60, 61))
    assert sampled(SummaryDelta(3, (1, 2, 6), full=True, depths=(1, 2, 7)), 4) == \
        SummaryDelta(3, (1, 6), full=True)
    assert sampled_positions(list(range(100, 109)), 4) == [0, 1, 3, 7]
    with pytest.raises(ValueError, match="depths"):
        sampled(SummaryDelta(1, (5,)), 4)


def test_a_summary_delta_carries_each_keys_depth_through_changes_and_pickling():
    import pickle
    a, b, c = (bytes([x]) * 16 for x in b"abc")
    summary = CacheSummary()
    summary.add(a, 0)
    summary.add(b, 5)
    since = summary.version
    summary.remove(a)
    summary.add(c, 2)
    delta = summary.delta_since(since)
    assert delta == SummaryDelta(summary.version, (block_key(c),), (block_key(a),), depths=(2, 0))
    assert pickle.loads(pickle.dumps(delta)) == delta
    assert summary.delta_since(since, depths=False).depths is None  # what routers are sent
    full = summary.delta_since(-1)
    assert dict(zip(full.added, full.depths)) == {block_key(b): 5, block_key(c): 2}
    mirror = CacheSummary()
    mirror.mirror(full)
    assert mirror.depth == summary.depth


def test_a_delta_crosses_a_process_boundary_as_eight_bytes_per_key_and_unchanged():
    import pickle

    keys = tuple(range(2**64 - 1000, 2**64)) + (0, 1, 2**63)
    delta = SummaryDelta(42, keys, (7, 2**64 - 1), full=True)
    assert pickle.loads(pickle.dumps(delta)) == delta
    empty = len(pickle.dumps(SummaryDelta(42)))
    # 8 bytes a key, plus two length fields (pickled as ints: ~10.5 bytes a key)
    assert 8 * (len(keys) + 2) <= len(pickle.dumps(delta)) - empty <= 8 * (len(keys) + 2) + 8
