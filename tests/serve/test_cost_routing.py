"""Cache-aware routing on constructed snapshots: exact choices (no Ray)."""
from __future__ import annotations

from raypaged.core.cache_summary import CacheView, SummaryDelta
from cost_ranking import rank_by_cost
from raypaged.serve.cost_routing import COLD, CACHED
from routing_spec import prompt_block_keys
from raypaged.serve.fleet_loads import WorkerLoad

BS = 16
PROMPT = list(range(1000, 1065))           # 65 tokens: 4 blocks can hit (never the last token)
KEYS = prompt_block_keys(PROMPT, BS)
ORDER = ["w2", "w0", "w1"]                 # the prompt's rendezvous order


def view(keys) -> CacheView:
    v = CacheView()
    v.apply(SummaryDelta(1, tuple(keys), full=True))
    return v


def rank(workers, factor=1.5):
    return rank_by_cost(len(PROMPT), KEYS, BS, workers, ORDER, factor)


def test_prompt_keys_cover_full_blocks_before_the_last_token():
    assert len(KEYS) == 4 and len(prompt_block_keys(PROMPT[:64], BS)) == 3
    assert prompt_block_keys(PROMPT, BS, "salt") != KEYS


def test_a_prompt_nobody_holds_goes_to_its_rendezvous_first():
    idle = {w: WorkerLoad(0) for w in ORDER}
    assert rank(idle) == (["w2", "w0", "w1"], COLD)


def test_the_worker_holding_the_longest_prefix_wins():
    workers = {"w2": WorkerLoad(0, cache=view(KEYS[:1])), "w0": WorkerLoad(0),
               "w1": WorkerLoad(0, cache=view(KEYS[:3]))}
    assert rank(workers) == (["w1", "w2", "w0"], CACHED)


def test_a_long_queue_outweighs_a_cache_hit():
    # w1 would save 48 prefill tokens but has 500 queued; w0 computes all 65 with nothing ahead
    workers = {"w2": WorkerLoad(1, queued_tokens=200), "w0": WorkerLoad(1),
               "w1": WorkerLoad(1, queued_tokens=500, cache=view(KEYS[:3]))}
    assert rank(workers) == (["w0", "w2", "w1"], COLD)


def test_a_token_computed_again_weighs_more_than_a_queued_one():
    # w1 lacks 17 of the 65 tokens with 60 queued; w0 lacks all 65 with none queued.
    # Alike (weight 1): 77 > 65, w0; recomputing weighed 1.5x: 60 + 25.5 < 97.5, w1.
    workers = {"w2": WorkerLoad(1, queued_tokens=200), "w0": WorkerLoad(1),
               "w1": WorkerLoad(1, queued_tokens=60, cache=view(KEYS[:3]))}
    assert rank(workers) == (["w0", "w2", "w1"], COLD)
    assert rank_by_cost(len(PROMPT), KEYS, BS, workers, ORDER, 1.5, recompute_weight=1.5) == \
        (["w1", "w2", "w0"], CACHED)


def test_the_concurrency_cap_passes_over_a_full_worker_whose_extra_hit_is_within_the_slack():
    # 5 in flight + this one over 3 workers, factor 1.5: at most ceil(1.5 * 6 / 3) = 3 each.
    # w1 is full and holds 64 tokens, 32 more than w0 under the cap: within a slack of 32
    workers = {"w2": WorkerLoad(0), "w0": WorkerLoad(2, cache=view(KEYS[:2])),
               "w1": WorkerLoad(3, cache=view(KEYS))}
    assert rank_by_cost(len(PROMPT), KEYS, BS, workers, ORDER, 1.5, slack=32) == \
        (["w0", "w2", "w1"], CACHED)


