"""BlockPool: exact block ids, ref counts, LRU eviction order, hash registration."""
import pytest

from raypaged.core.block_hash import hash_block
from raypaged.core.block_pool import BlockPool

from core_engine import free_blocks


def ids(blocks):
    return [b.block_id for b in blocks]


def h(i: int) -> bytes:
    return hash_block(None, [i])


def test_allocates_lowest_ids_first_and_refuses_overdraw():
    pool = BlockPool(10)
    assert ids(pool.allocate(3)) == [0, 1, 2]
    assert ids(pool.allocate(2)) == [3, 4]
    assert pool.num_free == 5
    with pytest.raises(ValueError, match="asked for 6 blocks, 5 free"):
        pool.allocate(6)
    assert pool.num_free == 5  # nothing taken by a refused call


def test_freed_blocks_join_the_tail_in_the_order_given():
    pool = BlockPool(4)
    a = pool.allocate(4)
    pool.free(reversed(a))  # a sequence frees its tail first
    assert ids(free_blocks(pool)) == [3, 2, 1, 0]
    assert ids(pool.allocate(2)) == [3, 2]


def test_eviction_order_is_lru_and_unregisters_hash():
    pool = BlockPool(6)
    a = pool.allocate(3)  # 0 1 2
    b = pool.allocate(3)  # 3 4 5
    for i, blk in enumerate(a + b):
        pool.register(blk, h(i))
    pool.free(reversed(a))        # queue: 2 1 0
    pool.free(reversed(b))        # queue: 2 1 0 5 4 3
    assert ids(free_blocks(pool)) == [2, 1, 0, 5, 4, 3]
    # A hit on block 0 revives it out of the middle of the queue.
    hit = pool.lookup(h(0))
    assert hit is a[0]
    pool.touch([hit])
    assert hit.ref_count == 1
    assert ids(free_blocks(pool)) == [2, 1, 5, 4, 3]
    # New allocations evict from the head: 2, then 1, and their prefixes are forgotten.
    assert ids(pool.allocate(2)) == [2, 1]
    assert pool.num_evictions == 2
    assert pool.lookup(h(2)) is None and pool.lookup(h(1)) is None
    assert a[2].block_hash is None
    assert pool.lookup(h(5)) is b[2]  # still cached
    # A hit block freed again goes to the tail (most recently used).
    pool.free([hit])
    assert ids(free_blocks(pool)) == [5, 4, 3, 0]


def test_ref_counts_through_share_and_free():
    pool = BlockPool(3)
    (blk,) = pool.allocate(1)
    pool.touch([blk])
    pool.touch([blk])
    assert blk.ref_count == 3
    pool.free([blk])
    pool.free([blk])
    assert blk.ref_count == 1 and pool.num_free == 2
    pool.free([blk])
    assert blk.ref_count == 0 and pool.num_free == 3
    with pytest.raises(AssertionError, match="double free"):
        pool.free([blk])


def test_first_registered_block_wins_for_a_hash():
    pool = BlockPool(3)
    x, y = pool.allocate(2)
    pool.register(x, h(7))
    pool.register(y, h(7))  # same prefix computed twice at once
    assert pool.lookup(h(7)) is x
    assert y.block_hash is None  # y stays uncached and is reused as an empty block


def test_caching_disabled_never_hits():
    pool = BlockPool(2, enable_caching=False)
    (x,) = pool.allocate(1)
    pool.register(x, h(1))
    assert pool.lookup(h(1)) is None


def test_count_by_state():
    pool = BlockPool(5)
    a = pool.allocate(3)
    pool.register(a[0], h(0))
    pool.free([a[0]])
    assert pool.count_by_state() == (2, 1, 2)  # used, cached-free, empty-free
