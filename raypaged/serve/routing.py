"""Which worker serves a request: rendezvous hashing on the prompt's prefix, with a load bound.

The key is the core's chain hash of the prompt's first `prefix_blocks` full blocks (the same
hash the workers' prefix caches use), so requests that share that prefix rank the workers in the
same order and go to the first one, where their blocks already are:

    prompt tokens  | block 0 | block 1 | ... | block d-1 | ...   d = min(prefix_blocks, full blocks)
    key            = hash of block d-1 (it names blocks 0..d-1); no full block: hash of the tokens
    order          = workers sorted by H(key, worker id), highest first (rendezvous / HRW)
    H(key, w)      = splitmix64(first 8 bytes of key XOR salt(w)), salt(w) = 8-byte BLAKE2b of
                     the worker id, computed once per fleet; the W weights: one numpy call

Load bound (consistent hashing with bounded loads, load_factor = 1 + eps): a worker may take the
request only while  load + 1 <= ceil(load_factor * (total load + 1) / workers);  otherwise the
request goes to the next worker in its own order. Same loads, same choice in every router replica.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from raypaged.core.block_hash import BlockHash, hash_block, hash_block_tokens, salt_key
from raypaged.core.cache_summary import block_key, sampled_positions
from raypaged.serve.config import ServeOptions
from raypaged.serve.cost_routing import CACHED, COLD, cheapest, concurrency_cap
from raypaged.serve.fleet_loads import FleetLoads, Ranking, WorkerLoad

AFFINITY, LOAD_BOUND, ROUND_ROBIN = "affinity", "load_bound", "round_robin"


def routing_key(token_ids: Sequence[int], block_size: int, prefix_blocks: int,
                cache_salt: str | None = None) -> BlockHash:
    hashes = hash_block_tokens(token_ids, block_size, cache_salt, max_blocks=prefix_blocks)
    return key_of_chain(hashes, prefix_blocks, token_ids, cache_salt)


def key_of_chain(hashes: Sequence[BlockHash], prefix_blocks: int, token_ids: Sequence[int],
                 cache_salt: str | None) -> BlockHash:
    """The rendezvous key (module docstring) from the prompt's leading chain hashes."""
    d = min(prefix_blocks, len(hashes))
    return hashes[d - 1] if d else hash_block(None, token_ids, salt_key(cache_salt))


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: every input bit moves every output bit (uint64, wrapping)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class RendezvousWeights:
    """The key's rendezvous weight of each worker (by its salt), computed only for the workers
    asked about: a cache_aware choice needs the weights of its tied candidates (and of every
    ready worker only when someone looks past its first choice), not all W; `[:]`: all."""

    def __init__(self, key: BlockHash, salts: np.ndarray) -> None:
        self._key, self._salts = np.uint64(int.from_bytes(key[:8], "little")), salts

    def __getitem__(self, idx) -> np.ndarray:
        return _splitmix64(self._salts[idx] ^ self._key)


@dataclass(frozen=True)
class PromptKeys:
    """What a router needs of a prompt: its hashing, done once, apart from the choice."""

    num_tokens: int
    route_key: BlockHash | None = None            # rendezvous key (hash, cache_aware)
    block_keys: Sequence[int] | None = None       # the cache keys walked (cache_aware)
    blocks_at: Sequence[int] | None = None        # sampled views: blocks proved per key held
    # the chain hashes computed on the way (the prompt's leading full blocks): handed to the
    # worker with the request, whose admission then does not hash them again
    hashes: Sequence[BlockHash] = ()


