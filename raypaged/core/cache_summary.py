"""What a prefix cache holds, published compactly: a versioned set of block keys with deltas.

A worker's BlockPool writes every registration and eviction into a `CacheSummary`; readers (the
controller, and through it each router) keep a `CacheView` and catch up with `delta_since` their
version, so a poll carries only what changed (everything, if the reader fell behind the log).

A key is the first 8 bytes of the block's chain hash: enough to tell prefixes apart for routing
(a collision only misjudges one worker's cache for one prompt), at half the size. Because the
hash is a chain, "block i is cached" names the whole prefix up to i, so the number of leading
prompt blocks a worker holds is the first miss in the prompt's key list.
"""
from __future__ import annotations

import collections
import dataclasses
import sys
import threading
from array import array
from dataclasses import dataclass
from itertools import islice
from typing import Sequence

from raypaged.core.block_hash import BlockHash, little_endian


def block_key(block_hash: BlockHash) -> int:
    return int.from_bytes(block_hash[:8], "little")


@dataclass(frozen=True)
class SummaryDelta:
    version: int                       # the summary's version after applying this
    added: tuple[int, ...] = ()
    removed: tuple[int, ...] = ()
    full: bool = False                 # True: `added` is the whole set (replace, don't apply)
    # each key's depth (block index in its prompt), `added`'s then `removed`'s: what the
    # controller samples by (`sampled`); None once sampled: routers never need them
    depths: tuple[int, ...] | None = None

    def __reduce__(self):
        # packed as uint64, smaller than pickled ints: every router gets every worker's deltas
        depths = None if self.depths is None else little_endian("I", self.depths)
        return _unpack_delta, (self.version, little_endian("Q", self.added),
                               little_endian("Q", self.removed), self.full, depths)


def _unpack(typecode: str, data: bytes) -> tuple[int, ...]:
    packed = array(typecode, data)  # bytes: read as the machine's ints (frombytes)
    if sys.byteorder == "big":  # pragma: no cover - little-endian on the wire
        packed.byteswap()
    return tuple(packed)


def _unpack_delta(version: int, added: bytes, removed: bytes, full: bool,
                  depths: bytes | None = None) -> SummaryDelta:
    return SummaryDelta(version, _unpack("Q", added), _unpack("Q", removed), full,
                        None if depths is None else _unpack("I", depths))


def published(depth: int, every: int) -> bool:
    """Whether a sampled view holds the key of a prompt's block `depth` (0-based): the blocks
    that end a power of two (1, 2, 4, 8, ... blocks) and every `every`-th block,
    so a cached prefix of b blocks is seen as at least max(largest power of two <= b,
    every x floor(b / every)) blocks: short shared prefixes (a system prompt) stay visible,
    and a long one is known to `every` blocks, for ~1/every of the keys plus log2 of them."""
    return every == 1 or (depth + 1) % every == 0 or depth & (depth + 1) == 0


def sampled(delta: SummaryDelta, every: int) -> SummaryDelta:
    """The delta restricted to the keys at published depths, without the depths (what the
    controller mirrors for routers, with every = --route-cache-sample; 1: every key);
    `sampled_positions` says which of a prompt's keys a reader looks up."""
    if every == 1:
        return delta if delta.depths is None else dataclasses.replace(delta, depths=None)
    if delta.depths is None:
        raise ValueError("sampling a cache delta needs its keys' depths (CacheSummary gives them)")
    n = len(delta.added)
    return SummaryDelta(
        delta.version,
        tuple(k for k, d in zip(delta.added, delta.depths) if published(d, every)),
        tuple(k for k, d in zip(delta.removed, delta.depths[n:]) if published(d, every)),
        delta.full)


