"""Llama 3.1-3.3's JSON tool calls (vLLM's `llama3_json`): the whole message is the calls.

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

The message is calls when it begins (after whitespace) with <|python_tag|> or "{" (the tag is a
special token, so usually already gone from the text); otherwise it is plain content, streamed
as it comes. The arguments sit under "parameters" (the template's instruction) or "arguments";
calls are separated by ";". An object is a call only with a declared tool's "name" and one of
those keys: a message that begins with "{" but holds no call (`{"answer": 4}`,
`{"name": "Alice", "age": 30}`) is content, sent when the sample ends.
"""
from __future__ import annotations

from raypaged.serve.tool_parsers.json_calls import JsonCallsStream

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonStream(JsonCallsStream):
    args_keys = ("parameters", "arguments")
    separator = ";"

    def __init__(self, tool_names=None) -> None:
        super().__init__(tool_names)
        self._text = False  # the message began with something else: content throughout

    def start(self, buf: str) -> tuple[int | None, int]:
        if self._text:
            return None, len(buf)
        body = buf.lstrip()
        at = len(buf) - len(body)
        if body.startswith(PYTHON_TAG):
            return at, len(PYTHON_TAG)
        if body.startswith("{"):
            return at, 0
        if not body or PYTHON_TAG.startswith(body):
            return None, 0  # not decided yet: hold it
        self._text = True
        return None, len(buf)