class Router:
    """Ranks the ready workers for one request; the first is the choice, the rest are fallbacks.
    rank() = choose(prompt_keys()): hashing the prompt is O(prompt tokens) whatever the fleet;
    the choice is what grows with the fleet (benchmarks/router_cost.py times the two apart)."""

    def __init__(self, config: ServeOptions, block_size: int):
        self.config = config
        self.block_size = block_size
        self._turn = itertools.count()

    def rank(self, token_ids: Sequence[int], cache_salt: str | None,
             workers: FleetLoads | Mapping[str, WorkerLoad]) -> tuple[Sequence[str], str]:
        """(workers in the order to try, reason for the first) over the workers given."""
        loads = workers if isinstance(workers, FleetLoads) else FleetLoads.of(workers)
        return self.choose(self.prompt_keys(token_ids, cache_salt, loads), loads)

    def prompt_keys(self, token_ids: Sequence[int], cache_salt: str | None,
                    loads: FleetLoads | None = None) -> PromptKeys:
        """`loads`: the fleet the choice will be made over; with it `cache_aware` hashes the
        prompt only as deep as some worker may hold it (`_cache_hashes`)."""
        if self.config.routing == "round_robin":
            return PromptKeys(len(token_ids))
        if self.config.routing != "cache_aware":
            hashes = hash_block_tokens(token_ids, self.block_size, cache_salt,
                                       max_blocks=self.config.route_prefix_blocks)
            key = key_of_chain(hashes, self.config.route_prefix_blocks, token_ids, cache_salt)
            return PromptKeys(len(token_ids), key, hashes=hashes)
        # One pass of hashing gives both the rendezvous key (block d-1) and the cache keys
        # (full blocks before the last token): the prompt is hashed once per request.
        usable = (len(token_ids) - 1) // self.block_size
        hashes = self._cache_hashes(token_ids, cache_salt, usable, loads)
        key = key_of_chain(hashes, self.config.route_prefix_blocks, token_ids, cache_salt)
        walked = hashes[:usable]
        if (every := self.config.route_cache_sample) == 1:
            return PromptKeys(len(token_ids), key, list(map(block_key, walked)), hashes=hashes)
        # the views hold sampled keys only (cache_summary.sampled): only those are looked up
        positions = sampled_positions(walked, every)
        keys = [block_key(walked[i]) for i in positions]
        return PromptKeys(len(token_ids), key, keys, [0, *(i + 1 for i in positions)], hashes)

    def _cache_hashes(self, token_ids: Sequence[int], cache_salt: str | None, usable: int,
                      loads: FleetLoads | None) -> list[BlockHash]:
        """The prompt's block hashes as deep as a walk of the fleet's views can reach, and at
        least the rendezvous key's blocks.

        Most of a long prompt is usually cached nowhere, and past a depth whose key no view
        holds there is nothing to find: hash 1, 2, 4, 8, ... blocks (continuing the chain) and
        stop at the first depth no view of the fleet's CacheIndex holds. Sampled views always
        publish power-of-two depths (cache_summary.published), so every walk gives what it
        gives on the whole prompt. Views outside one index: hash everything."""
        bs, salt = self.block_size, cache_salt
        if loads is None or loads.index is None or loads.walked:
            return hash_block_tokens(token_ids, bs, salt)
        holders = loads.index.holders
        hashes = hash_block_tokens(token_ids, bs, salt, max_blocks=self.config.route_prefix_blocks)
        depth = 1
        while True:
            depth = min(depth, usable)  # 1, 2, 4, ... and last every usable block
            if len(hashes) < depth:
                parent = hashes[-1] if hashes else None
                hashes += hash_block_tokens(token_ids, bs, salt, max_blocks=depth,
                                            start=len(hashes), parent=parent)
            if depth == usable or not holders.get(block_key(hashes[depth - 1])):
                return hashes  # keys past the miss change no walk
            depth *= 2

    def choose(self, prompt: PromptKeys, loads: FleetLoads) -> tuple[Sequence[str], str]:
        """`loads`: the ready workers as arrays kept across requests (what the Dispatcher and
        the simulator hand over; rank() turns a dict of WorkerLoads into one)."""
        if not loads.count:
            return [], ""
        if self.config.routing == "round_robin":
            ids = loads.ready_ids()
            start = next(self._turn) % len(ids)
            return ids[start:] + ids[:start], ROUND_ROBIN
        weights = RendezvousWeights(prompt.route_key, loads.salts)
        if self.config.routing == "cache_aware":
            best, hit = cheapest(prompt.num_tokens, prompt.block_keys, self.block_size, loads,
                                 weights, self.config.route_load_factor, prompt.blocks_at,
                                 self.config.route_cache_slack,
                                 self.config.route_recompute_weight)
            # charged until the next snapshot: the prefill this request adds there (cost_routing)
            loads.queued[best] += prompt.num_tokens - hit
            return Ranking(loads, weights, best), CACHED if hit else COLD
        every = weights[:]  # the load bound looks at every ready worker's
        best, top = _first_under_bound(loads, every, self.config.route_load_factor)
        return Ranking(loads, every, best), AFFINITY if best == top else LOAD_BOUND


def _first_under_bound(loads: FleetLoads, weights: np.ndarray,
                       load_factor: float) -> tuple[int, int]:
    """(position of the highest-weight ready worker under the load bound, position of the
    highest-weight ready worker); tests/routing_spec.py has the bound per request."""
    requests = loads.requests
    if loads.count == len(requests):  # nobody left out: skip the mask
        top = int(np.argmax(weights))
    else:
        ready = np.flatnonzero(loads.ready)
        top = int(ready[np.argmax(weights[ready])])
    capacity = concurrency_cap(loads, load_factor)
    if requests[top] + 1 <= capacity:  # usually: the key's own worker takes it
        return top, top
    under = np.flatnonzero((requests + 1 <= capacity) & loads.ready)
    if not under.size:  # unreachable (some worker is at or below the mean): the least loaded
        live = np.flatnonzero(loads.ready)
        under = live[requests[live] == requests[live].min()]
    return int(under[np.argmax(weights[under])]), top