def test_a_full_worker_takes_a_prefix_it_holds_beyond_the_slack_until_twice_the_cap():
    # cap 3 as above; w1 holds 32 tokens more than any worker under the cap, slack 31
    workers = {"w2": WorkerLoad(0), "w0": WorkerLoad(2, cache=view(KEYS[:2])),
               "w1": WorkerLoad(3, cache=view(KEYS))}
    assert rank_by_cost(len(PROMPT), KEYS, BS, workers, ORDER, 1.5, slack=31) == \
        (["w1", "w2", "w0"], CACHED)
    # its cost still decides: w0 costs 33, so w1 is a candidate while 1 + queued <= 33 + 31
    for queued, first in ((63, "w1"), (64, "w0")):
        workers["w1"] = WorkerLoad(3, queued, view(KEYS))
        assert rank_by_cost(len(PROMPT), KEYS, BS, workers, ORDER, 1.5, slack=31)[0][0] == first
    # twice the cap is the end: factor 1.0, w1 alone in flight with r: cap ceil((r + 1) / 3)
    for in_flight, first in ((3, "w1"), (4, "w0")):  # 4 of cap 2: inside 2 x 2; 5: past it
        workers = {"w2": WorkerLoad(0), "w0": WorkerLoad(0, cache=view(KEYS[:2])),
                   "w1": WorkerLoad(in_flight, cache=view(KEYS))}
        assert rank_by_cost(len(PROMPT), KEYS, BS, workers, ORDER, 1.0, slack=31)[0][0] == first


def test_equal_costs_fall_back_to_rendezvous_order():
    workers = {w: WorkerLoad(0, cache=view(KEYS[:2])) for w in ORDER}
    assert rank(workers) == (["w2", "w0", "w1"], CACHED)


def test_a_cold_prompt_skips_its_rendezvous_first_when_that_one_is_full():
    workers = {"w2": WorkerLoad(4), "w0": WorkerLoad(0), "w1": WorkerLoad(0)}
    assert rank(workers) == (["w0", "w2", "w1"], COLD)


# -- the slack: a prefix stays where it lives while that costs little --------------------------
def test_within_the_slack_the_longest_prefix_wins_over_a_shorter_queue():
    # w1 holds 3 blocks (48 tokens): cost 65 - 48 + q; w0 holds nothing, idle: cost 65.
    # Slack 2048: w1 while 17 + q <= 65 + 2048, i.e. q <= 2096
    for queued, first in ((2096, "w1"), (2097, "w0")):
        workers = {"w2": WorkerLoad(1, queued_tokens=9000), "w0": WorkerLoad(1),
                   "w1": WorkerLoad(1, queued_tokens=queued, cache=view(KEYS[:3]))}
        assert rank_by_cost(len(PROMPT), KEYS, BS, workers, ORDER, 1.5, slack=2048)[0][0] == first


def test_within_the_slack_equal_hits_go_to_the_cheaper_then_the_less_busy():
    # every worker holds 2 blocks; w2 and w0 cost 40 more than w1: inside the slack, but the
    # hits are equal, so the cheaper wins
    workers = {"w2": WorkerLoad(0, 40, view(KEYS[:2])), "w0": WorkerLoad(0, 40, view(KEYS[:2])),
               "w1": WorkerLoad(2, 0, view(KEYS[:2]))}
    assert rank_by_cost(len(PROMPT), KEYS, BS, workers, ORDER, 3.0, slack=100)[0] == \
        ["w1", "w2", "w0"]
    # equal costs: fewer requests in flight (w0), not rendezvous order (w2)
    workers = {"w2": WorkerLoad(2, 0, view(KEYS[:2])), "w0": WorkerLoad(1, 0, view(KEYS[:2])),
               "w1": WorkerLoad(2, 0, view(KEYS[:2]))}
    assert rank_by_cost(len(PROMPT), KEYS, BS, workers, ORDER, 3.0, slack=100)[0] == \
        ["w0", "w2", "w1"]


def test_the_router_charges_its_choice_with_the_prefill_it_predicts_until_the_next_snapshot():
    from raypaged.serve.fleet_loads import FleetLoads
    router = Router(ServeOptions(routing="cache_aware"), BS)  # serving's defaults
    assert (router.config.route_cache_slack, ServeOptions().routing) == (2048, "cache_aware")
    loads = FleetLoads.of({"a": WorkerLoad(0, cache=view(KEYS[:2])), "b": WorkerLoad(0)})
    order, reason = router.rank(PROMPT, None, loads)
    # a holds 32 of the 65 tokens: it takes the request and is charged the 33 it computes
    assert (list(order), reason, loads.queued.tolist()) == (["a", "b"], CACHED, [33, 0])
    # a cold prompt: charged whole to its rendezvous first
    cold = [t + 7000 for t in PROMPT]
    first = list(router.rank(cold, None, loads)[0])[0]
    assert loads.queued[loads.at[first]] == (33 if first == "a" else 0) + 65


