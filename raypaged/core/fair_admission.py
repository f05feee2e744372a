"""FairAdmission: which of a router's requests go to the workers now, and in what order the rest
follow: round robin over clients, and a fair share of the KV cache for each, so that one
client's flood costs the others (almost) nothing.

A worker queues first come first served (its scheduler's waiting queue), so once a router has
sent it 400 requests of one client, a small request of another waits behind all of them. The
router therefore sends no more than the fleet's KV cache holds and keeps the rest itself, one
queue per client, where their order can still be chosen:

    admitted   blocks of the requests sent, together (each at its longest: blocks_needed)
    share      capacity // clients with requests here (waiting or admitted)
    a request is sent when it fits (admitted + its blocks <= capacity) and no request that does
    not fit waits ahead of it, or when its client's admitted blocks with it stay within its
    share (the cache may then be overcommitted: by at most one share per client, as a client
    over its share gets nothing more until it is back under); either way its client holds no
    more than 7/8 of the capacity (RESERVE_FOR_OTHERS), unless it is its only request
    else it waits in its client's queue; as requests finish, the clients take turns: the first
    waiting request of the client whose turn it is goes next if it may, and its client goes to
    the back of the rotation (a client seen for the first time joins at the back)

The share lets a newcomer go at once while a flood that came first holds the cache. With
nothing admitted, any request is sent (one larger than the cache is the worker's to refuse).
`capacity` None: no bound (fairness off; only the per-client cap counts). Pure: the router
(serve/client_gate.py) wakes the released requests and tells it the capacity.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any


# 1/8 of the cache is kept from any one client (but for its first request), so that a newcomer
# starts at once; a lone client loses 1/8 of the worst-case room (most of it is free in practice).
RESERVE_FOR_OTHERS = 8


def blocks_needed(num_prompt_tokens: int, max_tokens: int | None, n: int, block_size: int,
                  max_model_len: int, open_output: int | None = None) -> int:
    """Blocks a request may hold: its prompt once (samples share it), and each sample's output.
    max_tokens unset: `open_output` tokens (as core/admission.py OutputLengths projects them),
    at most the rest of max_model_len; None: the rest of max_model_len."""
    rest = max(0, max_model_len - num_prompt_tokens)
    out = max_tokens or (rest if open_output is None else min(rest, open_output))
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
        self.blocks_of: collections.Counter[str] = collections.Counter()  # admitted, per client
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
        if self._may_go(ticket, by_room=not self._waiting):
            self._admit(ticket)
        else:
            self._waiting.setdefault(client, {})[ticket] = None
        return ticket

    def leave(self, ticket: Ticket) -> list[Ticket]:
        """A request finished, failed or gave up waiting; the tickets this lets in."""
        client = ticket.client
        if ticket.admitted:
            self.admitted_blocks -= ticket.blocks
            self.num_admitted -= 1
            self.blocks_of[client] -= ticket.blocks
            if not self.blocks_of[client]:
                del self.blocks_of[client]
        else:
            queue = self._waiting[client]
            del queue[ticket]
            if not queue:
                del self._waiting[client]
        self.in_flight[client] -= 1
        if not self.in_flight[client]:
            del self.in_flight[client]
        return self._release()

    def set_capacity(self, capacity: int | None) -> list[Ticket]:
        """The fleet's KV blocks changed (a worker joined or left); the tickets this lets in."""
        self.capacity = capacity
        return self._release()

    def _may_go(self, ticket: Ticket, by_room: bool) -> bool:
        """Whether the ticket may be admitted now, by room or by share (the module's rules);
        `by_room`: nothing that does not fit waits ahead of it."""
        cap = self.capacity
        if cap is None or (by_room and not self.num_admitted):
            return True
        held = self.blocks_of[ticket.client]
        fits = by_room and self.admitted_blocks + ticket.blocks <= cap
        in_share = held + ticket.blocks <= cap // len(self.in_flight)
        own_limit = not held or held + ticket.blocks <= cap - cap // RESERVE_FOR_OTHERS
        return (fits or in_share) and own_limit

    def _admit(self, ticket: Ticket) -> None:
        ticket.admitted = True
        self.admitted_blocks += ticket.blocks
        self.num_admitted += 1
        self.blocks_of[ticket.client] += ticket.blocks

    def _release(self) -> list[Ticket]:
        """Clients in turn, each its first waiting request, until none may go: one that does not
        fit stops those behind it from going by room (never overtaken for ever), not by share.
        O(clients) per request released."""
        released = []
        while True:
            blocked = False
            for client, queue in self._waiting.items():
                ticket = next(iter(queue))
                if self._may_go(ticket, by_room=not blocked):
                    break
                blocked = True
            else:
                return released
            del queue[ticket]
            del self._waiting[client]
            if queue:  # its turn is used: to the back of the rotation
                self._waiting[client] = queue
            self._admit(ticket)
            released.append(ticket)
