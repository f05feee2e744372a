"""The router's arrays (FleetLoads): the same choice as the per-worker rule they replace, on random
fleets with workers left out; and the Dispatcher keeps them exact between snapshots (no Ray)."""
from __future__ import annotations

import dataclasses

import math
import random

import numpy as np

from raypaged.config import KVPlan
from raypaged.core.cache_index import CacheIndex
from raypaged.core.cache_summary import CacheView, SummaryDelta
from raypaged.core.contracts import EngineStats, MemoryStats
from raypaged.serve.config import ServeOptions
from raypaged.serve.cost_routing import CACHED, COLD
from raypaged.serve.dispatch import Dispatcher
from raypaged.serve.fleet import READY, FleetSnapshot, WorkerView
from raypaged.serve.fleet_loads import FleetLoads, Ranking, WorkerLoad
from raypaged.serve.messages import WorkerStats
from raypaged.serve.metrics import RequestMetrics
from raypaged.serve.routing import AFFINITY, LOAD_BOUND, Router, routing_key
from routing_spec import bounded_choice, prompt_block_keys, rendezvous_order

BS = 16


def spec_hash(prompt, workers: dict[str, WorkerLoad], factor: float):
    """The rule as routing.py states it: rendezvous order, the first worker under the bound."""
    order = rendezvous_order(routing_key(prompt, BS, 4), sorted(workers))
    pick = bounded_choice(order, {w: x.requests for w, x in workers.items()}, factor)
    return [order[pick], *order[:pick], *order[pick + 1:]], AFFINITY if pick == 0 else LOAD_BOUND


def spec_cost(prompt, workers: dict[str, WorkerLoad], factor: float, slack: int,
              weight: float):
    """The rule as cost_routing.py states it, one view at a time: of the workers under the cap
    within `slack` tokens of the cheapest (cost: `weight` x the prompt tokens a worker lacks,
    plus its queue), the longest hit, then the lowest cost, then the fewest requests, then
    rendezvous order; a prompt no worker under the cap holds: the first of its rendezvous order
    under the cap. A worker over the cap but under twice it is a candidate too when it holds
    more than `slack` tokens beyond every worker under the cap."""
    order = rendezvous_order(routing_key(prompt, BS, 4), sorted(workers))
    keys = prompt_block_keys(prompt, BS)
    cap = math.ceil(factor * (sum(x.requests for x in workers.values()) + 1) / len(order))
    under = [w for w in order if workers[w].requests + 1 <= cap] or order
    hit = {w: BS * (workers[w].cache.cached_prefix_blocks(keys) if workers[w].cache else 0)
           for w in order}
    most = max(hit[w] for w in under)
    eligible = [w for w in order if w in under or (
        workers[w].requests + 1 <= 2 * cap and hit[w] > most + slack)]
    cost = {w: weight * (len(prompt) - hit[w]) + workers[w].queued_tokens for w in order}
    if not any(hit[w] for w in eligible):
        best = eligible[0]
    else:
        cheapest = min(cost[w] for w in eligible)
        near = [w for w in eligible if cost[w] <= cheapest + slack]  # in rendezvous order
        best = min(near, key=lambda w: (-hit[w], cost[w], workers[w].requests))
    return [best, *(w for w in order if w != best)], CACHED if hit[best] else COLD


def test_the_arrays_choose_as_the_per_worker_rule_on_random_fleets_with_workers_left_out():
    rng = random.Random(11)
    prompts = [[rng.randrange(40) for _ in range(rng.choice([10, 65, 130]))] for _ in range(10)]
    prompts += [prompts[1][:48] + p[48:] for p in prompts[2:6]]  # shared heads
    keys = [prompt_block_keys(p, BS) for p in prompts]
    for trial in range(80):
        index, ids = CacheIndex(), [f"w{i:02d}" for i in range(rng.randrange(1, 30))]
        workers = {}
        for w in ids:
            held = set()
            for k in rng.sample(range(len(keys)), rng.randrange(0, 3)):
                held.update(keys[k][:rng.randrange(len(keys[k]) + 1)])
            view = index.view(w) if rng.random() < 0.8 else CacheView()  # some not indexed
            view.apply(SummaryDelta(1, tuple(held), full=True))
            workers[w] = WorkerLoad(rng.randrange(0, 6), rng.choice([0, 0, 16, rng.randrange(300)]),
                                    view if rng.random() < 0.9 else None)
        out = set(rng.sample(ids, rng.randrange(0, len(ids))))
        left = {w: x for w, x in workers.items() if w not in out}
        for factor, slack, weight in ((1.0, 0, 1.0), (1.25, 2048, 1.5), (3.0, 100, 2.0)):
            hashed = Router(ServeOptions(routing="hash", route_load_factor=factor), BS)
            costed = Router(ServeOptions(routing="cache_aware", route_load_factor=factor,
                                         route_cache_slack=slack, route_recompute_weight=weight,
                                         route_cache_sample=1), BS)  # every key: the spec
            for p in prompts:
                loads = FleetLoads.of(workers)  # fresh: a cache_aware choice charges its worker
                assert _ranked(hashed, p, loads, out) == spec_hash(p, left, factor), trial
                assert _ranked(costed, p, loads, out) == spec_cost(p, left, factor, slack,
                                                                    weight), trial


