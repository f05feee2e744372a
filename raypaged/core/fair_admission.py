"""FairAdmission: which of a router's requests go to the workers now, and in what order the rest
follow: round robin over clients, so that one client's flood costs the others one turn each.

A worker queues first come first served (its scheduler's waiting queue), so once a router has
sent it 400 requests of one client, a small request of another waits behind all of them. The
router therefore sends no more than the fleet's KV cache holds and keeps the rest itself, one
queue per client, where their order can still be chosen:

    admitted   blocks of the requests sent, together (each at its longest: blocks_needed)
    a request is sent at once if nothing waits and it fits: admitted + its blocks <= capacity
    else it waits in its client's queue; as requests finish, the clients take turns: the first
    waiting request of the client whose turn it is goes next, if it fits (else everyone waits
    for more room: a large request is never overtaken for ever), and its client goes to the
    back of the rotation (a client seen for the first time joins at the back)

With nothing admitted, any request is sent (one larger than the whole cache is the worker's to
refuse). `capacity` None: no bound (fairness off; only the per-client cap counts). Every
operation is O(1) but a release, which is O(requests released). Pure: the router (serve/
client_gate.py) wakes the released requests and tells it the capacity from its fleet snapshot.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any


def blocks_needed(num_prompt_tokens: int, max_tokens: int | None, n: int, block_size: int,
                  max_model_len: int) -> int:
    """Blocks a request may hold at its longest: its prompt once (samples share it), and each
    sample's output (max_tokens unset: the rest of max_model_len)."""
    out = max_tokens or max(0, max_model_len - num_prompt_tokens)
    return -(-num_prompt_tokens // block_size) + n * -(-out // block_size)


@dataclass(eq=False)
class Ticket:
    client: str
    blocks: int
    admitted: bool = False
    waker: Any = field(default=None, repr=False)  # the caller's: what it wakes when admitted


class FairAdmission:
    def __init__(self, max_per_client: int = 0):
        self.max_per_client = max_per_client  # 0: no cap
        self.capacity: int | None = None       # blocks the fleet holds; None: no bound
        self.admitted_blocks = 0
        self.num_admitted = 0
        self.in_flight: collections.Counter[str] = collections.Counter()  # waiting + admitted
        # client -> its waiting tickets in arrival order (dicts as ordered sets: O(1) removal);
        # the outer order is the rotation: the first client has the next turn
        self._waiting: dict[str, dict[Ticket, None]] = {}

    def over_cap(self, client: str) -> bool:
        return 0 < self.max_per_client <= self.in_flight[client]

    def arrive(self, client: str, blocks: int) -> Ticket:
        """A new request: admitted at once (ticket.admitted) or queued. The caller checks
        over_cap first: the cap is its to refuse."""
        ticket = Ticket(client, blocks)
        self.in_flight[client] += 1
        if not self._waiting and self._fits(blocks):
            self._admit(ticket)
        else:
            self._waiting.setdefault(client, {})[ticket] = None
        return ticket

    def leave(self, ticket: Ticket) -> list[Ticket]:
        """A request finished, failed or gave up waiting; the tickets this lets in."""
        if ticket.admitted:
            self.admitted_blocks -= ticket.blocks
            self.num_admitted -= 1
        else:
            queue = self._waiting[ticket.client]
            del queue[ticket]
            if not queue:
                del self._waiting[ticket.client]
        self.in_flight[ticket.client] -= 1
        if not self.in_flight[ticket.client]:
            del self.in_flight[ticket.client]
        return self._release()

    def set_capacity(self, capacity: int | None) -> list[Ticket]:
        """The fleet's KV blocks changed (a worker joined or left); the tickets this lets in."""
        self.capacity = capacity
        return self._release()

    def _fits(self, blocks: int) -> bool:
        return (self.capacity is None or not self.num_admitted
                or self.admitted_blocks + blocks <= self.capacity)

    def _admit(self, ticket: Ticket) -> None:
        ticket.admitted = True
        self.admitted_blocks += ticket.blocks
        self.num_admitted += 1

    def _release(self) -> list[Ticket]:
        released = []
        while self._waiting:
            client, queue = next(iter(self._waiting.items()))
            ticket = next(iter(queue))
            if not self._fits(ticket.blocks):
                break
            del queue[ticket]
            del self._waiting[client]
            if queue:  # its turn is used: to the back of the rotation
                self._waiting[client] = queue
            self._admit(ticket)
            released.append(ticket)
        return released
