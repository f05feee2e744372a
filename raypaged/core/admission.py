"""Admission with headroom: admit a request only if the running set's projected growth still fits.

Admitting whatever fits *now* fills the pool with prompts whose decodes then run out of blocks,
and each shortfall preempts someone. Instead, project every sequence forward: it holds `held`
blocks, will hold `now` tokens once its known tokens are computed, then grows one token per step
for `remaining` (d_r) steps and frees its blocks. The candidate is admitted when the peak of that
projection, plus a watermark, fits.

Two upper bounds on the blocks in use T steps ahead, both cheap, both exact when no prefix is
shared; the projection takes the smaller at each T:

    no_frees(T) = used_now + sum over all r of  blocks(now_r + min(T, d_r)) - held_r
                  (nothing is freed; a block shared by several requests counts once)
    alive(T)    = sum over r with d_r >= T of  blocks(now_r + T)
                  (ended sequences free everything; a shared block counts once per holder)

Both rise between end times, so the peak of their minimum is at some T = d_r: sorting by d_r
makes each a prefix sum, O(n log n) per candidate, and a first O(n) check (no_frees at T = oo)
admits without sorting whenever even the no-frees bound fits.
"""
from __future__ import annotations

import bisect
import itertools
import math
from collections import deque
from typing import TYPE_CHECKING, Iterable, NamedTuple

from raypaged.core.request import Request
from raypaged.core.scheduling_policy import SchedulingPolicy

if TYPE_CHECKING:
    from raypaged.core.kv_cache_manager import KVCacheManager


class Growth(NamedTuple):
    """T steps ahead (T <= remaining) a sequence holds the KV of now + T tokens: `now` is its
    known tokens + placeholders less one (the newest is fed by the next step; a prompt still in
    prefill counts whole), and it ends holding now + remaining (its last sample's KV is never
    written)."""
    now: int        # tokens of KV held once its known tokens are computed
    held: int       # blocks in its table now
    remaining: int  # output tokens still to come, projected

    def blocks_to_end(self, block_size: int) -> int:
        """The blocks it still takes before it ends (none if it holds enough already)."""
        return max(0, -(-(self.now + self.remaining) // block_size) - self.held)


def peak_blocks(seqs: Iterable[Growth], used_now: int, block_size: int) -> int:
    """An upper bound on the blocks in use at any future step if nothing else is admitted."""
    bs = block_size
    order = sorted(seqs, key=lambda g: -g.remaining)
    if not order:
        return used_now
    # after[k]: growth to the end of order[k:] (at T = d_k, order[k + 1:] have ended)
    grow = [g.blocks_to_end(bs) for g in reversed(order)]
    after = list(itertools.accumulate(grow))[::-1] + [0]
    # blocks(now + T) = q + qT + [r + rT >= 1] + [r + rT >= bs + 1]  for now = q*bs + r,
    # T = qT*bs + rT: summed over the alive from the sum of q and a histogram of r
    rem_hist = [0] * bs
    peak = sum_q = sum_held = 0
    for k, g in enumerate(order):
        sum_q += g.now // bs
        rem_hist[g.now % bs] += 1
        sum_held += g.held
        if k + 1 < len(order) and order[k + 1].remaining == g.remaining:
            continue  # ties end together: evaluate once, with all of them alive
        n, (qt, rt) = k + 1, divmod(g.remaining, bs)
        alive = sum_q + n * qt + (n if rt else n - rem_hist[0]) + (
            sum(rem_hist[bs + 1 - rt:]) if rt else 0)
        no_frees = used_now + after[k + 1] + alive - sum_held
        peak = max(peak, min(alive, no_frees))
    return peak


class OutputLengths:
    """Output lengths of the last `window` finished sequences: the projection for requests that
    left max_tokens open. A request that has produced `k` tokens is projected at the mean of the
    lengths seen that exceed k, not at the overall mean: the long ones would all outgrow that,
    and each would cost a preemption."""

    def __init__(self, window: int = 1000) -> None:
        self._recent: deque[int] = deque(maxlen=window)
        self._sorted: list[int] = []
        self._suffix: list[int] | None = None  # _suffix[i] = sum(_sorted[i:]), rebuilt lazily

    def record(self, num_output_tokens: int) -> None:
        if len(self._recent) == self._recent.maxlen:
            del self._sorted[bisect.bisect_left(self._sorted, self._recent[0])]
        self._recent.append(num_output_tokens)
        bisect.insort(self._sorted, num_output_tokens)
        self._suffix = None

    def expected(self, produced: int) -> int | None:
        """Mean length of the sequences seen that ran past `produced` tokens (None: none did)."""
        i = bisect.bisect_right(self._sorted, produced)
        if i == len(self._sorted):
            return None
        if self._suffix is None:
            self._suffix = list(itertools.accumulate(reversed(self._sorted)))[::-1] + [0]
        return -(-self._suffix[i] // (len(self._sorted) - i))


def projected_outputs(req: Request, lengths: OutputLengths, block_size: int) -> int:
    """How many output tokens req is expected to end with. A max_tokens the client gave is taken
    at its word; an open one is the expected length given what req has produced, and at least
    one more block than req has (before any request finishes, or once req has outrun every
    length seen, that block is all the projection holds for it)."""
    if req.sampling.max_tokens is not None:
        return req.max_tokens
    produced = req.num_output_tokens + req.num_placeholders
    return min(req.max_tokens,
               max(lengths.expected(produced) or 0, req.num_output_tokens + block_size))


def growth_of(req: Request, held: int, lengths: OutputLengths, block_size: int,
              reserve: float) -> list[Growth]:
    """The projection of req's sequences: one, or n for a request that will fork (each sample
    shares the prompt's blocks and copies the partial last one)."""
    sampled = req.num_output_tokens + req.num_placeholders
    remaining = max(0, projected_outputs(req, lengths, block_size) - sampled)
    remaining = math.ceil(remaining * reserve)  # reserve < 1: a fraction of it, rounded up
    now = req.num_tokens + req.num_placeholders - 1
    seqs = [Growth(now, held, remaining)]
    if not req.forked:
        shared = max(0, -(-now // block_size) - 1)
        seqs += [Growth(now, shared, remaining)] * (req.sampling.n - 1)
    return seqs


def has_headroom(running: list[Request], candidate: Request, kv: "KVCacheManager",
                 lengths: OutputLengths, policy: SchedulingPolicy) -> bool:
    """Whether the running set, with the candidate admitted, stays within the pool (less the
    watermark) as it grows. The candidate holds nothing yet: its prefix hits count as new
    blocks (conservative: a hit on a block in use costs nothing)."""
    bs, pool, tables = kv.block_size, kv.pool, kv.tables
    seqs = [g for r in running for g in growth_of(
        r, len(tables.get(r.request_id, ())), lengths, bs, policy.decode_reserve)]
    seqs += growth_of(candidate, 0, lengths, bs, policy.decode_reserve)
    used = pool.num_blocks - pool.num_free  # cached free blocks count as free: evictable
    limit = pool.num_blocks - int(policy.kv_watermark * pool.num_blocks)
    # first: whether it fits even if nothing ever ends (no need to sort)
    return (used + sum(g.blocks_to_end(bs) for g in seqs) <= limit
            or peak_blocks(seqs, used, bs) <= limit)
