"""Rendezvous hashing with a load bound: pure functions, exact cases (no Ray)."""
from __future__ import annotations

import collections

from raypaged.core.block_hash import hash_block_tokens
from raypaged.serve.config import ServeOptions
from raypaged.serve.fleet_loads import WorkerLoad
from raypaged.serve.routing import AFFINITY, LOAD_BOUND, ROUND_ROBIN, Router, routing_key
from routing_spec import bounded_choice, rendezvous_order

WORKERS = ["worker-0", "worker-1", "worker-2", "worker-3"]


def idle(ids=WORKERS):
    return {w: 0 for w in ids}


def in_flight(loads: dict[str, int]) -> dict[str, WorkerLoad]:
    return {w: WorkerLoad(n) for w, n in loads.items()}


def test_key_is_the_cores_chain_hash_at_the_configured_depth():
    tokens = list(range(100))  # 6 full blocks of 16
    assert routing_key(tokens, 16, 4) == hash_block_tokens(tokens, 16)[3]
    assert routing_key(tokens, 16, 50) == hash_block_tokens(tokens, 16)[-1]  # fewer blocks: deepest
    assert routing_key(tokens, 16, 4, "salt") != routing_key(tokens, 16, 4)


def test_prompts_sharing_the_prefix_blocks_share_the_key_whatever_follows():
    prefix = list(range(64))
    assert routing_key(prefix + [1, 2, 3], 16, 4) == routing_key(prefix + [9] * 40, 16, 4)
    assert routing_key(prefix + [1], 16, 4) != routing_key([7] + prefix, 16, 4)


def test_short_prompts_without_a_full_block_still_get_a_stable_key():
    assert routing_key([1, 2, 3], 16, 4) == routing_key([1, 2, 3], 16, 4)
    assert routing_key([1, 2, 3], 16, 4) != routing_key([1, 2, 4], 16, 4)


def test_rendezvous_order_is_a_stable_permutation_and_removal_moves_only_that_workers_keys():
    keys = [routing_key([i] * 16, 16, 1) for i in range(400)]
    first = {k: rendezvous_order(k, WORKERS)[0] for k in keys}
    assert all(sorted(rendezvous_order(k, WORKERS)) == WORKERS for k in keys[:10])
    after = {k: rendezvous_order(k, WORKERS[1:])[0] for k in keys}
    moved = [k for k in keys if first[k] != after[k]]
    assert all(first[k] == "worker-0" for k in moved)  # only worker-0's keys moved
    spread = collections.Counter(first.values())
    assert min(spread.values()) > 400 / 4 * 0.7  # and keys spread evenly


def test_load_bound_passes_the_request_on_above_factor_times_mean():
    order = ["worker-0", "worker-1"]
    # capacity = ceil(1.25 * (total + 1) / 2)
    assert bounded_choice(order, {"worker-0": 1, "worker-1": 0}, 1.25) == 0  # 2 <= ceil(1.25)
    assert bounded_choice(order, {"worker-0": 2, "worker-1": 0}, 1.25) == 1  # 3 > ceil(1.875)
    assert bounded_choice(order, {"worker-0": 4, "worker-1": 1}, 1.25) == 1  # 5 > ceil(3.75)
    assert bounded_choice(order, {"worker-0": 3, "worker-1": 1}, 1.25) == 0  # 4 <= ceil(3.125)


def test_a_hot_key_fills_its_worker_up_to_the_bound_then_spills_in_its_own_order():
    router = Router(ServeOptions(routing="hash", route_prefix_blocks=4, route_load_factor=1.25), block_size=16)
    tokens = list(range(80))
    loads = idle(["worker-0", "worker-1"])
    picks = []
    for _ in range(6):
        order, reason = router.rank(tokens, None, in_flight(loads))
        picks.append((order[0], reason))
        loads[order[0]] += 1
    preferred = picks[0][0]
    reasons = [r for _, r in picks]
    assert reasons.count(AFFINITY) == 4 and reasons.count(LOAD_BOUND) == 2
    assert sum(w == preferred for w, _ in picks) == 4


def test_the_ranking_lists_every_candidate_once_choice_first():
    router = Router(ServeOptions(routing="hash", route_prefix_blocks=4, route_load_factor=1.25), block_size=16)
    loads = {"worker-0": 9, "worker-1": 0, "worker-2": 0}
    order, reason = router.rank(list(range(70)), None, in_flight(loads))
    assert sorted(order) == sorted(loads) and reason in (AFFINITY, LOAD_BOUND)
    assert order[0] != "worker-0"  # far above the mean


def test_round_robin_cycles_and_ignores_the_prompt():
    router = Router(ServeOptions(routing="round_robin"), block_size=16)
    firsts = [router.rank([1] * 40, None, in_flight(idle(WORKERS[:3])))[0][0] for _ in range(6)]
    assert firsts == ["worker-0", "worker-1", "worker-2"] * 2
    assert router.rank([1], None, in_flight(idle()))[1] == ROUND_ROBIN


def test_no_candidates_gives_an_empty_ranking():
    assert Router(ServeOptions(), 16).rank([1, 2], None, {}) == ([], "")


def test_the_vectorised_weight_is_splitmix64_of_key_xor_the_workers_salt():
    import hashlib
    M = (1 << 64) - 1

    def splitmix64(x):
        x ^= x >> 30
        x = (x * 0xBF58476D1CE4E5B9) & M
        x ^= x >> 27
        x = (x * 0x94D049BB133111EB) & M
        return x ^ (x >> 31)

    def weight(key, w):
        salt = int.from_bytes(hashlib.blake2b(w.encode(), digest_size=8).digest(), "little")
        return splitmix64(int.from_bytes(key[:8], "little") ^ salt)
    ids = [f"w{i:04d}" for i in range(300)]
    for i in range(50):
        key = routing_key([i] * 16, 16, 1)
        assert rendezvous_order(key, ids) == sorted(ids, key=lambda w: weight(key, w), reverse=True)
