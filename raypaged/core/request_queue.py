"""RequestQueue: the scheduler's waiting queue, FIFO with O(1) removal from anywhere.

A deque takes O(n) to remove an aborted request from the middle, so a mass disconnect of N
queued requests costs O(N^2) on the step thread. An OrderedDict keyed by request id is a
doubly linked list with a map: append, appendleft, popleft and remove are all O(1); only the
rare insertion at a position (a preempted request going back to its arrival's place) walks it.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterator

from raypaged.core.request import Request


class RequestQueue:
    def __init__(self) -> None:
        self._q: OrderedDict[str, Request] = OrderedDict()

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q.values())

    def __getitem__(self, i: int) -> Request:
        assert i == 0, "only the head is read by position"
        return next(iter(self._q.values()))

    def append(self, req: Request) -> None:
        self._q[req.request_id] = req

    def appendleft(self, req: Request) -> None:
        self._q[req.request_id] = req
        self._q.move_to_end(req.request_id, last=False)

    def popleft(self) -> Request:
        return self._q.popitem(last=False)[1]

    def remove(self, req: Request) -> None:
        del self._q[req.request_id]

    def insert(self, i: int, req: Request) -> None:
        """O(n): every request from position i on moves behind `req`."""
        later = list(self._q)[i:]
        self._q[req.request_id] = req
        for request_id in later:
            self._q.move_to_end(request_id)
