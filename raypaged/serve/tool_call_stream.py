"""Streamed tool calls as OpenAI streams them: per call, one `delta.tool_calls` entry with its
index, id, type and name (arguments ""), then its `arguments` text in pieces as they arrive.

`tool_choice: "required"` constrains the output to a JSON list (tool_calls.py):

    [ {"name": "get_weather", "parameters": {"city": "Paris"}} , {...} ]
    ^ depth 1 inside the list
      ^ depth 2: a call's keys; its name's value -> the header delta
                                        ^.................^ depth >= 3: the arguments text,
                                                            streamed as it comes

A character scanner follows strings, escapes and nesting; it needs no lookahead, so each piece
of text is handed on in the step it arrives. Arguments seen before their call's name (a key
order the grammar does not produce) wait for the name. A named tool_choice's whole output is
its arguments, so it needs no scanner. tool_choice "auto" reuses it for the Hermes format
and the other model formats (tool_parsers/): each call object is one more entry of a list whose
"[" the parser feeds once, and the arguments sit under "arguments" (or "parameters": Llama).
"""
from __future__ import annotations

import json
import uuid


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def header(index: int, name: str, new_id=call_id) -> dict:
    return {"index": index, "id": new_id(), "type": "function",
            "function": {"name": name, "arguments": ""}}


def arguments(index: int, text: str) -> dict:
    return {"index": index, "function": {"arguments": text}}


class CallListScanner:
    """Feeds on the text of a `required` output; `feed` returns the tool_calls deltas it makes
    complete; `calls` holds (name, raw arguments text) per call for the whole message."""

    def __init__(self, args_keys: tuple[str, ...] = ("parameters",), new_id=call_id) -> None:
        self.args_keys = args_keys      # the call's keys whose value is its arguments
        self.new_id = new_id            # the model family's tool-call id (Mistral's differ)
        self.calls: list[list] = []     # [name | None, arguments text] per call
        self._depth = 0
        self._in_str = self._escape = False
        self._key: str | None = None    # the depth-2 key whose value comes next
        self._expect_key = False
        self._capture: list[str] | None = None  # a depth-2 string being read (key or name)
        self._in_args = False
        self._sent = 0                  # arguments characters of the current call sent

    def feed(self, text: str) -> list[dict]:
        out: list[dict] = []
        for ch in text:
            self.step(ch, out)
        self.pending(out)
        return merged(out)

    @property
    def at_top(self) -> bool:
        """Inside the list, between calls: no call object open, not in a string."""
        return self._depth <= 1 and not self._in_str

    def pending(self, out: list[dict]) -> None:
        """Hand on the current call's arguments text not sent yet (once its name is known)."""
        if self.calls and self.calls[-1][0] is not None:
            k, (_, args) = len(self.calls) - 1, self.calls[-1]
            if len(args) > self._sent:
                out.append(arguments(k, args[self._sent:]))
                self._sent = len(args)

    def step(self, ch: str, out: list[dict]) -> None:
        """One character; the deltas it completes go to `out` (unmerged: see `merged`)."""
        if self._in_args:
            self.calls[-1][1] += ch
        if self._in_str:
            if self._capture is not None:
                self._capture.append(ch)
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == '"':
                self._in_str = False
                if self._capture is not None:
                    self._string_done(json.loads("".join(self._capture)), out)
            return
        if ch == '"':
            self._in_str = True
            if self._depth == 2 and (self._expect_key or self._key == "name"):
                self._capture = [ch]
            return
        if ch in "{[":
            self._depth += 1
            if self._depth == 2 and ch == "{":  # a new call
                self._flush_previous(out)
                self.calls.append([None, ""])
                self._expect_key, self._key = True, None
            elif self._depth == 3 and self._key in self.args_keys:
                self._in_args = True
                self.calls[-1][1] = ch
        elif ch in "}]":
            self._depth -= 1
            if self._in_args and self._depth == 2:
                self._in_args, self._key = False, None
        elif self._depth == 2 and ch == ":":
            self._expect_key = False
        elif self._depth == 2 and ch == ",":
            self._expect_key, self._key = True, None

    def _string_done(self, value: str, out: list[dict]) -> None:
        self._capture = None
        if self._expect_key:
            self._key = value
            return
        if self._key == "name":
            k = len(self.calls) - 1
            self.calls[k][0] = value
            out.append(header(k, value, self.new_id))
            self._sent = 0
            self._key = None

    def _flush_previous(self, out: list[dict]) -> None:
        if self.calls and self.calls[-1][0] is not None:
            k, (_, args) = len(self.calls) - 1, self.calls[-1]
            if len(args) > self._sent:
                out.append(arguments(k, args[self._sent:]))
        self._sent = 0


def merged(deltas: list[dict]) -> list[dict]:
    """Argument pieces as one entry with what came just before them for the same call."""
    out: list[dict] = []
    for d in deltas:
        if out and "id" not in d and out[-1]["index"] == d["index"]:
            out[-1]["function"]["arguments"] += d["function"]["arguments"]
        else:
            out.append(d)
    return out


def marker_tail(buf: str, marker: str, trim: bool) -> int:
    """How many characters at the end of streamed content to hold back: a possible start of
    `marker`, and when `trim`, the whitespace before it (the space before a call is not
    content)."""
    keep = next((k for k in range(min(len(marker) - 1, len(buf)), 0, -1)
                 if marker.startswith(buf[-k:])), 0)
    if trim:
        head = buf[:len(buf) - keep]
        keep += len(head) - len(head.rstrip())
    return keep
