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
its arguments, so it needs no scanner. tool_choice "auto" reuses it for the model formats
(tool_parsers/, CallsStream below). Only the first "name" and the first arguments key of an
object count, so the result cannot depend on how the text was split.
"""
from __future__ import annotations

import json
import uuid


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def call(name: str, args: str, new_id=call_id) -> dict:
    return {"id": new_id(), "type": "function", "function": {"name": name, "arguments": args}}


def arguments(index: int, text: str) -> dict:
    return {"index": index, "function": {"arguments": text}}


class CallListScanner:
    """Feeds on the text of a `required` output; `feed` returns the tool_calls deltas it makes
    complete; `calls` holds [name, raw arguments text] per call for the whole message (the
    last entry's name None: an object that is no call, or not yet)."""

    def __init__(self, args_keys: tuple[str, ...] = ("parameters",), new_id=call_id,
                 names=None, need_args: bool = False) -> None:
        self.args_keys = args_keys      # the call's keys whose value is its arguments
        self.new_id = new_id            # the model family's tool-call id (Mistral's differ)
        # an object is a call once its name is read, one of `names` (None: any), and, when
        # `need_args`, its arguments key too: then its header goes out
        self.names = None if names is None else frozenset(names)
        self.need_args = need_args
        self.calls: list[list] = []     # [name | None (no call, yet), arguments text] per object
        self._depth = 0
        self._in_str = self._escape = False
        self._key: str | None = None    # the depth-2 key whose value comes next
        self._expect_key = False
        self._capture: list[str] | None = None  # a depth-2 string being read (key or name)
        self._in_args = False
        self._sent = 0                  # arguments characters of the current call sent
        self._name: str | None = None   # the current object's name, once read and declared
        self._seen: set[str] = set()    # "name", "args": the current object's keys read so far

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
                self.pending(out)  # the previous call's last arguments
                if self.calls and self.calls[-1][0] is None:
                    self.calls.pop()  # the previous object was no call: indexes count calls
                self.calls.append([None, ""])
                self._expect_key, self._key = True, None
                self._name, self._seen = None, set()
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
            kind = "args" if value in self.args_keys else value
            if kind in self._seen:  # a repeated name or arguments key: the first one counts
                self._key = None
                return
            self._seen.add(kind)
            self._key = value
            if kind == "args":
                self._accept(out)
            return
        if self._key == "name":
            self._key = None
            if self.names is None or value in self.names:
                self._name = value
                self._accept(out)

    def _accept(self, out: list[dict]) -> None:
        """The current object is a call once its name (and, when needed, its arguments key)
        is read: its header goes out, then the arguments read so far (`pending`)."""
        k = len(self.calls) - 1
        if self.calls[k][0] is None and self._name is not None \
                and ("args" in self._seen or not self.need_args):
            self.calls[k][0] = self._name
            out.append({"index": k, **call(self._name, "", self.new_id)})  # the header
            self._sent = 0

    def close_object(self, text: str, out: list[dict]) -> None:
        """The current call's object, `text`, has closed: if its arguments were no object or
        list (so no text was taken), they are its first arguments key's value, a string as it
        is, anything else as JSON ("{}" when absent; "" when `text` is no JSON object)."""
        if not (self.calls and self.calls[-1][0] is not None and not self.calls[-1][1]):
            return
        try:
            pairs = json.loads(text, object_pairs_hook=lambda p: p)  # every key, in order
        except ValueError:
            return
        if isinstance(pairs, list) and text.lstrip().startswith("{"):
            value = next((v for k, v in pairs if k in self.args_keys), {})
            self.calls[-1][1] = value if isinstance(value, str) else json.dumps(
                value, ensure_ascii=False)
            self.pending(out)


class CallsStream:
    """What every tool_choice "auto" parser (tool_parsers/) shares: its scanner, fed the "[" of
    a call list once, each call object one more entry; the model family's call ids; whether its
    marker is a special token the detokenizer must keep (SamplingParams.skip_special_tokens
    off). `feed` each piece of one sample's text, then `finish` once: each returns (content
    text, tool_calls deltas); `calls()` the finished message's calls."""

    new_id = staticmethod(call_id)
    keeps_special_tokens = False
    args_keys: tuple[str, ...] = ("arguments",)
    need_args = False  # an object is a call only with its arguments key too

    def __init__(self, tool_names=None) -> None:
        """`tool_names`: the request's tools (None: any name is a call)."""
        self.scanner = CallListScanner(self.args_keys, self.new_id, tool_names, self.need_args)
        self.scanner.feed("[")
        self._buf = ""                  # text not handed on yet
        self._after = ""                # everything from the calls' start (and the space before)
        self._calling = False           # the calls started: no more content

    def finish(self) -> tuple[str, list[dict]]:
        rest, self._buf = self._buf, ""
        if not self._calling:
            return rest, []
        deltas: list[dict] = []
        self._ended(deltas)
        if self.calls() is not None:
            return "", merged(deltas)
        return self._after + rest, []  # no call after all: all of it is content

    def _ended(self, deltas: list[dict]) -> None:
        """The sample ended after the calls started."""

    def calls(self) -> list[tuple[str, str]] | None:
        """(name, arguments text) per call whose header went out, or None: no call."""
        return [(name, args) for name, args in self.scanner.calls if name is not None] or None


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
    `marker`, and when `trim`, the whitespace before it (not content)."""
    keep = next((k for k in range(min(len(marker) - 1, len(buf)), 0, -1)
                 if marker.startswith(buf[-k:])), 0)
    if trim:
        head = buf[:len(buf) - keep]
        keep += len(head) - len(head.rstrip())
    return keep
