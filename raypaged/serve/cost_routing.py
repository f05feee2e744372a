"""Cache-aware routing: send a request where it costs least to serve, counting what is cached.

For each ready worker, from the fleet snapshot (each worker's cache summary and queue):

    hit(w)   = leading prompt blocks w's prefix cache holds x block_size   (CacheView: one set
               lookup per block, thanks to the chain hash)
    cost(w)  = (prompt tokens - hit(w))          the prefill this request would add on w
             + queued_tokens(w)                  prefill already waiting on w (it runs first)

and the request goes to the cheapest worker under the concurrency cap (a worker may hold at most
ceil(factor x (requests in flight + 1) / workers)), ties broken by rendezvous order. A prompt
that no worker holds any block of goes to the first worker of its rendezvous order under the
cap, as `--routing hash` would: cold prefixes spread over the fleet by their hash, and the next
request with the same prefix finds it cached there (or in flight there, before the summary
shows it: same key, same worker). Every replica with the same snapshot makes the same choice.

At 1,000 workers per-worker Python is the cost, so the choice is made in numpy over the
workers' arrays (fleet_loads.py, kept from one snapshot to the next), and when the views belong
to one CacheIndex (the router's fleet client and the simulator keep them so) the hits come from
one walk of the prompt's keys over its inverted index instead of a walk per worker: a bisection of the prompt's keys (CacheIndex.hit_groups,
nested=True), which gives each view's own walk exactly wherever the views are nested, as
prefix caches are (cache_index.py says when they are not).

The snapshot lags the workers by up to a poll plus a refresh (~0.75 s by default): a prefix
cached since then is not yet seen (that request is routed as cold, by its hash), and one evicted
since is still counted (that request gets fewer hits than predicted). Both cost speed only.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from raypaged.core.block_hash import hash_block_tokens
from raypaged.core.cache_summary import CacheView, block_key
from raypaged.serve.fleet_loads import FleetLoads

CACHED, COLD = "cache_hit", "cold_prefix"


def prompt_block_keys(token_ids: Sequence[int], block_size: int,
                      cache_salt: str | None = None) -> list[int]:
    """Keys of the prompt blocks that can be cache hits: full blocks, never the last token
    (the engine computes at least one token of every prompt)."""
    n = (len(token_ids) - 1) // block_size
    return [block_key(h) for h in hash_block_tokens(token_ids, block_size, cache_salt,
                                                    max_blocks=n)]


def cheapest(num_tokens: int, keys: Sequence[int], block_size: int, loads: FleetLoads,
             priority: np.ndarray, concurrency_factor: float,
             blocks_at: Sequence[int] | None = None) -> tuple[int, bool]:
    """(position in `loads` of the cheapest ready worker under the cap, whether its cache holds
    some of the prompt). `priority` (uint64 [W]) is the rendezvous order: ties, and the cold
    choice, go to the highest. A few numpy calls over W: no Python per worker."""
    requests = loads.requests
    if loads.count == len(requests):  # no worker left out: no masks to apply
        cap = math.ceil(concurrency_factor * (requests.sum() + 1) / len(requests))
        eligible = requests + 1 <= cap
    else:
        cap = math.ceil(concurrency_factor * (requests[loads.ready].sum() + 1) / loads.count)
        eligible = loads.ready & (requests + 1 <= cap)
    if not eligible.any():
        eligible = loads.ready
    held = held_keys(keys, loads)
    hits = (held if blocks_at is None else np.asarray(blocks_at, np.int64)[held]) * block_size
    if not hits[eligible].any():
        candidates = np.flatnonzero(eligible)
        return int(candidates[np.argmax(priority[candidates])]), False
    cost = np.where(eligible, num_tokens - hits + loads.queued, np.iinfo(np.int64).max)
    ties = np.flatnonzero(cost == cost.min())
    best = int(ties[np.argmax(priority[ties])]) if ties.size > 1 else int(ties[0])
    return best, bool(hits[best])


def held_keys(keys: Sequence[int], loads: FleetLoads) -> np.ndarray:
    """Leading `keys` each worker's cache view holds (int64 [W], 0 without a view), each
    exactly CacheView.cached_prefix_blocks where the views are nested, as a prefix cache's
    are (cache_index.py): the views of one CacheIndex by one bisection of its inverted index,
    any other view by its own walk."""
    held = np.zeros(len(loads.worker_ids), np.int64)
    if loads.index is not None and keys:
        index = loads.index
        by_bit = np.zeros(len(index.worker_ids) + 1, np.int64)  # [-1]: views not indexed: 0
        nbytes = (len(index.worker_ids) + 7) // 8
        for depth, mask in index.hit_groups(keys, nested=True):
            bits = np.unpackbits(np.frombuffer(mask.to_bytes(nbytes, "little"), np.uint8),
                                 bitorder="little")
            by_bit[np.flatnonzero(bits)] = depth
        held = by_bit[loads.bits]
    for i in loads.walked:
        held[i] = _held(loads.caches[i], keys)
    return held


def _held(cache: CacheView | None, keys: Sequence[int]) -> int:
    return cache.cached_prefix_blocks(keys) if cache is not None else 0
