"""The output file: one OpenAI batch output line per input line, appended as rows finish.

    {"id": "batch_req_<input line>_<digest>", "custom_id": ..., "response": {"status_code",
     "request_id", "body"}, "error": null | {"code", "message"}}

`body` is exactly what the HTTP API answers (the response, or its {"error": ...} body). The id
names the input line and the 64-bit digest of its bytes (rows.py, 16 hex digits), so a re-run
knows which lines are done, and whether the line it answered is still the same, without
trusting the order of the file or holding the answers.

What a crash can lose, and what it cannot do:
- one writer (an exclusive flock on `<output>.lock`: a second job on the same output refuses
  to start) appends each line with one write() and flushes it: a killed process loses no line
  it wrote, and leaves at most one torn last line, which the next run cuts off before appending;
- fsync every `fsync_interval_s`, and at the end: a machine crash or power loss loses at most
  the lines of that last interval (whole lines: a torn tail is cut as above) - rows that the
  next run simply answers again.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from array import array
from pathlib import Path
from typing import Iterator

from raypaged.batch.rows import Row
from raypaged.serve.errors import APIError
from raypaged.serve.responses import json_line

ID_PREFIX = "batch_req_"


class OutputBusy(ValueError):
    """Another job holds the output's lock."""


class OutputWriteFailed(Exception):
    """The output stopped taking lines mid-run (a full disk, a quota, an I/O error): the lines
    written before are whole, a torn last one is cut by the next run, which answers the rest."""


def line_id(row: Row) -> str:
    return f"{ID_PREFIX}{row.line_no}_{row.digest:016x}"


def success_line(row: Row, status: int, body: dict) -> dict:
    return {"id": line_id(row), "custom_id": row.custom_id,
            "response": {"status_code": status, "request_id": body.get("id", ""), "body": body},
            "error": None}


def error_line(row: Row, err: APIError) -> dict:
    return {"id": line_id(row), "custom_id": row.custom_id,
            "response": {"status_code": err.status, "request_id": line_id(row),
                         "body": err.body()},
            "error": {"code": err.body()["error"]["code"], "message": err.message}}


def lock_path(path: Path) -> Path:
    return path.with_name(path.name + ".lock")


# What the job remembers per row is kept in flat arrays of integers, not sets and dicts:
# AnsweredLines costs 4 bytes a row (rows.py's SeenIds 8), so a million-row job's driver
# stays within ~12 MB of a small one's (benchmarks/batch_memory.py measures it).
assert array("I").itemsize == 4


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


class OutputFile:
    """Locked for this process from construction to close(); `answered` holds what earlier runs
    wrote (input line -> digest)."""

    def __init__(self, path: str | os.PathLike, fsync_interval_s: float = 5.0):
        self.path = Path(path)
        self.fsync_interval_s = fsync_interval_s
        self.answered = AnsweredLines()
        self.cut_bytes = 0  # of a torn last line, removed
        self.broken = False  # a write failed: nothing more goes in (OutputWriteFailed)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = _take_lock(self.path)
        try:
            if self.path.exists():
                self._recover()
            self._file = open(self.path, "ab")
        except BaseException:
            self._lock.close()
            raise
        self._synced_at = time.monotonic()

    def _recover(self) -> None:
        good_end = 0
        with open(self.path, "rb") as f:
            for raw in f:
                answer = _parse_id(raw)
                if answer is None:
                    if f.read(1):  # not the last line: this file is not ours
                        raise ValueError(
                            f"{self.path} has an unreadable line at byte {good_end} that is not "
                            "its last: it was not written by this version of raypaged batch; "
                            "give a new output path")
                    break
                if not self.answered.add(*answer):
                    raise ValueError(f"{self.path} answers input line {answer[0]} twice: it "
                                     "was not written by raypaged batch; give a new output path")
                good_end += len(raw)
        size = self.path.stat().st_size
        if good_end < size:
            self.cut_bytes = size - good_end
            with open(self.path, "r+b") as f:
                f.truncate(good_end)
                os.fsync(f.fileno())

    def write(self, line: dict) -> None:
        # One write of one whole line, flushed now: a crash loses at most the tail of this line.
        if self.broken:  # a line after a torn one would leave the torn one mid-file
            raise OutputWriteFailed(f"the output {self.path} failed an earlier write")
        try:
            self._file.write((json_line(line) + "\n").encode("utf-8"))
            self._file.flush()
        except OSError as e:
            raise self._failed(e) from None
        if time.monotonic() - self._synced_at >= self.fsync_interval_s:
            self.sync()

    def sync(self) -> None:
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
        except OSError as e:
            raise self._failed(e) from None
        self._synced_at = time.monotonic()

    def _failed(self, e: OSError) -> OutputWriteFailed:
        self.broken = True
        return OutputWriteFailed(f"cannot write the output {self.path}: {e.strerror}")

    def close(self) -> None:
        try:
            if not self.broken:
                self.sync()
        finally:
            # after a failed write, closing flushes the bytes the buffer kept: they fail again,
            # or, if room was made, complete the torn line (either way it stays the last)
            with contextlib.suppress(OSError):
                self._file.close()
            self._lock.close()  # releases the flock


def _take_lock(path: Path):
    """An exclusive flock on a lock file beside the output (not on the output itself, which a
    crash may leave to be truncated). The lock goes with the process however it ends; the file
    stays, holding the pid of the last job that wrote the output."""
    lock = open(lock_path(path), "a+")
    try:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "?"
        lock.close()
        raise OutputBusy(f"{path} is being written by another raypaged batch job (pid {holder}, "
                         f"lock {lock_path(path)}): wait for it to finish, or give another "
                         "output path") from None
    lock.truncate(0)
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    return lock


def _parse_id(raw: bytes) -> tuple[int, int] | None:
    """(input line, digest) an output line answers; None for a torn or foreign line."""
    if not raw.endswith(b"\n"):
        return None
    try:
        line_id = json.loads(raw)["id"]
        line_no, digest = line_id[len(ID_PREFIX):].split("_")
        if not line_id.startswith(ID_PREFIX) or len(digest) != 16:
            return None
        return int(line_no), int(digest, 16)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
