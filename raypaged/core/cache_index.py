"""The fleet's cache views inverted: block key -> which workers hold it, for one walk per prompt.

A router keeps one `CacheView` per worker (cache_summary.py). Asking every view "how many of
this prompt's leading blocks do you hold" costs a set lookup per prompt block per worker: at
1,000 workers that all hold a shared system prompt, tens of thousands of lookups per request.
`CacheIndex` keeps the same views and, maintained from the same deltas, one bitmask per key
(bit i: the i-th view holds it), so the prompt's keys are looked up once for every worker.

A worker's hit is the first key it lacks (exactly CacheView.cached_prefix_blocks). A prefix
cache is nested: a worker holding a prompt's block i holds blocks 0..i-1 too (every hit on block
i touches its ancestors; a freed sequence is evicted tail first). So the holders of key i only
shrink as i grows, and bisection finds where with O(groups x log(prompt blocks)) lookups:

    keys     k0    k1    k2    k3    k4    k5    k6    k7
    holders  111   111   111   011   011   011   011   001     probe k0, k7: differ -> split;
             probe k3 (011): k0..k3 differ -> split; k3..k7 differ -> split; ...
             equal masks at both ends of a span: nobody stops inside it, skip it whole

The one way a worker's view is not nested: two requests computed the same block at once, the
pool kept the first copy (BlockPool.register) and evicted it later while the second request's
later blocks stayed. Bisection may then credit that worker up to a later block it holds: that
request is routed as if more were cached there (speed only; the engine still hits exactly).
"""
from __future__ import annotations

from typing import Sequence

from raypaged.core.cache_summary import CacheView, SummaryDelta


class CacheIndex:
    """Cache views of many workers, with the inverted index of their keys."""

    def __init__(self) -> None:
        self.views: dict[str, IndexedCacheView] = {}  # each knows its bit (its position)
        self.worker_ids: list[str] = []     # bit -> worker id
        self.holders: dict[int, int] = {}   # key -> bitmask of the views holding it

    def view(self, worker_id: str) -> IndexedCacheView:
        """The worker's view (created empty, never synced, on first use)."""
        if worker_id not in self.views:
            self.views[worker_id] = IndexedCacheView(self, len(self.worker_ids))
            self.worker_ids.append(worker_id)
        return self.views[worker_id]

    def hit_groups(self, keys: Sequence[int]) -> list[tuple[int, int]]:
        """[(leading blocks held, bitmask of the views holding exactly that many)], by depth,
        for every view that holds at least the first key; views missing from every group hold
        none. Bisection: exact when every view is nested (see the module docstring)."""
        get = self.holders.get
        if not keys or not (first := get(keys[0], 0)):
            return []
        last = len(keys) - 1
        groups, dropped = [], 0
        spans = [(0, last, first, get(keys[last], 0) & first)]  # holders at lo, at hi
        while spans:  # depth first, left span first: groups come out by depth
            lo, hi, at_lo, at_hi = spans.pop()
            if at_lo == at_hi:
                continue  # (nested) nobody stops between lo and hi
            if hi == lo + 1:
                groups.append((hi, at_lo & ~at_hi))  # they hold keys 0..lo: hi blocks
                dropped |= at_lo & ~at_hi
                continue
            mid = (lo + hi) // 2
            at_mid = get(keys[mid], 0) & at_lo
            spans += ((mid, hi, at_mid, at_hi & at_mid), (lo, mid, at_lo, at_mid))
        # every view of `first` stopped in exactly one span, or holds every key
        if first & ~dropped:
            groups.append((len(keys), first & ~dropped))
        return groups


class IndexedCacheView(CacheView):
    """A CacheView that keeps its index's bitmasks in step with its keys."""

    def __init__(self, index: CacheIndex, position: int) -> None:
        super().__init__()
        self.index, self.position, self.bit = index, position, 1 << position

    def apply(self, delta: SummaryDelta) -> None:
        # remove, then add (as CacheView.apply does: a key in both stays); setting or clearing a
        # bit that already is so changes nothing
        holders, bit = self.index.holders, self.bit
        for key in self.keys - set(delta.added) if delta.full else delta.removed:
            left = holders.get(key, 0) & ~bit
            if left:
                holders[key] = left
            else:
                holders.pop(key, None)
        for key in delta.added:
            holders[key] = holders.get(key, 0) | bit
        super().apply(delta)
