"""A fixed pool of KV blocks with ref counts and a hash-addressed prefix cache.

Every block with ref_count == 0 sits in one free queue, and the queue's order *is* the LRU
eviction order:

    head (evicted first) <-> ... <-> tail (freed most recently)

A prefix-cache hit on a free block takes it out of the middle in O(1) (an OrderedDict keyed by
block id: a doubly linked list with a map); allocation pops the head, and if that block still
holds a registered prefix, the prefix is evicted (its hash unregistered). Freed blocks are
appended at the tail, a sequence's blocks in reverse order, so the tail of a sequence is
evicted before its head (heads are shared more).

Block counts by state are counters kept by these transitions, never a walk of the pool: the
engine publishes them after every step, and a pool can hold millions of cached blocks.

    used         ref_count > 0
    cached-free  ref_count == 0, holding a registered prefix   (_num_cached_free)
    empty-free   ref_count == 0, no prefix                     (free queue size - the above)
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterable

from raypaged.core.block_hash import BlockHash
from raypaged.core.cache_summary import CacheSummary


class Block:
    __slots__ = ("block_id", "ref_count", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: BlockHash | None = None  # set once the block is full and registered

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_count}, cached={self.block_hash is not None})"


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        assert num_blocks >= 1, "the KV plan (config.py) refuses a budget without one sequence"
        self.blocks = [Block(i) for i in range(num_blocks)]
        # block id -> block, head (evicted first) to tail
        self.free_queue: OrderedDict[int, Block] = OrderedDict(enumerate(self.blocks))
        self.cached: dict[BlockHash, Block] = {}
        self.enable_caching = enable_caching
        self.num_evictions = 0
        self.summary = CacheSummary()  # what `cached` holds, for routers (see cache_summary)
        self._num_cached_free = 0  # free blocks that still hold a registered prefix

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (empty or holding an evictable cached prefix)."""
        return len(self.free_queue)

    def allocate(self, n: int) -> list[Block]:
        if n > self.num_free:
            raise ValueError(f"asked for {n} blocks, {self.num_free} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popitem(last=False)[1]
            if block.block_hash is not None:  # reclaiming a cached prefix: evict it
                del self.cached[block.block_hash]  # register() cached it in this very block
                self.summary.remove(block.block_hash)
                block.block_hash = None
                self._num_cached_free -= 1
                self.num_evictions += 1
            block.ref_count = 1
            out.append(block)
        return out

    def lookup(self, block_hash: BlockHash) -> Block | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on cache hits / shared blocks, reviving free ones out of the queue."""
        for block in blocks:
            if block.ref_count == 0:
                del self.free_queue[block.block_id]
                self._num_cached_free -= block.block_hash is not None
            block.ref_count += 1

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop one reference each; pass blocks in eviction order (a sequence's tail first)."""
        for block in blocks:
            assert block.ref_count > 0, f"double free of {block}"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block.block_id] = block
                self._num_cached_free += block.block_hash is not None

    def register(self, block: Block, block_hash: BlockHash, depth: int = 0) -> None:
        """Make a full block findable by its prefix hash. A prefix already cached in another
        block keeps that block (two requests computed the same prefix at once): first wins.
        `depth`: the block's index in its request (the cache summary samples by it)."""
        if not self.enable_caching or block.block_hash is not None or block_hash in self.cached:
            return
        block.block_hash = block_hash
        self.cached[block_hash] = block
        self.summary.add(block_hash, depth)
        self._num_cached_free += block.ref_count == 0  # callers register blocks they hold; kept exact anyway

    def count_by_state(self) -> tuple[int, int, int]:
        """(used, cached-free, empty-free) block counts, O(1)."""
        free = self.num_free
        return self.num_blocks - free, self._num_cached_free, free - self._num_cached_free
