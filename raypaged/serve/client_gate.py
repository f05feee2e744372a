"""ClientGate: a router replica's per-client cap and fair admission (core/fair_admission.py).

The client is the address the request came from (the ASGI scope's client host: through Ray
Serve's proxy, the proxy passes on the connection's peer; through the HAProxy `raypaged serve`
starts, the X-Forwarded-For that HAProxy sets, see haproxy_local.py). Not a field of the request
body (OpenAI's `user`) nor a header a client sets: a flood could name a new client on every
request and escape its cap, or name another client's and take its turns. With one API key,
every client holds the same key, so the key tells nobody apart. Behind a proxy of your own (an
HAProxy or load balancer raypaged did not configure) every request comes from its address: one
client for all (docs/limits.md).

Each Generation (one prompt of a request) takes a ticket before it is routed and gives it back
when it closes: the cap counts prompts, waiting or running, per client on this replica.
"""
from __future__ import annotations

import asyncio
import contextvars
from typing import Callable

from raypaged.core.admission import OutputLengths
from raypaged.core.fair_admission import FairAdmission, Ticket, blocks_needed
from raypaged.serve.errors import APIError
from raypaged.serve.fleet import FleetSnapshot
from raypaged.serve.ingress import haproxy_forwards_client
from raypaged.serve.metrics import RequestMetrics

# The client of the request being served: set by the HTTP layer (http_app.py) where the
# connection is known, read by each Generation it starts (tasks copy the context they start in).
CLIENT: contextvars.ContextVar[str] = contextvars.ContextVar("raypaged_client", default="")

CLIENT_CAP = "client_cap"  # shed_requests' reason for a 429 of the cap


LOOPBACK = ("127.", "::1")


def client_of(scope: dict, forwarded: bool | None = None) -> str:
    """The request's client: its peer, or, from the loopback when our HAProxy is in front
    (`forwarded`; default: this process's cluster says so), the address HAProxy forwarded (it
    drops the client's own X-Forwarded-For and sets one, so the header holds one address)."""
    client = scope.get("client")
    peer = client[0] if client else ""
    if forwarded is None:
        forwarded = haproxy_forwards_client()
    if forwarded and peer.startswith(LOOPBACK):
        values = [v for name, v in scope.get("headers", ()) if name == b"x-forwarded-for"]
        if values:  # HAProxy appends its own: the last
            return values[-1].decode("latin-1").rsplit(",", 1)[-1].strip()
    return peer


class ClientGate:
    def __init__(self, max_per_client: int, fair: bool,
                 snapshot: Callable[[], FleetSnapshot], metrics: RequestMetrics):
        self.admission = FairAdmission(max_per_client)
        self.fair = fair
        self._snapshot, self.metrics = snapshot, metrics
        self._seen: FleetSnapshot | None = None
        self._block_size, self._max_model_len = 16, 0  # from the first snapshot with stats
        self._loop: asyncio.AbstractEventLoop | None = None  # the router's, from enter()
        # what finished outputs here came to: a request that leaves max_tokens open counts at
        # their mean, as a worker's admission projects it, not at the rest of max_model_len
        # (which would hold a client without max_tokens to ~max_model_len-long requests' worth)
        self.output_lengths = OutputLengths()
        # prompt tokens of the prompts waiting here for their turn: demand no worker's queue
        # shows yet, which the autoscaler adds to the workers' (serve/autoscaler.py)
        self.held_tokens = 0

    def check(self, client: str) -> None:
        """429 if the client has its cap in flight here: before the body is read (http_app) and
        again as each prompt enters (requests that arrive together pass the first together)."""
        if not self.admission.over_cap(client):
            return
        self.metrics.inc("shed_requests", CLIENT_CAP)
        cap = self.admission.max_per_client
        raise APIError(429, f"too many requests in flight from this client ({cap}, the most "
                            "one client may have on this server): wait for one to finish, or "
                            "raise the server's setting max_requests_per_client "
                            "(--max-requests-per-client; 0: no cap)",
                       code="rate_limit_exceeded", retry_after=1)

    def blocks(self, num_prompt_tokens: int, max_tokens: int | None, n: int) -> int:
        """KV blocks a request of n samples may hold (fair_admission.blocks_needed); one
        without max_tokens counts at the mean output length seen, at least a block (before any
        request has finished, as core/admission.py does)."""
        open_output = max(self.output_lengths.expected(0) or 0, self._block_size)
        return blocks_needed(num_prompt_tokens, max_tokens, n, self._block_size,
                             self._max_model_len, open_output)

    async def enter(self, client: str, num_prompt_tokens: int, max_tokens: int | None,
                    n: int) -> Ticket:
        """This prompt's ticket, once it may go to a worker (waiting its client's turn)."""
        self.check(client)
        self._loop = asyncio.get_running_loop()
        self._refresh()
        ticket = self.admission.arrive(client, self.blocks(num_prompt_tokens, max_tokens, n))
        if ticket.admitted:
            return ticket
        ticket.waker = self._loop.create_future()
        self.held_tokens += num_prompt_tokens
        try:
            await ticket.waker
        except BaseException:  # the deadline or a departed client: give the place up
            self.leave(ticket)
            raise
        finally:
            self.held_tokens -= num_prompt_tokens
        return ticket

    def finished(self, output_lengths: list[int]) -> None:
        """A request's samples ended by themselves (not aborted): their lengths."""
        for length in output_lengths:
            self.output_lengths.record(length)

    def leave(self, ticket: Ticket) -> None:
        self._wake(self.admission.leave(ticket))
        self._refresh()  # a worker that joined since the last arrival lets the waiting in too

    def leave_later(self, ticket: Ticket) -> None:
        """leave(), from a finalizer: the garbage collector may run it in any thread, or on the
        loop's in the middle of leave(); so on the loop, at its next turn."""
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.leave, ticket)

    def _refresh(self) -> None:
        """The capacity: every ready worker's KV blocks, as of the latest snapshot."""
        snap = self._snapshot()
        if snap is self._seen:
            return
        self._seen = snap
        stats = [w.stats for w in snap.ready() if w.stats is not None]
        if stats:
            self._block_size, self._max_model_len = stats[0].block_size, stats[0].max_model_len
        capacity = sum(s.budget.num_blocks for s in stats) if self.fair and stats else None
        if capacity != self.admission.capacity:
            self._wake(self.admission.set_capacity(capacity))

    @staticmethod
    def _wake(tickets: list[Ticket]) -> None:
        for t in tickets:
            if t.waker is not None and not t.waker.done():
                t.waker.set_result(None)