# -- through the fleet: worker summary -> controller mirror -> router views -------------------
import asyncio  # noqa: E402
import dataclasses  # noqa: E402

from fake_engine import FakeEngine  # noqa: E402
from local_fleet import LocalFleet, client_for, local_app  # noqa: E402
from raypaged.core.cache_summary import block_key  # noqa: E402
from raypaged.core.sampling_params import SamplingParams  # noqa: E402
from raypaged.serve.config import ServeOptions  # noqa: E402
from raypaged.serve.controller import Controller  # noqa: E402
from raypaged.serve.dispatch import Dispatcher  # noqa: E402
from raypaged.serve.metrics import RequestMetrics  # noqa: E402
from raypaged.serve.routing import Router  # noqa: E402
from local_link import generate  # noqa: E402
from raypaged.serve.worker import Worker  # noqa: E402


async def run_request(worker, rid, prompt):
    async for _ in generate(worker, rid, prompt, SamplingParams(max_tokens=2, ignore_eos=True)):
        pass


def pool_keys(worker) -> set[int]:
    return {block_key(h) for h in worker.engine.core.scheduler.kv.pool.cached}


def test_the_controller_mirrors_each_workers_cache_and_routers_catch_up_by_deltas():
    async def main():
        workers = {"worker-0": Worker(FakeEngine(), "worker-0")}

        async def probe(worker, since):
            return worker.stats(since)
        controller = Controller(list(workers.items()), probe, poll_interval_s=60)
        controller._ensure_polling = lambda: None  # poll only when the test says so
        router = {}
        w = workers["worker-0"]
        for i in range(3):
            await run_request(w, f"r{i}", [97 + i] * 40)
            await controller.poll_once()
            for wid, delta in (await controller.cache_deltas(
                    {k: v.version for k, v in router.items()})).items():
                router.setdefault(wid, CacheView()).apply(delta)
            assert router["worker-0"].keys == pool_keys(w) and len(pool_keys(w)) >= 2 * (i + 1)
            assert (await controller.snapshot()).workers[0].stats.cache is None  # not re-sent
        # the worker restarts: a new process whose versions start again
        workers["worker-0"].shutdown()
        fresh = Worker(FakeEngine(), "worker-0")
        controller._views["worker-0"] = dataclasses.replace(controller._views["worker-0"],
                                                             handle=fresh)
        await run_request(fresh, "s", [120] * 40)
        for _ in range(2):  # a partial delta from the new process is refused, then a full one
            await controller.poll_once()
        for wid, delta in (await controller.cache_deltas(
                {k: v.version for k, v in router.items()})).items():
            router[wid].apply(delta)
        assert router["worker-0"].keys == pool_keys(fresh)
        fresh.shutdown()
    asyncio.run(main())


def test_cache_aware_routing_sends_a_shared_prefix_where_it_is_cached():
    fleet = LocalFleet(n=3)
    app, metrics = local_app(fleet, options=ServeOptions(routing="cache_aware"))
    system = "You are a helpful assistant. " * 6  # ~174 bytes: ten full blocks of 16
    bodies = [{"model": "fake-model", "prompt": system + f"question {i}?", "max_tokens": 2,
               "ignore_eos": True} for i in range(6)]

    async def main():
        async with client_for(app) as client:
            first = await client.post("/v1/completions", json=bodies[0])
            rest = [await client.post("/v1/completions", json=b) for b in bodies[1:]]
        return first, rest
    try:
        first, rest = asyncio.run(main())
    finally:
        fleet.shutdown()
    home = first.headers["x-raypaged-worker"]
    assert [r.headers["x-raypaged-worker"] for r in rest] == [home] * 5
    assert metrics.counters["routing_decisions"] == {"cold_prefix": 1.0, "cache_hit": 5.0}
    assert all(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 160 for r in rest)


