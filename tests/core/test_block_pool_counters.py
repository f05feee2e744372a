"""BlockPool's O(1) counts by state equal a full walk of the pool after any operation sequence."""
from hypothesis import given, settings
from hypothesis import strategies as st

from raypaged.core.block_hash import hash_block
from raypaged.core.block_pool import BlockPool

NUM_BLOCKS = 12

ops = st.lists(st.one_of(
    st.tuples(st.just("allocate"), st.integers(0, 4)),
    st.tuples(st.just("free"), st.integers(0, 100)),      # drop one held reference (picked by index)
    st.tuples(st.just("hit"), st.integers(0, 100)),       # a prefix hit on a cached block
    st.tuples(st.just("share"), st.integers(0, 100)),     # fork: one more reference on a held block
    st.tuples(st.just("register"), st.integers(0, 100), st.integers(0, 5)),  # tiny hash space: collisions
), max_size=80)


def walk(pool: BlockPool) -> tuple[int, int, int]:
    used = sum(1 for b in pool.blocks if b.ref_count > 0)
    cached = sum(1 for b in pool.blocks if b.ref_count == 0 and b.block_hash is not None)
    return used, cached, NUM_BLOCKS - used - cached


@settings(max_examples=300, deadline=None)
@given(ops, st.booleans())
def test_counts_by_state_match_a_full_walk(operations, caching):
    pool = BlockPool(NUM_BLOCKS, enable_caching=caching)
    held = []  # one entry per reference we hold
    for op in operations:
        if op[0] == "allocate" and op[1] <= pool.num_free:
            held.extend(pool.allocate(op[1]))
        elif op[0] == "free" and held:
            pool.free([held.pop(op[1] % len(held))])
        elif op[0] == "hit" and pool.cached:
            block = list(pool.cached.values())[op[1] % len(pool.cached)]
            pool.touch([block])
            held.append(block)
        elif op[0] == "share" and held:
            block = held[op[1] % len(held)]
            pool.touch([block])
            held.append(block)
        elif op[0] == "register" and held:
            pool.register(held[op[1] % len(held)], hash_block(None, [op[2]]))
        assert pool.count_by_state() == walk(pool), op
    pool.free(held)
    assert pool.count_by_state() == (0, len(pool.cached), NUM_BLOCKS - len(pool.cached))


def test_register_of_a_free_block_counts_it_as_cached():
    pool = BlockPool(3)
    (a,) = pool.allocate(1)
    pool.free([a])
    assert pool.count_by_state() == (0, 0, 3)
    pool.register(a, hash_block(None, [1]))
    assert pool.count_by_state() == (0, 1, 2)
    (b, c, d) = pool.allocate(3)  # evicts the cached one last (it is at the tail)
    assert pool.count_by_state() == (3, 0, 0) and pool.num_evictions == 1
