"""Failover: the rules for one request that loses workers while it is served.

A worker lost before the request's first outputs, or mid-stream (its link breaks, it restarts,
or it stops answering: the controller's snapshot no longer counts it ready), is excluded and
the request goes elsewhere (generation.py: the same request again, or a Continuation of what
the client has). After MAX_FAILOVERS lost workers the request ends with a 503.

A worker that dies (or freezes) once the request was sent to it may have been killed by it: it
is retried once; a second worker lost that way refuses it as a suspected poison request (400,
remembered: poison.py), never retried again. That retry waits for a second ready worker rather
than risk the fleet's last one (wait_for_spare), and runs where no other such request runs
(quarantine.py), so that a poison request's second victim takes no innocent request with it.
A worker that left by draining counts for neither. Exclusions are per process: a worker lost
serving the request takes it again as a new process, but only where no other is left.
"""
from __future__ import annotations

import asyncio
import time
from typing import Callable

from raypaged.serve.dispatch import Dispatcher
from raypaged.serve.errors import APIError
from raypaged.serve.fleet import RESTARTING, STARTING, FleetSnapshot
from raypaged.serve.leg import Leg
from raypaged.serve.poison import REMEMBER_S

MAX_FAILOVERS = 2   # workers lost while serving one request before it gives up
RETRIES_AFTER_DEATH = 1  # retries after a worker died with the request on it (poison.py)
WATCH_S = 0.25      # how often a waiting request checks its workers are still in the fleet
SPARE_WAIT_S = 120.0  # wait_for_spare's bound: about a model reload on a loaded machine
NOTICE_S = 2.0  # a worker's death shows in the snapshot within a poll (0.5 s)


class DeadlinePassed(Exception):
    """The request's deadline came while it waited (for outputs, or for a spare worker)."""


class LostWorkers:
    """The workers one request lost, and what losing one more costs it."""

    def __init__(self, d: Dispatcher, fingerprint: Callable[[], bytes],
                 error: Callable[..., APIError]):
        self.d, self._fingerprint, self._error = d, fingerprint, error
        self.excluded: set[str] = set()  # not sent there again: lost, or its queue was full
        self._lost: dict[str, str | None] = {}  # worker -> the incarnation lost serving it
        # of those, the processes it had been sent to, (worker id, incarnation): a worker died
        # (or froze) with the request on it, so its retry is quarantined (quarantine.py)
        self.died_serving: list[tuple[str, str | None]] = []
        self._count = 0

    def readmit_renewed(self, snap: FleetSnapshot) -> bool:
        """Where only workers it lost are left, those back as new processes take it again;
        True if any was readmitted."""
        renewed = {w for w, inc in self._lost.items() if snap.renewed(w, inc)} & self.excluded
        self.excluded -= renewed
        return bool(renewed)

    async def add(self, leg: Leg, reached: bool, deadline: float | None) -> None:
        """Count the loss of `leg`'s worker; raises the 400 (suspected poison) or 503 (too many
        lost) when it is one too many. `reached`: the request may have got to the worker; it
        died serving it unless it was lost by draining (a drained worker leaves the snapshot),
        and then the retry waits for a spare first (wait_for_spare, until `deadline`)."""
        worker_id = leg.worker_id
        died = reached and self.d.fleet.snapshot().worker(worker_id) is not None
        self.excluded.add(worker_id)
        self._lost[worker_id] = leg.incarnation
        self.d.mark_suspect(worker_id, leg.incarnation)
        if died and (worker_id, leg.incarnation) not in self.died_serving:
            self.died_serving.append((worker_id, leg.incarnation))
            if len(self.died_serving) > RETRIES_AFTER_DEATH:  # refused as suspected poison
                workers = " and ".join(w for w, _ in self.died_serving)
                reason = (f"workers {workers} each died or stopped answering while serving this"
                          " request: refused as a suspected poison request and not retried "
                          f"again (the same request is refused for {REMEMBER_S:.0f} s)")
                self.d.poison.remember(self._fingerprint(), reason)
                self.d.metrics.inc("suspected_poison_requests", "refused")
                raise self._error(400, reason, code="suspected_poison_request")
        self._count += 1
        if self._count > MAX_FAILOVERS:
            raise self._error(503, f"{self._count} workers failed while serving this "
                              "request", code="worker_unavailable", retry_after=1)
        self.d.metrics.inc("request_retries")
        if died:
            await wait_for_spare(self.d, leg, deadline)


async def wait_for_spare(d: Dispatcher, lost: Leg, deadline: float | None) -> None:
    """After `lost`'s worker died serving a request: while only one other worker is ready and
    `lost`'s (or another) is restarting or starting, wait until it is ready, up to SPARE_WAIT_S.
    Sent to the last ready worker at once, a poison request would kill it too and leave nobody
    serving for a model reload; this way only the requests that were on the dead worker wait.
    A frozen worker is not waited for (it is restarted only at --worker-unresponsive-timeout-s),
    nor one whose node died (the controller's node_lost: Ray has nowhere to restart it there).
    `deadline` (a stream's, monotonic) ends the wait with DeadlinePassed: not sent anywhere
    again (a whole request's deadline cancels this wait itself)."""
    give_up = time.monotonic() + SPARE_WAIT_S
    noticed_by = time.monotonic() + NOTICE_S
    while True:
        snap = d.fleet.snapshot()
        if snap.renewed(lost.worker_id, lost.incarnation):
            return
        others = [w for w in snap.ready() if w.worker_id != lost.worker_id]
        # still up in the snapshot: the controller has not seen it die yet (a poll or two)
        unnoticed = not lost.is_lost(snap) and time.monotonic() < noticed_by
        coming = unnoticed or any(w.state in (STARTING, RESTARTING) and not w.node_lost
                                  for w in snap.workers)
        if deadline is not None and time.monotonic() >= deadline:
            raise DeadlinePassed()
        if len(others) != 1 or not coming or time.monotonic() >= give_up:
            return
        await asyncio.sleep(WATCH_S)