def test_two_router_replicas_with_the_same_snapshot_choose_alike():
    fleet = LocalFleet(n=4)
    try:
        asyncio.run(run_request(fleet.workers["worker-2"], "warm", list(b"x" * 80)))
        snap_loads = Dispatcher(fleet, None, RequestMetrics()).candidates(set())[1]
        routers = [Router(ServeOptions(routing="cache_aware"), 16) for _ in range(2)]
        for prompt in (list(b"x" * 70), list(b"y" * 70), list(b"x" * 33 + b"z" * 40)):
            a, b = (r.rank(prompt, None, snap_loads) for r in routers)
            assert a == b
        order, reason = routers[0].rank(list(b"x" * 70), None, snap_loads)
        assert (order[0], reason) == ("worker-2", CACHED)
    finally:
        fleet.shutdown()


# -- the inverted index: the same ranking as walking every view -------------------------------
import random  # noqa: E402

from raypaged.core.cache_index import CacheIndex  # noqa: E402
from raypaged.serve.routing import routing_key  # noqa: E402
from routing_spec import rendezvous_order  # noqa: E402


def test_ranking_from_the_inverted_index_equals_walking_each_view_on_random_fleets(monkeypatch):
    import raypaged.serve.cost_routing as cr
    walk = cr._held
    rng = random.Random(7)
    prompts = [[rng.randrange(50) for _ in range(rng.choice([20, 65, 130]))] for _ in range(12)]
    prompts += [prompts[0][:40] + p[40:] for p in prompts[1:6]]   # shared heads
    keys = [prompt_block_keys(p, BS) for p in prompts]
    for trial in range(60):
        index, ids = CacheIndex(), [f"w{i:02d}" for i in range(rng.randrange(1, 24))]
        indexed, plain = {}, {}
        for w in ids:
            held = set()
            for k in rng.sample(range(len(keys)), rng.randrange(0, 4)):
                held.update(keys[k][:rng.randrange(len(keys[k]) + 1)])
            held.update(rng.sample(range(1, 1000), 3))
            delta = SummaryDelta(1, tuple(held), full=True)
            index.view(w).apply(delta)
            load = (rng.randrange(0, 5), rng.choice([0, 0, 16, 100, rng.randrange(400)]))
            indexed[w] = WorkerLoad(*load, cache=index.view(w))
            plain[w] = WorkerLoad(*load, cache=view(held))
        for p, k in zip(prompts, keys):
            order = rendezvous_order(routing_key(p, BS, 4), sorted(ids))
            for factor in (1.0, 1.25, 4.0):
                monkeypatch.setattr(cr, "_held", None)  # the index path walks no view
                got = rank_by_cost(len(p), k, BS, indexed, order, factor)
                monkeypatch.setattr(cr, "_held", walk)
                assert got == rank_by_cost(len(p), k, BS, plain, order, factor)
        # a worker whose view is not the index's (e.g. a fresh copy) sends all to the walk
        mixed = {**indexed, ids[0]: WorkerLoad(0, cache=view(indexed[ids[0]].cache.keys))}
        p, k = prompts[0], keys[0]
        order = rendezvous_order(routing_key(p, BS, 4), sorted(ids))
        assert rank_by_cost(len(p), k, BS, mixed, order, 1.5) == \
            rank_by_cost(len(p), k, BS, {**plain, ids[0]: mixed[ids[0]]}, order, 1.5)


# -- sampled views (route_cache_sample): a hit counts up to the deepest sampled key held ------
from raypaged.core.cache_summary import sampled, sampled_positions  # noqa: E402


