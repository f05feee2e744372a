"""Tool calls: `tools` + `tool_choice` -> a constraint, and the model's text -> `tool_calls`.

    tool_choice "required"   the output is constrained to a JSON list of {"name", "parameters"}
                             (vLLM's schema), one entry per call, names from `tools`
    tool_choice {function}   the output is constrained to that function's parameters schema
    tool_choice "auto"       unconstrained; calls the model writes in the Hermes format
                             (<tool_call>{"name": ..., "arguments": ...}</tool_call>, used by the
                             chat templates of Qwen2.5, Hermes and SmolLM3) become tool_calls
    tool_choice "none"       unconstrained, text only

Streaming (`required`, named): as OpenAI streams, one `delta.tool_calls` entry per call with
its id and name as soon as the name is known, then its `arguments` text in pieces as tokens
arrive (tool_call_stream.py); the last chunk has finish_reason "tool_calls". `auto` holds a
Hermes call's text back until its sample finishes and sends the call whole. Either way a client
that accumulates deltas (the OpenAI SDK) gets the message the non-streamed answer has.
"""
from __future__ import annotations

import json
import re

from raypaged.core.structured_outputs import StructuredOutputsParams
from raypaged.serve.errors import bad_request
from raypaged.serve.responses import Choice
from raypaged.serve.tool_call_stream import CallListScanner, arguments, call_id, header

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_HERMES_OPEN = "<tool_call>"
_NO_PARAMETERS = {"type": "object", "properties": {}}


def tool_mode(tools: list[dict] | None, tool_choice) -> tuple[str, str | None]:
    """("none" | "auto" | "required" | "named", the named function) after checking both fields."""
    names = [t["function"]["name"] for t in tools or ()]
    if tool_choice is None:
        return ("auto" if tools else "none"), None
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise bad_request(f"tool_choice must be 'none', 'auto', 'required' or "
                              f'{{"type": "function", "function": {{"name": ...}}}}, got '
                              f"{tool_choice!r}", "tool_choice")
        if tool_choice != "none" and not tools:
            raise bad_request(f"tool_choice {tool_choice!r} needs tools", "tool_choice")
        return tool_choice, None
    name = (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice, dict) \
        else None
    if tool_choice.get("type") != "function" or not isinstance(name, str):
        raise bad_request('a named tool_choice must be {"type": "function", "function": '
                          '{"name": ...}}', "tool_choice")
    if name not in names:
        raise bad_request(f"tool_choice names function {name!r}, which is not in tools "
                          f"({names})", "tool_choice")
    return "named", name


def tool_constraint(tools: list[dict], mode: str, name: str | None
                    ) -> StructuredOutputsParams | None:
    def params(tool: dict) -> dict:
        return tool["function"].get("parameters") or _NO_PARAMETERS
    if mode == "named":
        return StructuredOutputsParams(json=params(next(
            t for t in tools if t["function"]["name"] == name)))
    if mode == "required":
        return StructuredOutputsParams(json={
            "type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [
                {"properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                "parameters": params(t)},
                 "required": ["name", "parameters"]} for t in tools]}})
    return None


def parse_calls(text: str, mode: str, name: str | None) -> list[dict] | None:
    """OpenAI tool_calls from a finished sample's text, or None when it holds no call."""
    try:
        if mode == "named":
            json.loads(text)
            return [_call(name, text)]
        if mode == "required":
            # the arguments as the model wrote them, as the stream sends them (not re-dumped)
            json.loads(text)
            scanner = CallListScanner()
            scanner.feed(text)
            return [_call(n, a) for n, a in scanner.calls]
        if mode == "auto":
            found = [json.loads(m) for m in _HERMES.findall(text)]
            calls = [_call(c["name"], json.dumps(c.get("arguments", {}), ensure_ascii=False))
                     for c in found if isinstance(c, dict) and isinstance(c.get("name"), str)]
            return calls or None
    except (ValueError, KeyError, TypeError):  # cut short by max_tokens: it stays text
        return None
    return None


def _call(name: str, args: str) -> dict:
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": args}}


class ToolCallChoices:
    """Wraps Shapes.chat_choice for one request with tools: whole messages get `tool_calls`,
    streams hold a call's text back and send it as `delta.tool_calls` when its sample ends."""

    def __init__(self, chat_choice, mode: str, name: str | None):
        self.chat_choice = chat_choice      # Shapes.chat_choice with want_logprobs bound
        self.mode, self.name = mode, name
        self._held: dict[int, str] = {}     # stream: text held back per choice index
        self._content: set[int] = set()     # stream (auto): choices found to be plain text
        self._scanners: dict[int, CallListScanner] = {}  # stream (required), per choice
        self._texts: dict[int, str] = {}    # stream (required, named): the text so far

    def __call__(self, index: int, c: Choice, whole: bool = False) -> dict:
        if whole:
            out = self.chat_choice(index, c, whole=True)
            calls = parse_calls("".join(c.text), self.mode, self.name)
            if calls is not None and c.finish_reason == "stop":
                out["message"] = {"role": "assistant", "content": None, "tool_calls": calls}
                out["finish_reason"] = "tool_calls"
            return out
        if self.mode in ("required", "named"):
            return self._streamed_call(index, c)
        if index in self._content:
            return self.chat_choice(index, c)  # plain content: stream it as it comes
        text = self._held.pop(index, "") + "".join(c.text)
        if not self._may_be_call(text):  # auto, and not a call: what was held goes out now
            self._content.add(index)
            c.text = [text]
            return self.chat_choice(index, c)
        self._held[index] = text
        if c.finish_reason is None:
            return {"index": index, "delta": {}, "logprobs": None, "finish_reason": None}
        calls = parse_calls(text, self.mode, self.name) if c.finish_reason == "stop" else None
        if calls is None:  # not a call after all (or cut short): the held text as content
            c.text = [text]
            return self.chat_choice(index, c)
        delta = {"tool_calls": [{"index": k, **call} for k, call in enumerate(calls)]}
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": "tool_calls",
                "stop_reason": c.stop_reason}

    def _streamed_call(self, index: int, c: Choice) -> dict:
        """The constrained output is the call(s): stream id + name, then arguments pieces."""
        piece = "".join(c.text)
        first = index not in self._texts
        self._texts[index] = text = self._texts.get(index, "") + piece
        if self.mode == "named":
            deltas = [header(0, self.name)] if first else []
            if piece:
                deltas.append(arguments(0, piece))
            if first and piece:  # the first piece rides with the header
                deltas = [{**deltas[0], "function": {"name": self.name, "arguments": piece}}]
        else:
            deltas = self._scanners.setdefault(index, CallListScanner()).feed(piece)
        finish = c.finish_reason
        if finish == "stop" and parse_calls(text, self.mode, self.name) is not None:
            finish = "tool_calls"
        out = {"index": index, "delta": {"tool_calls": deltas} if deltas else {},
               "logprobs": None, "finish_reason": finish}
        if finish is not None:
            out["stop_reason"] = c.stop_reason
        return out

    def _may_be_call(self, text: str) -> bool:
        if self.mode != "auto":
            return True
        start = text.lstrip()
        return start.startswith(_HERMES_OPEN) or _HERMES_OPEN.startswith(start)
