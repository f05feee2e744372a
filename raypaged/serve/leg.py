"""Leg: one request's stream on one worker, serving some of its samples.

A Generation opens a leg on the worker the router chose and, after a failover, more on others.
The leg's outputs come from the worker's link (worker_link.py): its first item resolves
`first`, the rest go to the generation's queue as (leg, items), in order."""
from __future__ import annotations

import asyncio
import dataclasses

from raypaged.serve.fleet import READY, FleetSnapshot
from raypaged.serve.worker_link import WorkerLink


@dataclasses.dataclass(eq=False)
class Leg:
    worker_id: str
    incarnation: str | None          # the worker process it was opened on
    indexes: tuple[int, ...]         # the samples it serves
    resumed: bool                    # a Continuation (its prompt-cache figure is not the prompt's)
    request_id: str = ""             # its id on the worker
    link: WorkerLink | None = None
    first: asyncio.Future | None = None
    closed: bool = False
    blocks: int = 0                  # counted on its worker for routing (Dispatcher.opened)
    quarantined: bool = False        # its request was on a worker that died (quarantine.py)

    def sink(self, queue: asyncio.Queue):
        """The link's sink for this leg: the first item to `first`, the rest to `queue`."""
        self.first = asyncio.get_running_loop().create_future()

        def put(items) -> None:
            if not self.first.done():
                self.first.set_result(items)
            else:
                queue.put_nowait((self, items))
        return put

    def close(self, finished: bool) -> bool:
        """Leave the worker (it cancels the request unless every sample `finished`); False if
        already closed."""
        if self.closed:
            return False
        self.closed = True
        if self.link is not None:
            self.link.leave(self.request_id, cancel=not finished)
        return True

    def is_lost(self, snap: FleetSnapshot) -> bool:
        """The fleet no longer counts the leg's worker as up, or it is a new process."""
        view = snap.worker(self.worker_id)
        return view is None or view.state != READY or (
            self.incarnation is not None and view.stats is not None
            and view.stats.incarnation != self.incarnation)
