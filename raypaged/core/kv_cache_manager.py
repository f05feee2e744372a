"""Per-request block tables on top of the BlockPool: prefix hits, growth, fork, copy-on-write.

    block table of a request (block_size = 4):
    positions  0 1 2 3 | 4 5 6 7 | 8 9
    table      [  17   ,   3     ,  42 ]      slot(p) = table[p // 4] * 4 + p % 4
    full blocks 17 and 3 carry a prefix hash once computed; 42 is partial (never cached).
"""
from __future__ import annotations

import itertools
from typing import Sequence

from raypaged.core.block_pool import Block, BlockPool
from raypaged.core.contracts import MemoryStats
from raypaged.core.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.tables: dict[str, list[Block]] = {}
        self.block_ids: dict[str, list[int]] = {}  # mirrors tables; handed to the runner as-is
        self._num_registered: dict[str, int] = {}  # full blocks of the table already hashed in
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) for the runner, this step
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.cow_copies = 0

    def memory_stats(self) -> MemoryStats:
        used, cached, free = self.pool.count_by_state()
        return MemoryStats(
            num_blocks=self.pool.num_blocks, block_size=self.block_size, blocks_used=used,
            blocks_cached=cached, blocks_free=free, prefix_queries=self.prefix_queries,
            prefix_hits=self.prefix_hits, evictions=self.pool.num_evictions,
            cow_copies=self.cow_copies)

    # -- admission ---------------------------------------------------------------------------
    def find_cached_prefix(self, request: Request) -> list[Block]:
        """Longest run of full blocks already cached. Never the whole sequence: at least one
        token must be computed to produce the logits of the next one."""
        request.update_block_hashes(self.block_size)
        max_blocks = (request.num_tokens - 1) // self.block_size
        found = map(self.pool.lookup, request.block_hashes[:max_blocks])
        return list(itertools.takewhile(lambda block: block is not None, found))

    def allocate(self, request: Request, num_new_tokens: int, hits: Sequence[Block] = ()) -> bool:
        """Make room for `num_new_tokens` more tokens (after `hits`, on admission). All or
        nothing: returns False and changes nothing when the pool is short."""
        rid, bs = request.request_id, self.block_size
        have = len(self.tables.get(rid, ())) + len(hits)
        total = request.num_computed_tokens + len(hits) * bs + num_new_tokens
        needed = max(0, -(-total // bs) - have) + self._needs_cow(request)
        reviving = sum(1 for b in hits if b.ref_count == 0)  # hits in the free queue aren't spare
        if needed > self.pool.num_free - reviving:
            return False
        if rid not in self.tables and self.pool.enable_caching:  # admission: count the lookup
            self.prefix_queries += request.num_tokens
            self.prefix_hits += len(hits) * self.block_size
        table = self.tables.setdefault(rid, [])
        ids = self.block_ids.setdefault(rid, [])
        if hits:  # taken out of the free queue before allocate() can evict them
            assert not table, "prefix hits only on admission"
            self.pool.touch(hits)
            self._num_registered[rid] = len(hits)
            request.num_computed_tokens = len(hits) * self.block_size
        if self._needs_cow(request):  # never after hits: they end on a block boundary
            self._copy_on_write(request)
            needed -= 1
        new = [*hits, *self.pool.allocate(needed)]
        table.extend(new)
        ids.extend(b.block_id for b in new)
        return True

    # -- copy-on-write -----------------------------------------------------------------------
    def _needs_cow(self, request: Request) -> int:
        """1 if the next write lands in a partial block shared with another sequence."""
        pos = request.num_computed_tokens
        table = self.tables.get(request.request_id)
        if not table or pos % self.block_size == 0:
            return 0
        return int(table[pos // self.block_size].ref_count > 1)

    def _copy_on_write(self, request: Request) -> None:
        rid = request.request_id
        idx = request.num_computed_tokens // self.block_size
        src = self.tables[rid][idx]
        (dst,) = self.pool.allocate(1)
        self.tables[rid][idx] = dst
        self.block_ids[rid][idx] = dst.block_id
        self.pool.free([src])  # still referenced by the others that share it
        self.pending_copies.append((src.block_id, dst.block_id))
        self.cow_copies += 1

    # -- after a step ------------------------------------------------------------------------
    def cache_full_blocks(self, request: Request, num_written: int) -> None:
        """Register the blocks that this step filled, so later requests can hit them.
        `num_written`: the step's end position. Not num_computed_tokens: with overlapped
        scheduling that counts a step scheduled but not run yet, whose blocks hold nothing
        until it runs (and nothing ever, if it fails)."""
        if not self.pool.enable_caching:
            return
        rid = request.request_id
        table = self.tables[rid]
        num_full = min(num_written, request.num_tokens) // self.block_size
        start = self._num_registered.get(rid, 0)
        if num_full <= start:
            return
        request.update_block_hashes(self.block_size)
        for i in range(start, num_full):
            self.pool.register(table[i], request.block_hashes[i], i)
        self._num_registered[rid] = num_full

    # -- fork / free -------------------------------------------------------------------------
    def fork(self, parent: Request, child: Request) -> None:
        """The child shares every block of the parent, including a partial last one."""
        blocks = self.tables[parent.request_id]
        self.pool.touch(blocks)
        self.tables[child.request_id] = list(blocks)
        self.block_ids[child.request_id] = list(self.block_ids[parent.request_id])
        self._num_registered[child.request_id] = self._num_registered.get(parent.request_id, 0)
        child.block_hashes = list(parent.block_hashes)

    def free(self, request: Request) -> None:
        rid = request.request_id
        blocks = self.tables.pop(rid, [])
        self.block_ids.pop(rid, None)
        self._num_registered.pop(rid, None)
        self.pool.free(reversed(blocks))  # the sequence's tail is evicted before its head
