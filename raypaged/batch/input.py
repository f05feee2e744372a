"""The input file, read once, line by line, never a line longer than the cap held whole.

A line over `max_bytes` is read in 1 MiB pieces that are hashed and dropped: its Line has
raw=None and its size, so the row is refused (413) and still has a digest to resume by. The
digest is what an output line records (output.py) so an edited input line is detected.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import BinaryIO, Iterator

SKIP_CHUNK = 1 << 20  # bytes of an over-long line read at a time while skipping it


@dataclass(frozen=True)
class Line:
    line_no: int        # 1-based
    raw: bytes | None   # without its "\n"; None: longer than the cap, not kept
    digest: int         # 64-bit blake2b of the line's bytes (never 0)
    size: int           # bytes, without the "\n"
    end: int            # byte offset after the line


def digest_of(data: bytes) -> int:
    return _value(hashlib.blake2b(data, digest_size=8))


def _value(h) -> int:
    # 0 means "no line" in the job's tables (compact.py): a zero digest is read as 1
    return int.from_bytes(h.digest(), "big") or 1


def read_lines(f: BinaryIO, max_bytes: int) -> Iterator[Line]:
    line_no = offset = 0
    while chunk := f.readline(max_bytes + 1):
        line_no += 1
        offset += len(chunk)
        # whole: it ends in "\n", or it is the file's last line and within the cap
        if chunk.endswith(b"\n") or len(chunk) <= max_bytes:
            raw = chunk.removesuffix(b"\n")
            yield Line(line_no, raw, digest_of(raw), len(raw), offset)
            continue
        h, size = hashlib.blake2b(chunk, digest_size=8), len(chunk)
        while piece := f.readline(SKIP_CHUNK):
            offset += len(piece)
            body = piece.removesuffix(b"\n")
            h.update(body)
            size += len(body)
            if piece.endswith(b"\n"):
                break
        yield Line(line_no, None, _value(h), size, offset)
