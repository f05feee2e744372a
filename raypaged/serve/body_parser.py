"""Large request bodies parsed in child processes, so that no parse holds the router's GIL
(json.loads holds it for its whole run, the element check after it more: docs/limits.md).

A child parses, checks (json_body.parse_json_body) and runs the route's own limit check
(serve/limits.py) on what it parsed: a refused body crosses back as a few bytes, never as its
parsed value; one that passes crosses back pickled (cheaper to load than its JSON), holding only
the top-level fields the route's request model knows (unpickling the others would cost the
router's loop for nothing). A child that dies, cannot be started or does not answer within
`timeout_s` (stopped, hung) is killed and this body parsed in the router instead, slower, never
wrong; the next body starts a fresh child.

Protocol on the child's stdin / stdout: 8-byte little-endian length, then a pickle;
in: (body, precheck or None, field names or None); out: ("ok", value) or
("refused", (status, message, param, code)).
"""
from __future__ import annotations

import asyncio
import logging
import pickle
import struct
import sys

from raypaged.serve.errors import APIError
from raypaged.serve.json_body import parse_json_body

logger = logging.getLogger(__name__)

HEADER = struct.Struct("<Q")

# How long a child may take to answer one body: an 8 MiB body (the default max_request_bytes)
# takes ~1.4 s on a loaded core, so a child 10 s late is stopped or hung, and waiting on it
# would hold its slot (and queue every large body behind it) for ever.
CHILD_TIMEOUT_S = 10.0


class BodyParsers:
    """`processes` children, started on the first large body; each parses one body at a time.
    A body no child answers is parsed in a thread here, one at a time: the event loop then
    waits behind one such parse (holding the GIL) at most, not behind several in turn."""

    def __init__(self, threshold: int, processes: int = 2,
                 timeout_s: float = CHILD_TIMEOUT_S) -> None:
        self.threshold, self.processes, self.timeout_s = threshold, processes, timeout_s
        self._one = asyncio.Semaphore(1)  # the parses in this process (binds at first use)
        self._idle: asyncio.Queue | None = None  # children free to take a body (None: start one)

    async def parse(self, body: bytes, precheck=None,
                    fields: frozenset[str] | None = None) -> object:
        """The parsed, checked body. A large dict body gets `precheck(value)` in the child
        (picklable: the route's RequestLimits check, which the frontend runs again), and only
        its top-level keys in `fields` (the route's request model's; None: all) cross back."""
        if len(body) <= self.threshold:  # on the loop: cheaper than a trip to a child
            return parse_json_body(body)
        # shielded: a client gone mid-parse must not leave a child half-way through a reply
        return await asyncio.shield(self._in_child(body, precheck, fields))

    async def _in_child(self, body: bytes, precheck, fields) -> object:
        if self._idle is None:
            self._idle = asyncio.Queue()
            for _ in range(self.processes):
                self._idle.put_nowait(None)
        child = await self._idle.get()
        answered = False
        try:
            if child is None or child.returncode is not None:
                child = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "raypaged.serve.body_parser",
                    stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
            # the write bounded too: a stopped child's pipe fills and drain() waits
            async with asyncio.timeout(self.timeout_s):
                kind, value = await _exchange(child, (body, precheck, fields))
            answered = True
        except (OSError, EOFError, asyncio.IncompleteReadError, pickle.PickleError,
                TimeoutError) as exc:
            failure = exc
        finally:
            if not answered:  # failed, timed out or cancelled mid-exchange: never reused
                if child is not None and child.returncode is None:
                    child.kill()
                child = None
            self._idle.put_nowait(child)
        if not answered:
            logger.warning("body parser child failed (%r): parsing in the router instead",
                           failure)
            async with self._one:  # precheck: run by the frontend after
                return await asyncio.to_thread(parse_json_body, body)
        if kind == "refused":
            raise APIError(*value)
        return value


def model_fields(model) -> frozenset[str]:
    """The top-level keys a pydantic request model reads: its fields' names and aliases."""
    return frozenset(key for name, field in model.model_fields.items()
                     for key in (name, field.alias) if key)


async def _exchange(child, request: tuple) -> tuple:
    payload = pickle.dumps(request, protocol=5)
    child.stdin.write(HEADER.pack(len(payload)))
    child.stdin.write(payload)
    await child.stdin.drain()
    size, = HEADER.unpack(await child.stdout.readexactly(HEADER.size))
    return pickle.loads(await child.stdout.readexactly(size))


def _serve(stdin, stdout) -> None:
    """The child: parse bodies until the router closes the pipe (it exited or was killed)."""
    while header := stdin.read(HEADER.size):
        size, = HEADER.unpack(header)
        body, precheck, fields = pickle.loads(stdin.read(size))
        try:
            out = ("ok", _parsed(body, precheck, fields))
        except APIError as exc:
            out = ("refused", (exc.status, exc.message, exc.param, exc.code))
        data = pickle.dumps(out, protocol=5)
        del body, out  # before the next body is read: one parsed body held at a time
        stdout.writelines((HEADER.pack(len(data)), data))
        stdout.flush()


def _parsed(body: bytes, precheck, fields) -> object:
    value = parse_json_body(body)
    if isinstance(value, dict):
        if precheck is not None:
            precheck(value)
        if fields is not None:  # the model ignores the others: they need not cross back
            value = {k: v for k, v in value.items() if k in fields}
    return value


if __name__ == "__main__":
    _serve(sys.stdin.buffer, sys.stdout.buffer)