def _ranked(router, prompt, loads, out):
    order, reason = router.rank(prompt, None, loads.excluding(out))
    return list(order), reason


def test_a_ranking_sorts_the_fallbacks_only_when_asked_past_the_first():
    loads = FleetLoads.of({w: WorkerLoad(0) for w in ("a", "b", "c")})
    ranking = Ranking(loads, np.array([1, 3, 2], np.uint64), 0)  # "a" chosen, then b, c
    assert ranking[0] == "a" and ranking._all is None
    assert list(ranking) == ["a", "b", "c"] and len(ranking) == 3
    assert ranking == ["a", "b", "c"] and ranking != ["a", "c", "b"]


def view(wid: str, active: int, queued: int) -> WorkerView:
    memory = MemoryStats(64, 16, 10, 4, 50, 0, 0, 0, 0)
    engine = EngineStats(memory, 2, 1, 0, 9, 100, num_queued_tokens=queued)
    budget = KVPlan(1 << 20, 1024, block_size=16, num_blocks=64, max_model_len=1024)
    stats = WorkerStats(wid, "inc", 1, "m", 1024, 16, budget, engine, num_active=active)
    return WorkerView(wid, READY, handle=None, stats=stats)


class Fleet:
    def __init__(self, snap: FleetSnapshot):
        self.snap = snap

    def snapshot(self) -> FleetSnapshot:
        return self.snap


def test_the_dispatcher_counts_its_own_requests_in_the_arrays_between_snapshots():
    fleet = Fleet(FleetSnapshot(1, (view("w1", 2, 30), view("w0", 5, 0))))
    d = Dispatcher(fleet, None, RequestMetrics())
    _, loads = d.candidates(set())
    assert loads.worker_ids == ("w0", "w1") and loads.requests.tolist() == [5, 2]
    assert loads.queued.tolist() == [0, 30]
    d.opened("w1")
    d.opened("w1")
    d.opened("w0")
    d.opened("w0", n=-1)
    _, again = d.candidates(set())
    assert again is loads and again.requests.tolist() == [5, 4]   # no rebuild, exact counts
    _, some = d.candidates({"w0"})
    assert len(some) == 1 and some.ready_ids() == ["w1"] and some.requests is loads.requests
    # the next snapshot saw our 2 requests on w1 (its load 4 = 2 others + 2 ours): not twice
    fleet.snap = FleetSnapshot(2, (view("w0", 5, 0), view("w1", 4, 0)))
    _, fresh = d.candidates(set())
    assert fresh is not loads and fresh.requests.tolist() == [5, 4]
    d.mark_suspect("w1")
    assert d.candidates(set())[1].ready_ids() == ["w0"]


def test_a_suspect_worker_back_as_a_new_process_is_a_candidate_again():
    fleet = Fleet(FleetSnapshot(1, (view("w0", 0, 0), view("w1", 0, 0))))
    d = Dispatcher(fleet, None, RequestMetrics())
    d.mark_suspect("w1", "inc")  # its process "inc" failed
    assert d.candidates(set())[1].ready_ids() == ["w0"]
    new = dataclasses.replace(view("w1", 0, 0).stats, incarnation="inc-2")
    fleet.snap = FleetSnapshot(2, (view("w0", 0, 0), WorkerView("w1", READY, None, new)))
    assert d.candidates(set())[1].ready_ids() == ["w0", "w1"]


def test_a_refresh_of_the_same_poll_keeps_the_arrays_and_what_routing_charged_to_them():
    """The fleet client refreshes its snapshot object every 0.25 s, the controller polls every
    0.5 s: a new object of the same version must not drop the prefill charged since the poll."""
    fleet = Fleet(FleetSnapshot(1, (view("w0", 0, 0), view("w1", 0, 0))))
    d = Dispatcher(fleet, None, RequestMetrics())
    _, loads = d.candidates(set())
    loads.queued[0] += 500  # what a cache_aware choice charges (routing.py)
    d.opened("w0")
    fleet.snap = FleetSnapshot(1, (view("w0", 0, 0), view("w1", 0, 0)))  # same poll, new object
    _, same = d.candidates(set())
    assert same is loads and same.queued.tolist() == [500, 0] and same.requests.tolist() == [1, 0]
    fleet.snap = FleetSnapshot(2, (view("w0", 1, 480), view("w1", 0, 0)))  # the next poll
    _, fresh = d.candidates(set())
    assert fresh.queued.tolist() == [480, 0] and fresh.requests.tolist() == [1, 0]
