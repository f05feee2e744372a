"""The fleet loop: the serving Router choosing on lagged snapshots, times from the cost model."""
import pytest

from raypaged.serve.routing import routing_key
from routing_spec import rendezvous_order
from benchmarks.sim.cost_model import LinearCost
from benchmarks.sim.experiment import ORACLE, build_fleet, simulate
from benchmarks.sim.policies import policy_spec
from benchmarks.sim.trace import SimRequest
from benchmarks.sim.worker import EngineShape

SHAPE = EngineShape(num_blocks=64, block_size=16, max_model_len=1024)
# 1 s per step + 1 ms per token: a 100-token prompt's prefill step takes 1.1 s
COST = LinearCost("test", per_step=1.0, per_token=0.001, per_seq=0.0, per_kv=0.0)


def req(t, prompt, out=2):
    return SimRequest(t, len(prompt), out, lambda: list(prompt))


def test_round_robin_alternates_and_ttft_is_the_prefill_steps_modelled_time():
    a, b = [7] * 100, [8] * 100
    fleet = build_fleet(2, SHAPE, COST, "round_robin")
    run = fleet.run([req(0.0, a), req(0.0, b), req(5.0, a)])
    assert [r.worker for r in run.records] == ["w0000", "w0001", "w0000"]
    assert [r.first_token_s - r.arrival_s for r in run.records] == pytest.approx([1.1, 1.1, 1.004])
    # decode step: 1 s + 1 token -> the second token lands 1.001 s after the first
    assert run.records[0].finish_s == pytest.approx(1.1 + 1.001)
    assert run.records[2].cached_tokens == 96  # 6 full blocks of a cached on w0000; 4 computed


def _split_prompts():
    """A shares B's first two blocks; B's routing key prefers the worker A did not go to."""
    shared = list(range(100, 132))
    a = shared + [1] * 68
    ids = ["w0000", "w0001"]
    a_home = rendezvous_order(routing_key(a, 16, 4), ids)[0]
    for s in range(2, 200):
        b = shared + [s] * 68
        if rendezvous_order(routing_key(b, 16, 4), ids)[0] != a_home:
            return a, b, a_home
    raise AssertionError("no suffix found")


@pytest.mark.parametrize("interval, b_goes_home", [(0.5, True), (1000.0, False)])
def test_cache_aware_sees_a_cached_prefix_only_once_a_snapshot_has_carried_it(interval, b_goes_home):
    a, b, a_home = _split_prompts()
    fleet = build_fleet(2, SHAPE, COST, "cache_aware", snapshot_interval_s=interval)
    run = fleet.run([req(0.0, a), req(10.0, b)])  # a has long finished when b arrives
    assert run.records[0].worker == a_home
    assert (run.records[1].worker == a_home) is b_goes_home
    assert run.records[1].cached_tokens == (32 if b_goes_home else 0)


def test_the_oracle_is_one_worker_with_the_fleets_cache_and_speed():
    fleet = build_fleet(4, SHAPE, COST, ORACLE)
    (worker,) = fleet.workers.values()
    assert worker.scheduler.kv.pool.num_blocks == 4 * SHAPE.num_blocks
    run = fleet.run([req(0.0, [7] * 100)])
    assert run.records[0].first_token_s == pytest.approx(1.1 / 4)


def test_a_summary_counts_hits_throughput_and_snapshot_traffic():
    out = simulate([req(0.0, [7] * 100), req(3.0, [7] * 100)], 1, SHAPE, COST, "hash")
    assert out["requests"] == 2
    assert out["hit_rate"] == pytest.approx(96 / 200)
    assert out["snapshot_bytes_per_s"] > 0
    # saturation is read off the first 90% of finishes (here: the first, at 1.1 + 1.001 s)
    assert out["throughput_first_90pct"] == pytest.approx(1 / 2.101)


def test_a_conversation_turn_leaves_only_when_the_turn_before_it_has_finished():
    first = req(0.0, [7] * 100, out=3)
    second = SimRequest(0.5, 120, 2, lambda: [7] * 100 + [9] * 20, after=0)
    run = build_fleet(1, SHAPE, COST, "round_robin").run([first, second])
    done = run.records[0].finish_s  # prefill 1.1 s + two decode steps of 1.001 s
    assert done == pytest.approx(3.102)
    assert run.records[1].arrival_s == done
    assert run.records[1].cached_tokens == 96  # the first turn's full prompt blocks


def test_with_a_cache_sample_the_router_sees_and_pays_for_only_the_sampled_keys():
    from raypaged.core.cache_summary import block_key, published
    prompts = [[i] * 16 * 12 + [5] for i in range(1, 7)]
    runs = {}
    for every in (1, 4):
        fleet = build_fleet(2, SHAPE, COST, "cache_aware", 0.5, route_cache_sample=every)
        run = fleet.run([req(0.5 * i, p) for i, p in enumerate(prompts * 2)])
        fleet._take_snapshot()
        for wid, worker in fleet.workers.items():
            pool = worker.scheduler.kv.pool
            depth = pool.summary.depth  # key -> the block's index in its prompt
            assert set(depth) == {block_key(h) for h in pool.cached}
            assert sorted(set(depth.values()))[:12] == list(range(12))
            assert fleet.views[wid].keys == {k for k in depth if published(depth[k], every)}
        runs[every] = run
    assert runs[4].snapshot_bytes < runs[1].snapshot_bytes


