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

At 1,000 workers the per-worker loops are the cost, so the choice is made in numpy over the
rendezvous order, and when the views belong to one CacheIndex (the router's fleet client and the
simulator keep them so) the hits come from one walk of the prompt's keys over its inverted index
instead of a walk per worker: a bisection of the prompt's keys (CacheIndex.hit_groups,
nested=True), which gives each view's own walk exactly wherever the views are nested, as
prefix caches are (cache_index.py says when they are not).

The snapshot lags the workers by up to a poll plus a refresh (~0.75 s by default): a prefix
cached since then is not yet seen (that request is routed as cold, by its hash), and one evicted
since is still counted (that request gets fewer hits than predicted). Both cost speed only.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from raypaged.core.block_hash import hash_block_tokens
from raypaged.core.cache_summary import CacheView, block_key

CACHED, COLD = "cache_hit", "cold_prefix"


@dataclass(frozen=True)
class WorkerLoad:
    """What a router knows of one worker when it chooses."""

    requests: float           # requests in flight there
    queued_tokens: int = 0    # prompt tokens admitted or waiting there, not yet computed
    cache: CacheView | None = None


def prompt_block_keys(token_ids: Sequence[int], block_size: int,
                      cache_salt: str | None = None) -> list[int]:
    """Keys of the prompt blocks that can be cache hits: full blocks, never the last token
    (the engine computes at least one token of every prompt)."""
    n = (len(token_ids) - 1) // block_size
    return [block_key(h) for h in hash_block_tokens(token_ids, block_size, cache_salt,
                                                    max_blocks=n)]


_REQUESTS, _QUEUED, _CACHE, _INDEX, _POSITION = (
    operator.attrgetter(a) for a in ("requests", "queued_tokens", "cache", "index", "position"))


def rank_by_cost(num_tokens: int, keys: Sequence[int], block_size: int,
                 workers: Mapping[str, WorkerLoad], rendezvous: Sequence[str],
                 concurrency_factor: float,
                 blocks_at: Sequence[int] | None = None) -> tuple[list[str], str]:
    """(workers in the order to try, CACHED or COLD); `rendezvous` orders the same workers.

    `blocks_at[j]`: the leading prompt blocks a view holding the first j of `keys` is known to
    hold (sampled views: `keys` are the prompt's sampled keys; None: every key, blocks_at[j] = j).
    """
    # At 1,000 workers each pass over the workers costs ~20-40 us, so there are few, in C.
    n = len(rendezvous)
    loads = list(map(workers.__getitem__, rendezvous))          # position = rendezvous rank
    requests = np.fromiter(map(_REQUESTS, loads), np.float64, n)
    cap = math.ceil(concurrency_factor * (requests.sum() + 1) / n)
    eligible = requests + 1 <= cap
    if not eligible.any():
        eligible[:] = True
    held = held_keys(keys, list(map(_CACHE, loads)))           # [n], per position
    hits = (held if blocks_at is None else np.asarray(blocks_at, np.int64)[held]) * block_size
    if not hits[eligible].any():
        best = int(np.argmax(eligible))                        # the first eligible
    else:
        cost = num_tokens - hits + np.fromiter(map(_QUEUED, loads), np.int64, n)
        cost[~eligible] = np.iinfo(np.int64).max
        best = int(np.argmin(cost))                            # first minimum: rendezvous ties
    order = list(rendezvous)
    if best:
        order.insert(0, order.pop(best))
    return order, CACHED if hits[best] else COLD


def held_keys(keys: Sequence[int], caches: Sequence[CacheView | None]) -> np.ndarray:
    """Leading `keys` each cache view holds (int64 [len(caches)]), each exactly
    CacheView.cached_prefix_blocks (0 without a view) where the views are nested, as a prefix
    cache's are (cache_index.py)."""
    try:  # views of one CacheIndex: one walk of its inverted index for every worker
        (index,) = set(map(_INDEX, caches))
    except (AttributeError, ValueError):  # a plain view, no view, or views of two indexes
        return np.fromiter((_held(c, keys) for c in caches), np.int64, len(caches))
    by_bit = np.zeros(len(index.worker_ids), np.int64)
    nbytes = (len(index.worker_ids) + 7) // 8
    for depth, mask in index.hit_groups(keys, nested=True):
        bits = np.unpackbits(np.frombuffer(mask.to_bytes(nbytes, "little"), np.uint8),
                             bitorder="little")
        by_bit[np.flatnonzero(bits)] = depth
    return by_bit[np.fromiter(map(_POSITION, caches), np.int64, len(caches))]


def _held(cache: CacheView | None, keys: Sequence[int]) -> int:
    return cache.cached_prefix_blocks(keys) if cache is not None else 0
