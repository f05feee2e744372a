"""The inverted index of many cache views answers exactly what walking each view answers (on
nested fleets, as prefix caches are), and stays in step with the views through partial deltas,
full deltas and overlapping changes."""
import random

from raypaged.core.cache_index import CacheIndex
from raypaged.core.cache_summary import CacheSummary, CacheView, SummaryDelta


def exact_hits(index: CacheIndex, keys) -> dict[str, int]:
    """Worker id -> leading blocks of `keys` its bit holds in the index's masks, key by key
    (nested or not), for workers holding at least one."""
    out = {}
    for bit, worker_id in enumerate(index.worker_ids):
        n = 0
        while n < len(keys) and index.holders.get(keys[n], 0) >> bit & 1:
            n += 1
        if n:
            out[worker_id] = n
    return out


def hit_blocks(index: CacheIndex, keys) -> dict[str, int]:
    """Worker id -> leading blocks of `keys` it holds, for workers holding at least one: the
    index's groups (its bisection) spelled out per worker, to compare with each CacheView's own
    walk."""
    out = {}
    for depth, mask in index.hit_groups(keys):
        while mask:
            low = mask & -mask
            out[index.worker_ids[low.bit_length() - 1]] = depth
            mask ^= low
    return out


def test_a_walk_of_the_index_gives_every_views_own_hit_on_random_fleets():
    rng = random.Random(26)
    for trial in range(40):
        index, plain = CacheIndex(), {}
        summaries = {f"w{i}": CacheSummary(log_size=rng.choice([4, 64]))
                     for i in range(rng.randrange(1, 12))}
        universe = list(range(1, 40))
        for _ in range(30):
            wid = rng.choice(list(summaries))
            s = summaries[wid]
            for _ in range(rng.randrange(1, 8)):
                key = rng.choice(universe).to_bytes(8, "little") + bytes(8)
                (s.add if rng.random() < 0.6 else s.remove)(key)
            for w, summary in summaries.items():   # some readers lag, some fall off the log
                if rng.random() < 0.7:
                    view = index.view(w)
                    delta = summary.delta_since(view.version)
                    view.apply(delta)
                    plain.setdefault(w, CacheView()).apply(delta)
            prompts = [[rng.choice(universe) for _ in range(rng.randrange(0, 8))] for _ in range(5)]
            prompts.append(sorted(universe)[:rng.randrange(1, 10)])
            for keys in prompts:
                want = {w: v.cached_prefix_blocks(keys) for w, v in plain.items()}
                got = exact_hits(index, keys)  # not nested: the masks, key by key
                assert {w: got.get(w, 0) for w in plain} == want, (trial, keys)
                assert all(n > 0 for n in got.values())
        held = {}
        for w, v in index.views.items():
            assert v.keys == plain[w].keys
            for k in v.keys:
                held[k] = held.get(k, 0) | v.bit
        assert index.holders == held  # no stale bits, no empty masks left behind


def test_a_key_both_removed_and_added_in_one_delta_stays_held_as_cacheview_applies_it():
    index = CacheIndex()
    view = index.view("w0")
    view.apply(SummaryDelta(1, (5, 6), full=True))
    view.apply(SummaryDelta(2, added=(5,), removed=(5, 6)))
    assert view.keys == {5} and index.holders == {5: 1}
    view.apply(SummaryDelta(3, (7,), full=True))
    assert index.holders == {7: 1} and hit_blocks(index, [7, 5]) == {"w0": 1}


def test_the_walk_reports_the_depth_at_which_each_worker_stops():
    index = CacheIndex()
    for w, keys in {"a": (1, 2, 3, 4), "b": (1,), "c": (1, 2, 3), "d": (2, 3, 4)}.items():
        index.view(w).apply(SummaryDelta(1, keys, full=True))
    assert hit_blocks(index, [1, 2, 3, 4]) == {"a": 4, "b": 1, "c": 3}  # d lacks block 0
    assert index.hit_groups([1, 2, 3, 4]) == [(1, 0b0010), (3, 0b0100), (4, 0b0001)]
    assert hit_blocks(index, []) == {} and hit_blocks(index, [9]) == {}


def test_bisection_finds_every_workers_hit_on_nested_fleets():
    # Prompts branch off shared heads (a trie of chains); each worker holds a leading part of
    # a few of them, as a prefix cache does: bisection must agree with each view's own walk.
    rng = random.Random(2626)
    for trial in range(200):
        trunk = [rng.randrange(1, 2**63) for _ in range(rng.randrange(1, 60))]
        prompts = [trunk[:rng.randrange(0, len(trunk) + 1)]
                   + [rng.randrange(1, 2**63) for _ in range(rng.randrange(0, 40))]
                   for _ in range(6)]
        index, plain = CacheIndex(), {}
        for w in range(rng.randrange(1, 70)):
            held = set()
            for p in rng.sample(prompts, rng.randrange(0, 3)):
                held.update(p[:rng.randrange(0, len(p) + 1)])
            delta = SummaryDelta(1, tuple(held), full=True)
            index.view(f"w{w}").apply(delta)
            plain.setdefault(f"w{w}", CacheView()).apply(delta)
        for keys in prompts + [trunk, trunk[:1], []]:
            want = {w: v.cached_prefix_blocks(keys) for w, v in plain.items()}
            got = hit_blocks(index, keys)
            assert {w: got.get(w, 0) for w in plain} == want, (trial, keys)
            assert got == exact_hits(index, keys), (trial, keys)


def test_bisection_may_credit_a_view_with_a_hole_up_to_its_deepest_held_probe():
    # Not nested (block 1 evicted, its descendants kept). Where a probe lands on the hole's far
    # side missing, bisection finds the stop the linear walk finds ...
    index = CacheIndex()
    index.view("a").apply(SummaryDelta(1, (1, 2, 4), full=True))
    assert exact_hits(index, [1, 2, 3, 4, 5]) == hit_blocks(index, [1, 2, 3, 4, 5]) == {"a": 2}
    # ... where both ends are held, it credits the whole span (the documented overestimate)
    index.view("a").apply(SummaryDelta(2, (1, 3, 4), full=True))
    assert exact_hits(index, [1, 2, 3, 4]) == {"a": 1}
    assert hit_blocks(index, [1, 2, 3, 4]) == {"a": 4}
