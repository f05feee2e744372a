"""What a prefix cache holds, published compactly: a versioned set of block keys with deltas.

A worker's BlockPool writes every registration and eviction into a `CacheSummary`; readers (the
controller, and through it each router) keep a `CacheView` and catch up with `delta_since` their
version, so a poll carries only what changed:

    BlockPool ──add/remove──> CacheSummary (v=1042, log of the last changes)
                                   │ delta_since(1037): +k9 -k3 +k4 ...  (or everything, if the
                                   v                    reader fell behind the log)
                              CacheView.apply() ──> cached_prefix_blocks(prompt's block keys)

A key is the first 8 bytes of the block's chain hash: enough to tell prefixes apart for routing
(a collision only misjudges one worker's cache for one prompt), at half the size. Because the
hash is a chain, "block i is cached" names the whole prefix up to i, so the number of leading
prompt blocks a worker holds is the first miss in the prompt's key list.
"""
from __future__ import annotations

import collections
import itertools
import sys
import threading
from array import array
from dataclasses import dataclass
from typing import Sequence

from raypaged.core.block_hash import BlockHash

# Changes kept for readers to catch up with; one who fell further behind gets the whole set.
DEFAULT_LOG_SIZE = 65536


def block_key(block_hash: BlockHash) -> int:
    return int.from_bytes(block_hash[:8], "little")


@dataclass(frozen=True)
class SummaryDelta:
    version: int                       # the summary's version after applying this
    added: tuple[int, ...] = ()
    removed: tuple[int, ...] = ()
    full: bool = False                 # True: `added` is the whole set (replace, don't apply)

    def __reduce__(self):
        # Every router receives every worker's deltas: pickled as a tuple of ints a key costs
        # ~10.5 bytes (opcode, length, 8 or 9 bytes); packed as uint64, 8.
        return _unpack_delta, (self.version, _pack(self.added), _pack(self.removed), self.full)


def _pack(keys: Sequence[int]) -> bytes:
    packed = array("Q", keys)
    if sys.byteorder == "big":  # pragma: no cover - little-endian on the wire, like block_hash
        packed.byteswap()
    return packed.tobytes()


def _unpack(data: bytes) -> tuple[int, ...]:
    packed = array("Q")
    packed.frombytes(data)
    if sys.byteorder == "big":  # pragma: no cover
        packed.byteswap()
    return tuple(packed)


def _unpack_delta(version: int, added: bytes, removed: bytes, full: bool) -> SummaryDelta:
    return SummaryDelta(version, _unpack(added), _unpack(removed), full)


def sampled(delta: SummaryDelta, every: int) -> SummaryDelta:
    """The delta restricted to keys with key % every == 0 (every = 1: unchanged).

    What a router sees when the fleet publishes a hash sample of each cache: the chain hash
    makes a sampled key name its whole prefix, and keys are uniform, so ~1 key in `every`
    survives, spread along every prompt. See `sampled_positions` for how a reader uses them."""
    if every == 1:
        return delta
    return SummaryDelta(delta.version, tuple(k for k in delta.added if k % every == 0),
                        tuple(k for k in delta.removed if k % every == 0), delta.full)


def sampled_positions(keys: Sequence[int], every: int) -> list[int]:
    """Indexes of the prompt's keys a sampled view can hold:

        keys       k0  k1  k2  k3  k4  k5  k6        (k2, k5 have key % every == 0)
        positions          2           5
        a view holding k2 and k5 holds >= 6 leading blocks; holding k2 only: >= 3 blocks
    """
    return [i for i, k in enumerate(keys) if k % every == 0]


class CacheSummary:
    """The writer's side. Thread-safe: a worker's step thread writes while its event loop
    answers the controller's polls."""

    def __init__(self, log_size: int = DEFAULT_LOG_SIZE) -> None:
        self.keys: set[int] = set()
        self.version = 0
        self._log: collections.deque[tuple[int, bool]] = collections.deque(maxlen=log_size)
        self._lock = threading.Lock()

    def add(self, block_hash: BlockHash) -> None:
        with self._lock:
            self._change(block_key(block_hash), True)

    def remove(self, block_hash: BlockHash) -> None:
        with self._lock:
            self._change(block_key(block_hash), False)

    def mirror(self, delta: SummaryDelta) -> None:
        """Apply another summary's delta as changes of this one (the controller keeps a mirror
        of each worker's summary and serves routers their own deltas of it)."""
        with self._lock:
            if delta.full:
                new = set(delta.added)
                for key in self.keys - new:
                    self._change(key, False)
                added = new - self.keys
            else:
                for key in delta.removed:
                    self._change(key, False)
                added = delta.added
            for key in added:
                self._change(key, True)

    def _change(self, key: int, present: bool) -> None:
        if (key in self.keys) == present:
            return
        (self.keys.add if present else self.keys.discard)(key)
        self.version += 1
        self._log.append((key, present))

    def delta_since(self, version: int) -> SummaryDelta:
        """What a reader at `version` needs to reach this version (empty if it is there)."""
        with self._lock:
            return self._delta_since(version)

    def _delta_since(self, version: int) -> SummaryDelta:
        behind = self.version - version
        if behind < 0 or behind > len(self._log):  # unknown or forgotten history: start over
            return SummaryDelta(self.version, tuple(self.keys), full=True)
        first: dict[int, bool] = {}
        final: dict[int, bool] = {}
        for key, present in reversed(list(itertools.islice(reversed(self._log), behind))):
            first.setdefault(key, present)
            final[key] = present
        # A key first added and finally removed within the delta was never in the reader's
        # copy and is not in ours: it nets out.
        return SummaryDelta(self.version, tuple(k for k, p in final.items() if p),
                            tuple(k for k, p in final.items() if not p and not first[k]))


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
        for i, key in enumerate(keys):
            if key not in self.keys:
                return i
        return len(keys)
