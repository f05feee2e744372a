"""The output file: one OpenAI batch output line per input line, appended as rows finish.

    {"id": "batch_req_<input line>", "custom_id": ..., "response": {"status_code", "request_id",
     "body"}, "error": null | {"code", "message"}}

`body` is exactly what the HTTP API answers (the response, or its {"error": ...} body). The id
carries the input line number, so a re-run knows which lines are done without trusting the
order of the file. One writer appends whole lines; a run killed mid-write can leave a torn last
line, which the next run cuts off before appending (no partial lines, no duplicates).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from raypaged.batch.rows import Row
from raypaged.serve.errors import APIError

ID_PREFIX = "batch_req_"


def success_line(row: Row, status: int, body: dict) -> dict:
    return {"id": f"{ID_PREFIX}{row.line_no}", "custom_id": row.custom_id,
            "response": {"status_code": status, "request_id": body.get("id", ""), "body": body},
            "error": None}


def error_line(row: Row, err: APIError) -> dict:
    return {"id": f"{ID_PREFIX}{row.line_no}", "custom_id": row.custom_id,
            "response": {"status_code": err.status, "request_id": f"{ID_PREFIX}{row.line_no}",
                         "body": err.body()},
            "error": {"code": err.body()["error"]["code"], "message": err.message}}


class OutputFile:
    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.done: dict[int, str | None] = {}  # input line number -> custom_id, already written
        self.cut_bytes = 0                     # of a torn last line, removed
        if self.path.exists():
            self._recover()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "ab")

    def _recover(self) -> None:
        good_end = 0
        with open(self.path, "rb") as f:
            for raw in f:
                line_no = _line_number(raw)
                if line_no is None:
                    if f.read(1):  # not the last line: this file is not ours
                        raise ValueError(
                            f"{self.path} has an unreadable line at byte {good_end} that is not "
                            "its last: it was not written by raypaged batch; give a new output "
                            "path")
                    break
                self.done[line_no] = json.loads(raw).get("custom_id")
                good_end += len(raw)
        size = self.path.stat().st_size
        if good_end < size:
            self.cut_bytes = size - good_end
            os.truncate(self.path, good_end)

    def write(self, line: dict) -> None:
        # One write of one whole line, flushed now: a crash loses at most the tail of this line.
        self._file.write((json.dumps(line, ensure_ascii=False) + "\n").encode("utf-8"))
        self._file.flush()

    def sync(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self.sync()
        self._file.close()


def _line_number(raw: bytes) -> int | None:
    """The input line an output line answers; None for a torn or foreign line."""
    if not raw.endswith(b"\n"):
        return None
    try:
        line_id = json.loads(raw)["id"]
        return int(line_id[len(ID_PREFIX):]) if line_id.startswith(ID_PREFIX) else None
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