def test_with_sampled_views_a_hit_counts_whole_blocks_up_to_the_last_sampled_key_held():
    keys = [1, 2, 3, 4, 5, 6, 7, 8]                # every = 4: blocks 1, 2, 4, 8 are published
    positions = sampled_positions(keys, 4)
    walked, blocks_at = [keys[i] for i in positions], [0, *(i + 1 for i in positions)]
    assert (walked, blocks_at) == ([1, 2, 4, 8], [0, 1, 2, 4, 8])

    def sampled_view(held):  # a prefix of the prompt: key i is block i
        v = CacheView()
        v.apply(sampled(SummaryDelta(1, tuple(held), full=True,
                                     depths=tuple(range(len(held)))), 4))
        return v
    order = ["w2", "w0", "w1"]
    # w0 holds 6 blocks (published: key 4 -> 4 blocks), w1 holds all 8 but 60 more tokens queued:
    # hit 128 tokens vs 64 -> w1's cost 129 - 128 + 60 = 61 < w0's 129 - 64 + 0 = 65
    workers = {"w2": WorkerLoad(0), "w0": WorkerLoad(0, cache=sampled_view(keys[:6])),
               "w1": WorkerLoad(0, queued_tokens=60, cache=sampled_view(keys))}
    rank_sampled = lambda: rank_by_cost(129, walked, BS, workers, order, 2.0, blocks_at)  # noqa: E731
    assert rank_sampled() == (["w1", "w2", "w0"], CACHED)
    # 70 queued: w1 costs 71 > 65, and w0's 4 published blocks are worth 64 tokens, not 96
    workers["w1"] = WorkerLoad(0, queued_tokens=70, cache=sampled_view(keys))
    assert rank_sampled() == (["w0", "w2", "w1"], CACHED)
    # a worker holding 3 blocks is seen holding 2 (a power of two): a short prefix stays
    # visible; holding none, the prompt is cold
    workers = {w: WorkerLoad(0, cache=sampled_view(keys[:3])) for w in order}
    workers["w2"] = WorkerLoad(0, queued_tokens=1, cache=sampled_view(keys[:3]))
    assert rank_sampled() == (["w0", "w2", "w1"], CACHED)
    workers = {w: WorkerLoad(0, cache=sampled_view([])) for w in order}
    assert rank_sampled() == (order, COLD)


def test_the_router_walks_only_the_sampled_keys_of_the_prompt():
    prompt = list(range(2000, 2000 + 16 * 40 + 1))      # 40 blocks can hit
    keys = prompt_block_keys(prompt, BS)
    positions = sampled_positions(keys, 4)
    assert len(positions) < 40 // 2 and positions[-1] == 39
    deep = positions[-1] + 1                               # blocks a sampled view proves
    # w0 holds every block; w1 holds all but the last published one: the router must value
    # w0's cache at `deep` blocks, so a queue of (deep - shallow) x 16 - 1 tokens still loses
    shallow = positions[-2] + 1
    def sampled_view(held):  # a prefix of the prompt: key i is block i
        v = CacheView()
        v.apply(sampled(SummaryDelta(1, tuple(held), full=True,
                                     depths=tuple(range(len(held)))), 4))
        return v
    router = Router(ServeOptions(routing="cache_aware", route_cache_sample=4,  # the hits priced
                                 route_cache_slack=0, route_recompute_weight=1), BS)  # exactly
    for queued, winner in (((deep - shallow) * BS - 1, "w0"), ((deep - shallow) * BS + 1, "w1")):
        workers = {"w0": WorkerLoad(0, queued_tokens=queued, cache=sampled_view(keys)),
                   "w1": WorkerLoad(0, cache=sampled_view(keys[:deep - 1]))}
        assert router.rank(prompt, None, workers)[0][0] == winner


def test_a_controller_with_a_cache_sample_serves_routers_only_the_sampled_keys():
    from raypaged.core.cache_summary import published
    async def main():
        w = Worker(FakeEngine(), "worker-0")

        async def probe(worker, since):
            return worker.stats(since)
        controller = Controller([("worker-0", w)], probe, poll_interval_s=60, cache_sample=4)
        controller._ensure_polling = lambda: None
        router = CacheView()
        for i in range(4):
            await run_request(w, f"r{i}", [90 + i] * 200)  # 12 blocks: 5 published
            await controller.poll_once()
            for delta in (await controller.cache_deltas({"worker-0": router.version})).values():
                router.apply(delta)  # none if no sampled key changed
            depth = w.engine.core.scheduler.kv.pool.summary.depth  # key -> block index
            assert router.keys == {k for k in pool_keys(w) if published(depth[k], 4)}
        assert 0 < len(router.keys) < len(pool_keys(w)) / 2  # some keys, most not sent
        w.shutdown()
    asyncio.run(main())
