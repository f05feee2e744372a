"""The workers a router chooses among, kept as arrays from one snapshot to the next.

With 1,000 workers per-worker Python would be most of a choice, so `FleetLoads` holds what
`WorkerLoad` says of each worker as numpy arrays in sorted worker-id order, built once per
snapshot (Dispatcher.candidates, the simulator's Fleet) and updated in place as this router
opens and closes requests:

    position  0        1        2       ...  W-1      sorted worker ids
    requests  3        0        5                     in flight (mutable: this router's +1/-1)
    queued    0        812      0                     prompt tokens queued, as of the snapshot
    caches    view     None     view                  prefix-cache views; `bits`: each one's
    bits      7        -1       0                     position in their one CacheIndex (-1: none)
    salts     ...                                     rendezvous salt (routing.py)
    ready     True     True     False                 False: left out of this choice (a retry)
"""
from __future__ import annotations

import copy
import functools
import hashlib
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import numpy as np

from raypaged.core.cache_index import IndexedCacheView
from raypaged.core.cache_summary import CacheView


@dataclass(frozen=True)
class WorkerLoad:
    """What a router knows of one worker when it chooses (the per-worker form of FleetLoads)."""

    requests: float           # requests in flight there
    queued_tokens: int = 0    # prompt tokens admitted or waiting there, not yet computed
    cache: CacheView | None = None


@functools.lru_cache(maxsize=16)
def fleet_salts(worker_ids: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(rendezvous salt per worker as uint64, the ids as an object array), once per fleet."""
    salts = np.array([int.from_bytes(hashlib.blake2b(w.encode(), digest_size=8).digest(),
                                     "little") for w in worker_ids], dtype=np.uint64)
    return salts, np.array(worker_ids, dtype=object)


class FleetLoads:
    def __init__(self, worker_ids: Sequence[str], requests: Sequence[float],
                 queued: Sequence[int] | None = None,
                 caches: Sequence[CacheView | None] | None = None) -> None:
        self.worker_ids = tuple(worker_ids)
        if list(self.worker_ids) != sorted(self.worker_ids):
            raise ValueError("FleetLoads wants its workers in sorted id order")
        n = len(self.worker_ids)
        self.at = {w: i for i, w in enumerate(self.worker_ids)}
        self.requests = np.array(requests, np.float64).reshape(n)
        self.queued = np.zeros(n, np.int64) if queued is None else np.array(queued, np.int64)
        self.caches: list[CacheView | None] = [None] * n if caches is None else list(caches)
        self.salts, self.names = fleet_salts(self.worker_ids)
        self.ready = np.ones(n, bool)
        self.count = n                                   # ready workers
        # Views of one CacheIndex answer every worker's hit in one bisection of the prompt's
        # keys (cost_routing.held_tokens); any other view is walked on its own.
        indexes = {c.index for c in self.caches if isinstance(c, IndexedCacheView)}
        self.index = indexes.pop() if len(indexes) == 1 else None
        self.bits = np.array([c.position if self.index is not None and isinstance(
            c, IndexedCacheView) else -1 for c in self.caches], np.int64).reshape(n)
        self.walked = [i for i, c in enumerate(self.caches) if c is not None and self.bits[i] < 0]

    @classmethod
    def of(cls, workers: Mapping[str, WorkerLoad]) -> FleetLoads:
        ids = sorted(workers)
        loads = [workers[w] for w in ids]
        return cls(ids, [x.requests for x in loads], [x.queued_tokens for x in loads],
                   [x.cache for x in loads])

    def excluding(self, worker_ids: Iterable[str]) -> FleetLoads:
        """This fleet without these workers, for one choice. The arrays are shared, so opens
        and closes still land in this object's `requests`; only `ready` is the copy's own."""
        out = copy.copy(self)
        out.ready = self.ready.copy()
        out.ready[[self.at[w] for w in worker_ids if w in self.at]] = False
        out.count = int(out.ready.sum())
        return out

    def __len__(self) -> int:
        return self.count

    def ready_ids(self) -> list[str]:
        if self.count == len(self.worker_ids):
            return list(self.worker_ids)
        return self.names[self.ready].tolist()

    def opened(self, worker_id: str, n: int = 1) -> None:
        """n more requests in flight there (a worker not in this snapshot: nothing to count)."""
        i = self.at.get(worker_id)
        if i is not None:
            self.requests[i] += n


class Ranking(Sequence[str]):
    """The ready workers in the order to try: `first`, then the others by priority (the
    rendezvous weights), highest first. A request needs the rest only when its first choice
    refuses it, so their sort waits until someone looks past the first."""

    def __init__(self, loads: FleetLoads, priority, first: int) -> None:
        # priority[positions]: rendezvous weights (an array, or routing.RendezvousWeights)
        self._loads, self._priority, self._at = loads, priority, first
        self._first = loads.worker_ids[first]
        self._all: list[str] | None = None

    def _list(self) -> list[str]:
        if self._all is None:
            ready = np.flatnonzero(self._loads.ready)
            order = ready[np.argsort(~self._priority[ready], kind="stable")]  # ~: highest first
            order = np.concatenate(([self._at], order[order != self._at]))
            self._all = self._loads.names[order].tolist()
        return self._all

    def __getitem__(self, i):
        return self._first if i == 0 else self._list()[i]

    def __len__(self) -> int:
        return self._loads.count

    def __iter__(self):
        yield self._first
        yield from self._list()[1:]

    def __eq__(self, other) -> bool:
        if isinstance(other, (list, tuple, Ranking)):
            return list(self) == list(other)
        return NotImplemented

    def __repr__(self) -> str:
        return repr(self._list())
