"""Quarantine: where a request goes after a worker died serving it (failover.py).

A request that lost a worker which died (or froze) serving it may be the cause: it is retried
once, and refused as a suspected poison request if its second worker dies too. Had the requests
it shared its first worker with gone on beside it, they would have lost two workers as well and
been refused with it: the rule cannot tell them from the culprit. So a retried request goes to a
worker serving no other retried request, waiting for one up to ALONE_WAIT_S. The cost: after a
death the requests that were beside the culprit run one at a time per worker; one that waited
ALONE_WAIT_S goes beside another and shares its fate if that one is the culprit. Per router
replica (each knows its own requests).
"""
from __future__ import annotations

ALONE_WAIT_S = 30.0  # a retried request's wait for a worker to itself; then it goes beside one


class Quarantine:
    """The workers serving retried requests, and which."""

    def __init__(self) -> None:
        # worker -> the retried requests on it, once per leg there (several when its samples
        # continue there)
        self._held: dict[str, list[str]] = {}

    def free_for(self, worker_id: str, request_id: str) -> bool:
        """No other retried request is on the worker."""
        return not set(self._held.get(worker_id, ())) - {request_id}

    def enter(self, worker_id: str, request_id: str) -> None:
        self._held.setdefault(worker_id, []).append(request_id)

    def leave(self, worker_id: str, request_id: str) -> None:
        held = self._held[worker_id]
        held.remove(request_id)
        if not held:
            del self._held[worker_id]
