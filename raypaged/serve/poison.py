"""Suspected poison requests: requests whose worker died while serving them, twice.

A request is retried once after its worker dies serving it (the death may have had nothing to
do with it); if the second worker dies too it is refused, and the same request sent again to
this router replica within REMEMBER_S is refused at once, before it reaches a worker: a client
that retries on error (the OpenAI SDK retries 5xx twice) cannot take the fleet down a worker at
a time. "The same request" is the same prompt tokens, sampling parameters and cache salt.

Every router replica shares what it remembers through the controller (`shared` / `learn`, with
each router's metrics push, ray_fleet.py): with R replicas the same request sent to each in turn
would otherwise take up to 2R workers down before every replica had refused it once.
"""
from __future__ import annotations

import collections
import hashlib
import time

REMEMBER_S = 600.0    # how long a suspected poison request stays refused
REMEMBER_MAX = 1024   # how many are kept (the oldest go first)


def fingerprint(token_ids, params, cache_salt: str | None) -> bytes:
    """The request as a worker would run it (SamplingParams is a frozen dataclass: its repr
    names every field)."""
    h = hashlib.blake2b(repr((params, cache_salt)).encode(), digest_size=16)
    h.update(",".join(map(str, token_ids)).encode())
    return h.digest()


class PoisonMemory:
    def __init__(self, remember_s: float = REMEMBER_S, most: int = REMEMBER_MAX):
        self.remember_s, self.most = remember_s, most
        self._until: collections.OrderedDict[bytes, tuple[float, str]] = collections.OrderedDict()

    def __bool__(self) -> bool:
        return bool(self._until)

    def remember(self, key: bytes, reason: str, now: float | None = None) -> None:
        self.learn([(key, reason, self.remember_s)], now)

    def shared(self, now: float | None = None) -> list[tuple[bytes, str, float]]:
        """(key, reason, seconds left) of every request remembered: seconds left, not
        deadlines, because another process's monotonic clock says nothing about ours."""
        now = time.monotonic() if now is None else now
        return [(k, reason, until - now) for k, (until, reason) in self._until.items()
                if until > now]

    def learn(self, entries, now: float | None = None) -> None:
        """Remember what another memory shared (`shared()`'s entries); a key already known
        keeps the later of the two deadlines."""
        now = time.monotonic() if now is None else now
        changed = False
        for key, reason, left in entries:
            until = now + left
            if left > 0 and self._until.get(key, (float("-inf"),))[0] < until:
                self._until[key] = (until, reason)
                changed = True
        if changed:  # keep insertion order = expiry order (refused() relies on it)
            self._until = collections.OrderedDict(sorted(self._until.items(),
                                                         key=lambda item: item[1][0]))
            while len(self._until) > self.most:
                self._until.popitem(last=False)

    def refused(self, key: bytes, now: float | None = None) -> str | None:
        """Why the request is refused, or None."""
        now = time.monotonic() if now is None else now
        # expired entries first: insertion order is expiry order
        while self._until and next(iter(self._until.values()))[0] <= now:
            self._until.popitem(last=False)
        return self._until.get(key, (None, None))[1]