def test_the_serving_path_delays_a_requests_arrival_at_its_worker_by_path_s():
    import dataclasses
    slow = dataclasses.replace(COST, path_s=0.25)
    fleet = build_fleet(2, SHAPE, slow, "round_robin")
    run = fleet.run([req(0.0, [7] * 100), req(0.1, [8] * 100)])
    # the prefill starts 0.25 s after the decision and takes 1.1 s; e2e adds the same 0.25 s
    assert [r.first_token_s - r.arrival_s for r in run.records] == pytest.approx([1.35, 1.35])
    assert run.records[0].finish_s == pytest.approx(0.25 + 1.1 + 1.001)
    # the router counted each request at its decision, before it reached the worker
    assert [r.worker for r in run.records] == ["w0000", "w0001"]


def test_steps_on_shared_cores_slow_each_other_while_they_overlap_and_only_then():
    import dataclasses
    # 0.55 s of serving CPU per output token: two 1.1 s prefills at once give 2 tokens per
    # 1.1 s, 1 core of serving, which leaves the two steps half a core each
    shared = dataclasses.replace(COST, serving_cpu_per_token=0.55, cores=2)
    alone = build_fleet(2, SHAPE, shared, "round_robin").run([req(0.0, [7] * 100, out=1)])
    assert alone.records[0].first_token_s == pytest.approx(1.1)  # the other core serves it
    both = build_fleet(2, SHAPE, shared, "round_robin").run(
        [req(0.0, [7] * 100, out=1), req(0.0, [8] * 100, out=1)])
    assert [r.first_token_s for r in both.records] == pytest.approx([2.2, 2.2])
    # the second starts halfway through the first: the first's remaining 0.55 s of work runs
    # at half speed (ends at 1.65), then the second's last 0.55 s alone (ends at 2.2)
    staggered = build_fleet(2, SHAPE, shared, "round_robin").run(
        [req(0.0, [7] * 100, out=1), req(0.55, [8] * 100, out=1)])
    assert [r.first_token_s for r in staggered.records] == pytest.approx([1.65, 2.2])
    assert sum(staggered.busy_s.values()) == pytest.approx(1.65 + 1.65)


def test_a_simulated_worker_takes_the_routers_hashes_and_hashes_only_the_rest(monkeypatch):
    import raypaged.core.request as request_module
    counted = []
    real = request_module.hash_block_tokens

    def counting(*a, **k):
        out = real(*a, **k)
        counted.append(len(out))
        return out
    monkeypatch.setattr(request_module, "hash_block_tokens", counting)
    fleet = build_fleet(2, SHAPE, COST, "cache_aware")
    fleet.run([req(0.0, [7] * 100, out=1)])
    # a cold prompt: the router hashed the rendezvous key's 4 blocks (no view holds more), the
    # engine the prompt's 2 other full blocks
    assert fleet.policy.last_hashes and len(fleet.policy.last_hashes) == 4
    assert sum(counted) == 6 - 4


def test_a_policy_spec_names_serving_settings_and_keeps_the_defaults_it_leaves_empty():
    assert policy_spec("cache_aware") == ("cache_aware", {})
    assert policy_spec("cache_aware:::4096") == ("cache_aware", {"route_cache_slack": 4096})
    assert policy_spec("cache_aware:2:16") == ("cache_aware", {"route_load_factor": 2.0,
                                                               "route_cache_sample": 16})
    assert policy_spec("cache_aware::::1") == ("cache_aware", {"route_recompute_weight": 1.0})


def test_a_replay_of_the_real_fleet_names_its_workers_as_raypaged_serve_does():
    """Which worker a cold prefix goes to is the first of its rendezvous order, which hashes
    the worker names: a replay named w0000/w0001 splits a real run's prefixes otherwise."""
    from benchmarks.fleet_sim_calibrate import REAL_WORKER_IDS
    from raypaged.serve.autoscaler import worker_id_of, worker_index
    assert REAL_WORKER_IDS == ["worker-0", "worker-1"] == [worker_id_of(0), worker_id_of(1)]
    assert worker_index(worker_id_of(7)) == 7
    ours, real = ["w0000", "w0001"], REAL_WORKER_IDS
    prompts = [[s] * 100 for s in range(1, 40)]
    # a prompt whose home worker (by position) differs between the two namings
    p = next(p for p in prompts if ours.index(rendezvous_order(routing_key(p, 16, 4), ours)[0])
             != real.index(rendezvous_order(routing_key(p, 16, 4), real)[0]))
    home = rendezvous_order(routing_key(p, 16, 4), real)[0]
    run = build_fleet(2, SHAPE, COST, "hash", worker_ids=real).run([req(0.0, p)])
    assert run.records[0].worker == home
    default = build_fleet(2, SHAPE, COST, "hash").run([req(0.0, p)])
    assert ours.index(default.records[0].worker) != real.index(home)
