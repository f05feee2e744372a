"""Tool calls: `tools` + `tool_choice` -> a constraint, and the model's text -> `tool_calls`.

    tool_choice "required"   the output is constrained to a JSON list of {"name", "parameters"}
                             (vLLM's schema), one entry per call, names from `tools`
    tool_choice {function}   the output is constrained to that function's parameters schema
    tool_choice "auto"       unconstrained; calls the model writes in its family's format
                             (tool_parsers/: hermes, llama3_json, mistral) become tool_calls
    tool_choice "none"       unconstrained, text only

Streamed as OpenAI streams them (tool_call_stream.py; for `auto`, tool_parsers/: text before the
calls start is `delta.content`); the last chunk has finish_reason "tool_calls". A client that
accumulates deltas (the OpenAI SDK) gets the message the non-streamed answer has.
"""
from __future__ import annotations

import json
from collections import defaultdict

from raypaged.core.structured_outputs import StructuredOutputsParams
from raypaged.serve.config import ServeOptions
from raypaged.serve.errors import bad_request
from raypaged.serve.responses import Choice
from raypaged.serve.tool_call_stream import CallListScanner, arguments, call, call_id
from raypaged.serve.tool_parsers import PARSERS, parse_whole

_NO_PARAMETERS = {"type": "object", "properties": {}}
MAX_TOOL_CALLS = ServeOptions.max_tool_calls  # the setting's default


def tool_mode(names: list[str], tool_choice) -> tuple[str, str | None]:
    """("none" | "auto" | "required" | "named", the named function) after checking tool_choice
    against the names of the request's tools."""
    if tool_choice is None:
        return ("auto" if names else "none"), None
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise bad_request(f"tool_choice must be 'none', 'auto', 'required' or "
                              f'{{"type": "function", "function": {{"name": ...}}}}, got '
                              f"{tool_choice!r}", "tool_choice")
        if tool_choice != "none" and not names:
            raise bad_request(f"tool_choice {tool_choice!r} needs tools", "tool_choice")
        return tool_choice, None
    function = tool_choice.get("function")  # tool_choice: a dict (the request model types it)
    name = function.get("name") if isinstance(function, dict) else None
    if tool_choice.get("type") != "function" or not isinstance(name, str):
        raise bad_request('a named tool_choice must be {"type": "function", "function": '
                          '{"name": ...}}', "tool_choice")
    if name not in names:
        raise bad_request(f"tool_choice names function {name!r}, which is not in tools "
                          f"({names})", "tool_choice")
    return "named", name


def with_tools(req, chunk, parser: str, max_calls: int):
    """A chat request's tools, before it is queued: (its chunk maker, wrapped in
    ToolCallChoices unless tool_choice is "none"; the constraint a forced tool_choice decodes
    under, or None)."""
    tools = req.tool_dicts()
    names = [t["function"]["name"] for t in tools or ()]
    mode, name = tool_mode(names, req.tool_choice)
    forced = tool_constraint(tools, mode, name, req.parallel_tool_calls, max_calls)
    if forced is not None and req.constraint() is not None:
        raise bad_request(f"tool_choice {req.tool_choice!r} constrains the output itself: "
                          "leave out response_format / structured_outputs", "tool_choice")
    if mode == "none":
        return chunk, forced
    if mode == "auto" and PARSERS[parser].keeps_special_tokens:
        req.skip_special_tokens = False
    return ToolCallChoices(chunk, mode, name, parser, names), forced


def tool_constraint(tools: list[dict], mode: str, name: str | None, parallel: bool = True,
                    max_calls: int = MAX_TOOL_CALLS) -> StructuredOutputsParams | None:
    """The schema a forced tool choice decodes under: a named function's parameters, or for
    "required" a list of at most `max_calls` calls (1 unless `parallel`, OpenAI's
    parallel_tool_calls). Why the bound: sampled, a small model extends the list with
    near-identical calls until max_tokens cuts the JSON; maxItems makes the list end (and the
    list keeps its free whitespace: docs/structured_outputs.md)."""
    def params(tool: dict) -> dict:
        return tool["function"].get("parameters") or _NO_PARAMETERS
    if mode == "named":
        return StructuredOutputsParams(json=params(next(
            t for t in tools if t["function"]["name"] == name)))
    if mode == "required":
        defs: dict = {}
        items = [{"properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                 "parameters": _hoisted(params(t), k, defs)},
                  "required": ["name", "parameters"]} for k, t in enumerate(tools)]
        schema = {"type": "array", "minItems": 1, "maxItems": max_calls if parallel else 1,
                  "items": {"type": "object", "anyOf": items}}
        return StructuredOutputsParams(json={**schema, "$defs": defs} if defs else schema)
    return None


