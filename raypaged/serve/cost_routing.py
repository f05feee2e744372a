"""Cache-aware routing: send a request where it costs least to serve, counting what is cached,
and keep a prefix where it already lives while that costs little.

For each ready worker, from the fleet snapshot (each worker's cache summary and queue):

    hit(w)   = leading prompt blocks w's prefix cache holds x block_size   (CacheView: one set
               lookup per block, thanks to the chain hash)
    cost(w)  = weight x (prompt tokens - hit(w)) the prefill this request would add on w
             + queued_tokens(w)                  prefill waiting on w (it runs first): the
                                                 snapshot's, plus what this router sent since

The weight (--route-recompute-weight, 1.75) prices a token computed again above one waiting in
a queue: the queue is work the fleet does anyway, a recomputed prefix is work added to it (the
requests behind this one on w wait for it too) and a second copy of the prefix that splits its
later hits. Priced alike, the rule gives each request its first token soonest and, at high
load, passes up hits that the next requests pay for (docs/fleet_sim.md).

Among the workers under the concurrency cap (a worker may hold at most
cap = ceil(factor x (requests in flight + 1) / workers)), the candidates are those within `slack`
tokens of the cheapest; of them the one holding the longest prefix wins, ties to the cheaper,
then to fewer requests in flight, then by rendezvous order. The slack is what a hit is worth
beyond this request: where a prefix lives, its next requests hit too, and a second copy
elsewhere splits them (docs/fleet_sim.md). A prompt that no worker under the cap holds any
block of goes to the first of its rendezvous order under the cap, as `--routing hash` would:
cold prefixes spread over the fleet by their hash, and the next request with the same prefix
finds it cached there (or in flight there, before the summary shows it: same key, same
worker). Every replica with the same snapshot and the same requests sent makes the same choice.

The affinity exception: a worker over the cap (but under twice it) stays a candidate for a
request whose prefix it holds beyond the longest any worker under the cap holds by more than
`slack` tokens. The cap counts requests, not their sizes, so on long multi-turn chats it
binds on ordinary fluctuations and would send a conversation's next turn to be prefilled again
elsewhere. A surplus within the slack (every worker holding the same system prompt) never
lifts the cap, so a shared prefix cannot herd.

The chosen worker is charged with the prefill the choice predicts there (prompt tokens - its
hit) until the next snapshot, so a burst between two snapshots spreads by what it adds: a
request that hits adds its suffix only, so a hot prefix's worker does not look loaded by
tokens it never computes.

The snapshot lags the workers by up to a poll plus a refresh: a prefix cached since is routed
as cold, one evicted since is still counted. Both cost speed only.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from raypaged.core.cache_summary import CacheView
from raypaged.serve.fleet_loads import FleetLoads

CACHED, COLD = "cache_hit", "cold_prefix"


def cheapest(num_tokens: int, keys: Sequence[int], block_size: int, loads: FleetLoads,
             priority, concurrency_factor: float,
             blocks_at: Sequence[int] | None = None, slack: int = 0,
             recompute_weight: float = 1.0) -> tuple[int, int]:
    """(position in `loads` of the chosen ready worker, the prompt tokens its cache holds).
    `priority[positions]` (uint64; an array, or routing.RendezvousWeights) is the rendezvous
    order: ties, and the cold choice, go to the highest."""
    requests = loads.requests
    cap = concurrency_cap(loads, concurrency_factor)
    eligible = requests <= cap - 1
    held_back = (requests <= 2 * cap - 1) ^ eligible  # over the cap, under twice it (cap >= 1)
    if loads.count != len(requests):  # workers left out of this choice
        eligible &= loads.ready
        held_back &= loads.ready
    if not eligible.any():
        eligible = loads.ready
    hits = held_tokens(keys, loads, blocks_at, block_size)
    longest = hits[eligible].max(initial=0)
    if held_back.any():  # the affinity exception (module docstring)
        kept = held_back & (hits > longest + slack)
        if kept.any():
            eligible, longest = eligible | kept, hits[kept].max()
    if not longest:
        candidates = eligible.nonzero()[0]
        return int(candidates[np.argmax(priority[candidates])]), 0
    cost = recompute_weight * (num_tokens - hits) + loads.queued
    candidates = (eligible & (cost <= cost[eligible].min() + slack)).nonzero()[0]
    # the longest hit, then the lowest cost, then the fewest requests in flight
    values = hits[candidates]
    candidates = candidates[values == values.max()]
    for column in (cost, requests):
        if candidates.size == 1:
            break
        values = column[candidates]
        candidates = candidates[values == values.min()]
    best = int(candidates[0] if candidates.size == 1 else
               candidates[np.argmax(priority[candidates])])
    return best, int(hits[best])


def concurrency_cap(loads: FleetLoads, concurrency_factor: float) -> int:
    """The most requests in flight a ready worker may hold with the next one: ceil(factor x
    (requests in flight on the ready workers + 1) / ready workers)."""
    requests = loads.requests
    total = requests.sum() if loads.count == len(requests) else requests[loads.ready].sum()
    return math.ceil(concurrency_factor * (total + 1) / loads.count)


def held_tokens(keys: Sequence[int], loads: FleetLoads, blocks_at: Sequence[int] | None,
                block_size: int) -> np.ndarray:
    """Prompt tokens each worker's cache view is known to hold (int64 [W]): its leading `keys`
    held, as blocks (`blocks_at[j]` for j keys held; None: j), x block_size. The views of one
    CacheIndex by one bisection of its inverted index, any other view by its own walk."""
    blocks = range(len(keys) + 1) if blocks_at is None else blocks_at
    if loads.index is None or not keys:
        held = np.zeros(len(loads.worker_ids), np.int64)
    else:
        index = loads.index
        # one bit more than views: position -1 (a view not in the index) reads a bit never set
        nbytes = (len(index.worker_ids) + 8) // 8
        by_bit = np.zeros(nbytes * 8, np.int64)
        for depth, mask in index.hit_groups(keys):
            bits = np.unpackbits(np.frombuffer(mask.to_bytes(nbytes, "little"), np.uint8),
                                 bitorder="little")
            np.putmask(by_bit, bits, blocks[depth] * block_size)
        held = by_bit[loads.bits]
    for i in loads.walked:
        held[i] = blocks[_held(loads.caches[i], keys)] * block_size
    return held


def _held(cache: CacheView | None, keys: Sequence[int]) -> int:
    return cache.cached_prefix_blocks(keys) if cache is not None else 0
