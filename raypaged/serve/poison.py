"""Suspected poison requests: requests whose worker died while serving them, twice.

A request is retried once after its worker dies serving it (the death may have had nothing to
do with it); if the second worker dies too it is refused, and the same request sent again to
this router replica within REMEMBER_S is refused at once, before it reaches a worker: a client
that retries on error (the OpenAI SDK retries 5xx twice) cannot take the fleet down a worker at
a time. "The same request" is the same prompt tokens, sampling parameters and cache salt.
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
    h = hashlib.blake2b(digest_size=16)
    h.update(repr((params, cache_salt)).encode())
    h.update(",".join(map(str, token_ids)).encode())
    return h.digest()


class PoisonMemory:
    def __init__(self, remember_s: float = REMEMBER_S, most: int = REMEMBER_MAX):
        self.remember_s, self.most = remember_s, most
        self._until: collections.OrderedDict[bytes, tuple[float, str]] = collections.OrderedDict()

    def __bool__(self) -> bool:
        return bool(self._until)

    def remember(self, key: bytes, reason: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._until.pop(key, None)
        self._until[key] = (now + self.remember_s, reason)
        while len(self._until) > self.most:
            self._until.popitem(last=False)

    def refused(self, key: bytes, now: float | None = None) -> str | None:
        """Why the request is refused, or None."""
        now = time.monotonic() if now is None else now
        while self._until:  # expired entries first: insertion order is expiry order
            oldest = next(iter(self._until.values()))
            if oldest[0] > now:
                break
            self._until.popitem(last=False)
        entry = self._until.get(key)
        return entry[1] if entry is not None else None