def sampled_positions(keys: Sequence[int], every: int) -> list[int]:
    """Indexes of the prompt's keys a sampled view can hold (see `published`)."""
    n = len(keys)
    if every == 1:
        return list(range(n))
    # the same set as `published` over range(n), without a Python call per block: a 100k-token
    # prompt has ~6,000 blocks, and a router asks this once per request
    ends = ((1 << k) - 1 for k in range(n.bit_length() + 1))
    return sorted(set(range(every - 1, n, every)).union(d for d in ends if d < n))


class CacheSummary:
    """The writer's side. Thread-safe: a worker's step thread writes while its event loop
    answers the controller's polls. `log_size`: the changes kept for readers to catch up with;
    one who fell further behind gets the whole set."""

    def __init__(self, log_size: int = 65536) -> None:
        self.depth: dict[int, int] = {}  # key -> its block's index in the prompt
        self.keys = self.depth.keys()  # a live view: the keys held, kept by `depth` alone
        self.version = 0
        self._log: collections.deque[tuple[int, bool, int]] = collections.deque(maxlen=log_size)
        self._lock = threading.Lock()

    def add(self, block_hash: BlockHash, depth: int = 0) -> None:
        """`depth`: the block's index in its prompt (what a sampled view samples by)."""
        with self._lock:
            self._change(block_key(block_hash), True, depth)

    def remove(self, block_hash: BlockHash) -> None:
        with self._lock:
            self._change(block_key(block_hash), False)

    def mirror(self, delta: SummaryDelta) -> None:
        """Apply another summary's delta as changes of this one (the controller keeps a mirror
        of each worker's summary and serves routers their own deltas of it)."""
        depth = dict(zip(delta.added, delta.depths or ()))
        with self._lock:  # _change skips what is already so: a full delta adds only the new
            for key in self.keys - set(delta.added) if delta.full else delta.removed:
                self._change(key, False)
            for key in delta.added:
                self._change(key, True, depth.get(key, 0))

    def _change(self, key: int, present: bool, depth: int = 0) -> None:
        if (key in self.keys) == present:
            return
        if present:
            self.depth[key] = depth
        else:
            depth = self.depth.pop(key)
        self.version += 1
        self._log.append((key, present, depth))

    def delta_since(self, version: int, depths: bool = True) -> SummaryDelta:
        """What a reader at `version` needs to reach this version (empty if it is there);
        with the keys' depths unless `depths` is False (a router's delta: it samples nothing)."""
        with self._lock:
            behind = self.version - version
            if behind < 0 or behind > len(self._log):  # unknown or forgotten history: start over
                keys = tuple(self.keys)
                kept = tuple(map(self.depth.__getitem__, keys)) if depths else None
                return SummaryDelta(self.version, keys, full=True, depths=kept)
            first: dict[int, bool] = {}
            final: dict[int, tuple[bool, int]] = {}
            for key, present, depth in reversed(list(islice(reversed(self._log), behind))):
                first.setdefault(key, present)
                final[key] = present, depth
            # A key first added and finally removed within the delta was never in the reader's
            # copy and is not in ours: it nets out.
            added = [(k, d) for k, (p, d) in final.items() if p]
            removed = [(k, d) for k, (p, d) in final.items() if not p and not first[k]]
            return SummaryDelta(self.version, tuple(k for k, _ in added),
                                tuple(k for k, _ in removed),
                                depths=tuple(d for _, d in added + removed) if depths else None)


class CacheView:
    """A reader's copy of one summary."""

    def __init__(self) -> None:
        self.keys: set[int] = set()
        self.version = -1  # never synced: the first delta will be a full one

    def apply(self, delta: SummaryDelta) -> None:
        if delta.full:
            self.keys = set(delta.added)
        else:
            self.keys.difference_update(delta.removed)
            self.keys.update(delta.added)
        self.version = delta.version

    def cached_prefix_blocks(self, keys: Sequence[int]) -> int:
        """How many of the leading blocks (given by their keys, in order) this cache holds."""
        return next((i for i, key in enumerate(keys) if key not in self.keys), len(keys))
