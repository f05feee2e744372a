"""cache_aware hashes a prompt only as deep as some worker's view may hold it (Router._cache_hashes):
the same choices as hashing the whole prompt, and exactly the depth the rule says (no Ray)."""
from __future__ import annotations

import random

from raypaged.core.block_hash import hash_block_tokens
from raypaged.core.cache_index import CacheIndex
from raypaged.core.cache_summary import CacheView, SummaryDelta, block_key, published
from raypaged.serve.config import ServeOptions
from routing_spec import prompt_block_keys
from raypaged.serve.fleet_loads import FleetLoads, WorkerLoad
from raypaged.serve.routing import Router

BS = 16


def nested_fleet(rng, prompts, n_workers: int, every: int, indexed: bool = True) -> FleetLoads:
    """Workers whose views hold leading blocks of a few prompts (nested, as a prefix cache is),
    sampled by depth as the controller mirrors them for `route_cache_sample` = every."""
    index, workers = CacheIndex(), {}
    for i in range(n_workers):
        held = {}
        for p in rng.sample(prompts, rng.randrange(0, 4)):
            keys = prompt_block_keys(p, BS)
            held.update((k, d) for d, k in enumerate(keys[:rng.randrange(len(keys) + 1)]))
        view = index.view(f"w{i:02d}") if indexed else CacheView()
        view.apply(SummaryDelta(1, tuple(k for k, d in held.items() if published(d, every)),
                                full=True))
        workers[f"w{i:02d}"] = WorkerLoad(rng.randrange(0, 6), rng.choice([0, 16, 300]), view)
    return FleetLoads.of(workers)


def test_hashing_as_deep_as_the_views_reach_chooses_as_hashing_everything():
    rng = random.Random(5)
    head = [rng.randrange(50) for _ in range(70)]
    prompts = [head[:rng.choice([0, 20, 70])] + [rng.randrange(50) for _ in range(n)]
               for n in (5, 40, 100, 300, 700, 1500) for _ in range(3)]
    for trial in range(40):
        every = rng.choice([1, 4, 16])
        loads = nested_fleet(rng, prompts, rng.randrange(1, 25), every)
        for factor in (1.0, 1.25, 3.0):
            router = Router(ServeOptions(routing="cache_aware", route_load_factor=factor,
                                         route_cache_sample=every), BS)
            for p in prompts + [p[:len(p) // 2] + [7] * 200 for p in prompts]:
                whole = router.prompt_keys(p, None)             # no fleet: every block hashed
                shallow = router.prompt_keys(p, None, loads)
                assert shallow.route_key == whole.route_key
                assert len(shallow.block_keys) <= len(whole.block_keys)
                queued = loads.queued.copy()  # a choice charges its worker: each from the same
                got = []
                for keys in (shallow, whole):
                    order, reason = router.choose(keys, loads)
                    got.append((list(order), reason))
                    loads.queued[:] = queued
                assert got[0] == got[1], trial


def test_hashing_stops_at_the_first_power_of_two_depth_no_view_holds():
    prompt = list(range(16 * 100 + 3))          # 100 full blocks; keys of blocks 0..99
    keys = prompt_block_keys(prompt, BS)
    index = CacheIndex()
    index.view("a").apply(SummaryDelta(1, tuple(keys[:5]), full=True))   # blocks 0..4 cached
    loads = FleetLoads.of({"a": WorkerLoad(0, 0, index.views["a"]), "b": WorkerLoad(0)})
    router = Router(ServeOptions(routing="cache_aware", route_cache_sample=1), BS)
    # depths 1, 2, 4 are held, depth 8 (key of block 7) is not: 8 blocks hashed, not 100
    assert router.prompt_keys(prompt, None, loads).block_keys == keys[:8]
    assert router.rank(prompt, None, loads) == (["a", "b"], "cache_hit")
    # nobody holds block 0: only the rendezvous key's 4 blocks are hashed
    cold = [t + 5000 for t in prompt]
    assert router.prompt_keys(cold, None, loads).block_keys == prompt_block_keys(cold, BS)[:4]
    # everything held: every usable block (the last token's block is never a hit)
    index.view("a").apply(SummaryDelta(2, tuple(keys), full=True))
    assert router.prompt_keys(prompt, None, loads).block_keys == keys


def test_views_outside_one_index_get_the_whole_prompt_hashed():
    prompt = list(range(16 * 40))
    loads = nested_fleet(random.Random(1), [prompt] * 3, 3, 1, indexed=False)
    router = Router(ServeOptions(routing="cache_aware", route_cache_sample=1), BS)
    assert router.prompt_keys(prompt, None, loads).block_keys == \
        [block_key(h) for h in hash_block_tokens(prompt, BS)[:39]]
