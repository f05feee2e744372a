"""Input lines -> rows: the OpenAI Batch format, or the plain rows Ray Data LLM users write.

    {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {...}}   OpenAI Batch
    {"messages": [...], "temperature": 0, "sampling_params": {"max_tokens": 8}}          plain, chat
    {"prompt": "...", "custom_id": "b", "max_tokens": 8}                                 plain, completion

A plain row becomes the body of the matching endpoint: its fields, with `sampling_params` (Ray
Data LLM's name) merged in; its custom_id is `line-<n>` unless it has one. Bodies are not checked
here: the HTTP frontend checks them, with the HTTP API's own code. What is checked here is only
what the HTTP layer would have checked before the frontend (the JSON itself, with the same
parser, and its size: a line over the cap is a 413, as a body over max_request_bytes is) and
what only a batch line has (custom_id, method, url). Blank lines are skipped.
"""
from __future__ import annotations

import bisect
import dataclasses
import hashlib
from array import array
from dataclasses import dataclass
from typing import BinaryIO, Iterator

import numpy as np  # for sorting in place; the driver has it loaded anyway (torch, transformers)

from raypaged.chat import chat_token_ids
from raypaged.core.block_hash import BlockHash
from raypaged.serve.errors import APIError
from raypaged.serve.json_body import parse_json_body
from raypaged.serve.protocol import ChatCompletionRequest
from raypaged.serve.routing import routing_key

COMPLETIONS_URL = "/v1/completions"
CHAT_URL = "/v1/chat/completions"
URLS = (COMPLETIONS_URL, CHAT_URL)

# The input file, read once, line by line, never a line longer than the cap held whole.
#
# A line over `max_bytes` is read in 1 MiB pieces that are hashed and dropped: its Line has
# raw=None and its size, so the row is refused (413) and still has a digest to resume by. The
# digest is what an output line records (output.py) so an edited input line is detected.
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
    # 0 means "no line" in the job's tables (AnsweredLines): a zero digest is read as 1
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


# A set of a million custom_id strings costs ~100 MB; SeenIds costs 8 bytes a row, so a
# million-row job's driver stays within ~12 MB of a small one's (benchmarks/batch_memory.py).
assert array("Q").itemsize == 8


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


@dataclass(frozen=True)
class Row:
    line_no: int                 # 1-based line of the input file: the row's identity on resume
    custom_id: str | None
    url: str | None = None
    body: dict | None = None
    error: APIError | None = None  # set: the line is refused before it reaches the frontend
    digest: int = 0                # of the line's bytes (read_lines): what resume compares
    end: int = 0                   # byte offset of the input just past the line
    default_id: bool = False       # custom_id is the line-<n> given to a plain row without one


def read_rows(f: BinaryIO, max_line_bytes: int) -> Iterator[Row]:
    """One Row per non-blank line of `f`, in order; a custom_id seen on an earlier line is an
    error; a line over `max_line_bytes` is refused without being read whole."""
    seen = SeenIds()
    for line in read_lines(f, max_line_bytes):
        if line.raw is None:
            row = _refused(line.line_no, None, f"the line is {line.size:,} bytes, over the limit "
                           f"of {max_line_bytes:,}: shorten it, or raise --max-line-bytes",
                           status=413, code="line_too_long")
        elif not line.raw.strip():
            continue
        else:
            row = parse_line(line.line_no, line.raw)
        if row.custom_id is not None and not seen.add(row.custom_id) and row.error is None:
            if row.default_id:  # no id of its own: its default may not pass for another's
                row = _refused(line.line_no, None, f"the line has no custom_id, and its default "
                               f"one, {row.custom_id!r}, is an earlier line's custom_id: give "
                               "this line a custom_id of its own", "custom_id")
            else:
                row = _refused(line.line_no, row.custom_id, f"custom_id {row.custom_id!r} is a "
                               "duplicate of an earlier line's: give every line its own "
                               "custom_id", "custom_id")
        yield dataclasses.replace(row, digest=line.digest, end=line.end)