def _hoisted(schema: dict, k: int, defs: dict) -> dict:
    """A tool's parameters without their `$defs` (or `definitions`), which go to `defs`, the
    root of the call list's schema, where their "#/$defs/..." references point (pydantic puts
    nested models and enums there: OpenAI's pydantic_function_tool). A name another tool
    already defines differently becomes "t{k}_name", its references rewritten."""
    renames: dict[str, str] = {}
    for key in ("$defs", "definitions"):
        for def_name, body in (schema.get(key) or {}).items():
            new = def_name if defs.get(def_name, body) == body else f"t{k}_{def_name}"
            renames[f"#/{key}/{def_name}"] = f"#/$defs/{new}"
            defs[new] = body
    if not renames:
        return schema
    own = {key: v for key, v in schema.items() if key not in ("$defs", "definitions")}
    for new in {r.rsplit("/", 1)[1] for r in renames.values()}:
        defs[new] = _renamed(defs[new], renames)
    return _renamed(own, renames)


def _renamed(node, renames: dict[str, str]):
    if isinstance(node, dict):
        return {key: (renames.get(v, v) if key == "$ref" and isinstance(v, str)
                      else _renamed(v, renames)) for key, v in node.items()}
    if isinstance(node, list):
        return [_renamed(v, renames) for v in node]
    return node


def parse_calls(text: str, mode: str, name: str | None, new_id=call_id) -> list[dict] | None:
    """OpenAI tool_calls from a forced ("required", "named") sample's finished text, or None
    when it holds no call."""
    try:
        json.loads(text)
    except ValueError:  # cut short by max_tokens: it stays text
        return None
    if mode == "named":
        return [call(name, text, new_id)]
    # the arguments as the model wrote them, as the stream sends them (not re-dumped)
    scanner = CallListScanner()
    scanner.feed(text)
    return [call(n, a, new_id) for n, a in scanner.calls]


class ToolCallChoices:
    """Wraps Shapes.chat_choice for one request with tools: whole messages get `tool_calls`,
    streams send `delta.tool_calls` as the calls' text arrives."""

    def __init__(self, chat_choice, mode: str, name: str | None, parser: str = "hermes",
                 tool_names=None):
        self.chat_choice = chat_choice      # Shapes.chat_choice with want_logprobs bound
        self.mode, self.name = mode, name
        self.parser = parser                # the model family's format (tool_parsers/)
        self.tool_names = tool_names        # the request's tools: (auto) only these are calls
        # its call ids, in every mode: Mistral's templates refuse any but 9 letters and digits
        # when the calls come back in the conversation
        self.new_id = PARSERS[parser].new_id
        # per choice: its stream (auto), its scanner (required)
        self._auto = defaultdict(lambda: PARSERS[parser](tool_names))
        self._scanners = defaultdict(lambda: CallListScanner(new_id=self.new_id))
        self._texts: dict[int, str] = {}    # stream (required, named): the text so far

    def __call__(self, index: int, c: Choice, whole: bool = False) -> dict:
        if whole:
            out = self.chat_choice(index, c, whole=True)
            text = "".join(c.text)
            if self.mode == "auto":
                content, found = parse_whole(self.parser, text, self.tool_names)
                calls = None if found is None else [call(n, a, self.new_id) for n, a in found]
            else:
                content, calls = None, parse_calls(text, self.mode, self.name, self.new_id)
            # auto: calls cut short (finish_reason "length") are calls, as the stream sent them
            if calls is not None and (self.mode == "auto" or c.finish_reason == "stop"):
                out["message"] = {"role": "assistant", "content": content, "tool_calls": calls}
                if c.finish_reason == "stop":
                    out["finish_reason"] = "tool_calls"
            return out
        if self.mode in ("required", "named"):
            return self._streamed_call(index, c)
        return self._streamed_auto(index, c)

    def _streamed_auto(self, index: int, c: Choice) -> dict:
        """Content until the calls begin, then the calls piece by piece."""
        stream = self._auto[index]
        content, deltas = stream.feed("".join(c.text))
        finish = c.finish_reason
        if finish is not None:
            tail, last = stream.finish()
            content, deltas = content + tail, deltas + last
            if finish == "stop" and stream.calls() is not None:
                finish = "tool_calls"
        c.text = [content]
        out = self.chat_choice(index, c)
        delta = {"content": content} if content else {}
        if deltas:
            delta["tool_calls"] = deltas
        out["delta"], out["finish_reason"] = delta, finish
        return out

    def _streamed_call(self, index: int, c: Choice) -> dict:
        """The constrained output is the call(s): stream id + name, then arguments pieces."""
        piece = "".join(c.text)
        first = index not in self._texts
        self._texts[index] = text = self._texts.get(index, "") + piece
        if self.mode == "named":  # first the header, the first piece riding with it
            deltas = ([{"index": 0, **call(self.name, piece, self.new_id)}] if first
                      else [arguments(0, piece)] if piece else [])
        else:
            deltas = self._scanners[index].feed(piece)
        finish = c.finish_reason
        if finish == "stop" and parse_calls(text, self.mode, self.name) is not None:
            finish = "tool_calls"
        out = {"index": index, "delta": {"tool_calls": deltas} if deltas else {},
               "logprobs": None, "finish_reason": finish}
        if finish is not None:
            out["stop_reason"] = c.stop_reason
        return out
