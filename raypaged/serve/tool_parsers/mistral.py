"""Mistral's tool calls (vLLM's `mistral`, the JSON-list format of Mistral 7B v0.3, Mixtral 8x22B,
Mistral Nemo/Small templates): content, then [TOOL_CALLS] and a JSON list of calls.

    Let me check.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {...}]

[TOOL_CALLS] is a special token: the frontend keeps special tokens in the text of a request
this parser reads (skip_special_tokens off, as vLLM does). A message that begins (after
whitespace) with "[" and then "{" is the call list as well (the marker dropped). A single
object after the marker is one call. Arguments that are a JSON string are taken as they are.
Mistral's tool-call ids are 9 letters and digits (its templates refuse others when the calls
come back in the conversation).
"""
from __future__ import annotations

import random
import string

from raypaged.serve.tool_call_stream import marker_tail
from raypaged.serve.tool_parsers.json_calls import END, OBJECT, SKIP, JsonCallsStream

TOOL_CALLS = "[TOOL_CALLS]"
_ID_CHARS = string.ascii_letters + string.digits


class MistralStream(JsonCallsStream):
    keeps_special_tokens = True  # [TOOL_CALLS] is one (vLLM turns skipping off for it too)

    @staticmethod
    def new_id() -> str:
        return "".join(random.choices(_ID_CHARS, k=9))

    def __init__(self, tool_names=None) -> None:
        super().__init__(tool_names)
        self._list: bool | None = None  # the calls are a list (or one object); None: not seen
        self._content_sent = False

    def start(self, buf: str) -> tuple[int | None, int]:
        at = buf.find(TOOL_CALLS)
        if at >= 0:
            return at, len(TOOL_CALLS)
        body = buf.lstrip()
        if not self._content_sent and body.startswith("["):  # the marker dropped as special
            rest = body[1:].lstrip()
            if rest.startswith("{"):
                return len(buf) - len(body), 0
            if not rest:
                return None, 0  # "[" alone: not decided yet
        n = len(buf) - marker_tail(buf, TOOL_CALLS, True)
        self._content_sent = self._content_sent or bool(buf[:n].strip())
        return None, n

    def between(self, ch: str) -> str:
        if self._list is None:  # the first character after the start
            if ch.isspace():
                return SKIP
            self._list = ch == "["
            if self._list:
                return SKIP
            return OBJECT if ch == "{" else END
        if not self._list and self.scanner.calls:  # a single object is one call
            return END
        return END if ch == "]" else super().between(ch)
