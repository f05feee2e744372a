"""Reference forms of the router's rules, for tests: the order and the choice a request gets,
written per request over plain lists and dicts (the router computes them for the whole fleet at
once, as arrays: serve/routing.py, serve/fleet_loads.py, serve/cost_routing.py)."""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np

from raypaged.core.block_hash import BlockHash, hash_block_tokens
from raypaged.core.cache_summary import block_key
from raypaged.serve.fleet_loads import fleet_salts
from raypaged.serve.routing import RendezvousWeights


def rendezvous_order(key: BlockHash, worker_ids: Sequence[str]) -> list[str]:
    """The workers by rendezvous weight, highest first."""
    salts, names = fleet_salts(tuple(worker_ids))
    weights = RendezvousWeights(key, salts)[:]
    # ~weights sorts highest first; a stable sort breaks (2^-64-rare) ties by the given order
    return names[np.argsort(~weights, kind="stable")].tolist()


def bounded_choice(order: Sequence[str], loads: Mapping[str, float], load_factor: float) -> int:
    """Index in `order` of the first worker under the load bound."""
    capacity = math.ceil(load_factor * (sum(loads.values()) + 1) / len(order))
    for i, worker_id in enumerate(order):
        if loads.get(worker_id, 0) + 1 <= capacity:
            return i
    raise AssertionError("some worker is at or below the mean")


def prompt_block_keys(token_ids: Sequence[int], block_size: int,
                      cache_salt: str | None = None) -> list[int]:
    """Keys of the prompt blocks that can be cache hits: full blocks, never the last token
    (the engine computes at least one token of every prompt)."""
    n = (len(token_ids) - 1) // block_size
    return [block_key(h) for h in hash_block_tokens(token_ids, block_size, cache_salt,
                                                    max_blocks=n)]
