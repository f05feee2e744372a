"""rank_by_cost: the cost rule for one request over a dict of WorkerLoads (tests only; the router
keeps its loads as arrays, fleet_loads.py)."""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from raypaged.serve.cost_routing import CACHED, COLD, cheapest
from raypaged.serve.fleet_loads import FleetLoads, Ranking, WorkerLoad


def rank_by_cost(num_tokens: int, keys: Sequence[int], block_size: int,
                 workers: Mapping[str, WorkerLoad], rendezvous: Sequence[str],
                 concurrency_factor: float,
                 blocks_at: Sequence[int] | None = None,
                 slack: int = 0, recompute_weight: float = 1.0) -> tuple[list[str], str]:
    """(workers in the order to try, CACHED or COLD); `rendezvous` orders the same workers.
    The per-request form of `cost_routing.cheapest`, for tests that hold a dict of WorkerLoads.

    `blocks_at[j]`: the leading prompt blocks a view holding the first j of `keys` is known to
    hold (sampled views: `keys` are the prompt's sampled keys; None: every key, blocks_at[j] = j).
    `slack` 0 and `recompute_weight` 1 (the defaults here, not serving's): the cheapest worker,
    every token counted alike, the costs compared exactly.
    """
    loads = FleetLoads.of(workers)
    priority = np.zeros(len(loads.worker_ids), np.uint64)      # earlier in rendezvous: higher
    for rank, worker_id in enumerate(rendezvous):
        priority[loads.at[worker_id]] = len(rendezvous) - rank
    best, hit = cheapest(num_tokens, keys, block_size, loads, priority, concurrency_factor,
                         blocks_at, slack, recompute_weight)
    return list(Ranking(loads, priority, best)), CACHED if hit else COLD