def parse_line(line_no: int, raw: bytes) -> Row:
    """Bytes, as read: a line that is not UTF-8 is refused like such an HTTP body."""
    try:
        obj = parse_json_body(raw)
    except APIError as exc:
        message = exc.message.replace("the request body", "the line", 1)
        return _refused(line_no, None, message, exc.param, exc.status, exc.code)
    if not isinstance(obj, dict):
        return _refused(line_no, None, f"a line must be a JSON object, got {type(obj).__name__}")
    custom_id = obj.get("custom_id")
    if custom_id is not None and not (isinstance(custom_id, str) and custom_id):
        return _refused(line_no, None, f"custom_id must be a non-empty string, got "
                        f"{custom_id!r}", "custom_id")
    if "body" in obj or "url" in obj or "method" in obj:
        return _openai_line(line_no, obj, custom_id)
    row = _plain_row(line_no, obj, custom_id or f"line-{line_no}")
    return row if custom_id else dataclasses.replace(row, default_id=True)


def _openai_line(line_no: int, obj: dict, custom_id: str | None) -> Row:
    if custom_id is None:
        return _refused(line_no, None, "custom_id is required on an OpenAI batch line",
                        "custom_id")
    if obj.get("method", "POST") != "POST":
        return _refused(line_no, custom_id, f"method must be \"POST\", got {obj.get('method')!r}",
                        "method")
    url = obj.get("url")
    if url not in URLS:
        return _refused(line_no, custom_id, f"url {url!r} is not supported: use one of "
                        f"{list(URLS)}", "url", status=404, code="unknown_url")
    body = obj.get("body")
    if not isinstance(body, dict):
        return _refused(line_no, custom_id, f"body must be a JSON object, got "
                        f"{type(body).__name__}", "body")
    return Row(line_no, custom_id, url, body)


def _plain_row(line_no: int, obj: dict, custom_id: str) -> Row:
    body = {k: v for k, v in obj.items() if k not in ("custom_id", "sampling_params")}
    extra = obj.get("sampling_params", {})
    if not isinstance(extra, dict):
        return _refused(line_no, custom_id, f"sampling_params must be a JSON object, got "
                        f"{type(extra).__name__}", "sampling_params")
    body.update(extra)
    if ("prompt" in body) == ("messages" in body):
        return _refused(line_no, custom_id, "a plain row needs exactly one of \"prompt\" (a "
                        "completion) or \"messages\" (a chat), or the OpenAI batch fields "
                        "custom_id, method, url, body", "prompt")
    return Row(line_no, custom_id, CHAT_URL if "messages" in body else COMPLETIONS_URL, body)


def _refused(line_no: int, custom_id: str | None, message: str, param: str | None = None,
             status: int = 400, code: str = "invalid_request") -> Row:
    """The row refused before the frontend, as the HTTP API would refuse such a body."""
    return Row(line_no, custom_id, error=APIError(status, f"line {line_no}: {message}",
                                                  param=param, code=code))


# Prefix grouping: rows that share a prompt prefix go out together, and to the same engine.
#
# A row's key is the router's (raypaged.serve.routing.routing_key): core's chain hash of its
# prompt's first `prefix_blocks` full blocks, the hash the engines' prefix caches use. Within one
# read-ahead window the rows are reordered group by group (groups in order of first appearance,
# rows of a group in input order); the router then sends each key to the same engine, so the
# second row of a group finds the shared blocks cached instead of evicted by other rows.


class PrefixKeys:
    def __init__(self, tokenizer, block_size: int, prefix_blocks: int):
        self.tokenizer, self.block_size, self.prefix_blocks = tokenizer, block_size, prefix_blocks

    def key(self, row: Row) -> BlockHash | None:
        if row.error is not None:
            return None
        try:
            tokens = self._tokens(row)
        except Exception:  # noqa: BLE001 - a hint only; the frontend refuses the row itself
            return None
        salt = row.body.get("cache_salt")
        return routing_key(tokens, self.block_size, self.prefix_blocks,
                           salt if isinstance(salt, str) else None)

    def _tokens(self, row: Row) -> list[int]:
        if row.url == CHAT_URL:
            req = ChatCompletionRequest.model_validate(row.body)
            return chat_token_ids(self.tokenizer, req.conversation(), req.add_generation_prompt,
                                  req.tool_dicts())
        prompt = row.body["prompt"]
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # several prompts: the first one's prefix
        return list(prompt) if isinstance(prompt, list) else self.tokenizer.encode(prompt)


def group_by_prefix(rows: list[Row], keys: list[BlockHash | None]) -> list[Row]:
    """`rows` reordered group by group, groups in order of first appearance (stable)."""
    first = {k: i for i, k in enumerate(dict.fromkeys(keys))}
    return [rows[i] for i in sorted(range(len(rows)), key=lambda i: first[keys[i]])]  # stable
