"""The routing policies the simulator compares. Three are `raypaged serve`'s own Router (the
same class, options and snapshot inputs the serving Dispatcher gives it); one is a baseline
that serving does not offer.

    round_robin, hash, cache_aware   raypaged.serve.routing.Router, routing=<name>
    least_loaded                     power of two choices on queued prompt tokens: two workers
                                     drawn at random, the one with fewer tokens queued (as of
                                     the snapshot, plus the prompts this router sent it since)
The oracle (one worker holding the whole fleet's KV cache) is not a policy: see fleet.py.
"""
from __future__ import annotations

import random
from typing import Protocol, Sequence

from raypaged.serve.config import ServeOptions
from raypaged.serve.fleet_loads import FleetLoads
from raypaged.serve.routing import Router

ROUTER_POLICIES = ("round_robin", "hash", "cache_aware")
POLICIES = (*ROUTER_POLICIES, "least_loaded")
DEFAULT_POLICY = ServeOptions().routing  # what `raypaged serve` routes with unless told


class Policy(Protocol):
    name: str
    # the block hashes the last choice computed (sent with the request, as serving does)
    last_hashes: Sequence[bytes]

    def choose(self, token_ids: Sequence[int], workers: FleetLoads) -> str: ...


class RouterPolicy:
    """The serving Router; the first worker of its ranking is the choice. As serving's
    Generation does, rank() in its two halves, keeping the prompt's hashes for the worker."""

    def __init__(self, routing: str, block_size: int, **options) -> None:
        self.name = routing
        self.router = Router(ServeOptions(routing=routing, **options), block_size)
        self.last_hashes: Sequence[bytes] = ()

    def choose(self, token_ids: Sequence[int], workers: FleetLoads) -> str:
        keys = self.router.prompt_keys(token_ids, None, workers)
        order, _ = self.router.choose(keys, workers)
        self.last_hashes = keys.hashes
        return order[0]


class LeastLoaded:
    name = "least_loaded"
    last_hashes: Sequence[bytes] = ()

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def choose(self, token_ids: Sequence[int], workers: FleetLoads) -> str:
        ids = workers.ready_ids()
        a, b = self._rng.sample(ids, 2) if len(ids) > 1 else (ids[0], ids[0])
        at, queued, requests = workers.at, workers.queued, workers.requests
        best = min((a, b), key=lambda w: (queued[at[w]], requests[at[w]]))
        queued[at[best]] += len(token_ids)  # until the next snapshot: the prompt, all queued
        return best


def policy_spec(spec: str) -> tuple[str, dict]:
    """`name[:load factor[:cache sample[:slack[:recompute weight]]]]` (e.g. `cache_aware:2`
    or `cache_aware:::4096`) -> (name, the ServeOptions routing settings given); an empty
    field keeps serving's default."""
    name, factor, sample, slack, weight = (spec.split(":") + ["", "", "", ""])[:5]
    options = {key: kind(value) for key, kind, value in (
        ("route_load_factor", float, factor), ("route_cache_sample", int, sample),
        ("route_cache_slack", int, slack), ("route_recompute_weight", float, weight)) if value}
    return name, options


def make_policy(name: str, block_size: int, seed: int = 0, **router_options) -> Policy:
    """router_options: ServeOptions routing settings (route_load_factor, route_prefix_blocks)."""
    if name in ROUTER_POLICIES:
        return RouterPolicy(name, block_size, **router_options)
    if name == "least_loaded":
        return LeastLoaded(seed)
    raise ValueError(f"unknown routing policy {name!r}; choices: {', '.join(POLICIES)}")
