"""What a job remembers per row, in flat arrays of integers instead of sets and dicts.

A set of a million custom_id strings costs ~100 MB; these cost 4 bytes (AnsweredLines) and 8
bytes (SeenIds) per row, so a million-row job's driver stays within ~12 MB of a small one's
(benchmarks/batch_memory.py measures it).
"""
from __future__ import annotations

import bisect
from array import array
from typing import Iterator

import numpy as np  # for sorting in place; the driver has it loaded anyway (torch, transformers)

from raypaged.batch.input import digest_of

assert array("I").itemsize == 4 and array("Q").itemsize == 8


class AnsweredLines:
    """Input line number -> the low 32 bits of the digest of the line an output line answers
    (0: none), indexed directly: line n is slot n. 32 bits tell an edited line from the line
    that was answered but for a 1 in 4 billion chance per edited line; the output keeps all 64.
    `take` reads and clears a slot, so what is left once the input has been read are output
    lines that answer no line of this input."""

    def __init__(self) -> None:
        self._slots = array("I")
        self.count = 0

    @staticmethod
    def key(digest: int) -> int:
        return (digest & 0xFFFFFFFF) or 1

    def add(self, line_no: int, digest: int) -> bool:
        """False if that line is already answered (a second output line for it)."""
        if line_no >= len(self._slots):
            # frombytes: 4 zero bytes a slot (extend(bytes) would add one slot a byte)
            self._slots.frombytes(bytes(4 * max(line_no + 1 - len(self._slots), len(self._slots))))
        if self._slots[line_no]:
            return False
        self._slots[line_no] = self.key(digest)
        self.count += 1
        return True

    def take(self, line_no: int, digest: int) -> bool | None:
        """None: not answered; True: answered, same line; False: answered, the line changed."""
        if line_no >= len(self._slots) or not self._slots[line_no]:
            return None
        recorded, self._slots[line_no] = self._slots[line_no], 0
        self.count -= 1
        return recorded == self.key(digest)

    def left(self) -> Iterator[int]:
        """Line numbers not taken, in order."""
        return (n for n, d in enumerate(self._slots) if d)


class SeenIds:
    """custom_ids seen so far, as 64-bit digests: a sorted array (8 bytes an id) and a small set
    of the latest, merged into the array every MERGE_EVERY ids. The array grows in place
    (realloc) and is sorted in place, so a merge needs no second copy. Two different ids are
    taken for the same one only if their digests collide: ~n^2 / 2^65, 3e-8 for a million."""

    MERGE_EVERY = 16384  # the set's ~1 MB; a merge re-sorts the array (~10 ms a million ids)

    def __init__(self) -> None:
        self._sorted = array("Q")
        self._recent: set[int] = set()

    def add(self, custom_id: str) -> bool:
        """True if new; False if an earlier row had it."""
        d = digest_of(custom_id.encode("utf-8", "surrogatepass"))
        if d in self._recent:
            return False
        i = bisect.bisect_left(self._sorted, d)
        if i < len(self._sorted) and self._sorted[i] == d:
            return False
        self._recent.add(d)
        if len(self._recent) >= self.MERGE_EVERY:
            self._sorted.extend(self._recent)
            self._recent = set()
            np.frombuffer(self._sorted, dtype=np.uint64).sort()  # a view: sorts the array itself
        return True
