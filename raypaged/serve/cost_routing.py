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

The snapshot lags the workers by up to a poll plus a refresh (~0.75 s by default): a prefix
cached since then is not yet seen (that request is routed as cold, by its hash), and one evicted
since is still counted (that request gets fewer hits than predicted). Both cost speed only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

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


def rank_by_cost(num_tokens: int, keys: Sequence[int], block_size: int,
                 workers: Mapping[str, WorkerLoad], rendezvous: Sequence[str],
                 concurrency_factor: float) -> tuple[list[str], str]:
    """(workers in the order to try, CACHED or COLD); `rendezvous` orders the same workers."""
    cap = math.ceil(concurrency_factor * (sum(w.requests for w in workers.values()) + 1)
                    / len(workers))
    eligible = [w for w in rendezvous if workers[w].requests + 1 <= cap] or list(rendezvous)
    hits = {w: _hit_tokens(workers[w].cache, keys, block_size) for w in eligible}
    if not any(hits.values()):
        best, reason = eligible[0], COLD
    else:
        position = {w: i for i, w in enumerate(rendezvous)}
        best = min(eligible, key=lambda w: (num_tokens - hits[w] + workers[w].queued_tokens,
                                            position[w]))
        reason = CACHED if hits[best] else COLD
    return [best, *(w for w in rendezvous if w != best)], reason


def _hit_tokens(cache: CacheView | None, keys: Sequence[int], block_size: int) -> int:
    return cache.cached_prefix_blocks(keys) * block_size if cache is not None else 0
