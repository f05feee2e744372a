"""tool_choice "auto": the non-streamed message and the OpenAI SDK's accumulation of the stream
are the same message, whatever pieces the text arrives in, for all three parsers: answers that
are no call (an object whose name is no declared tool, or without its arguments key), calls
followed by something that is no call, calls cut by max_tokens, repeated keys."""
from __future__ import annotations

import functools

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from raypaged.serve.responses import Choice, Shapes
from raypaged.serve.tool_calls import ToolCallChoices

TOOLS = ["get_weather", "f"]
SIZES = [1, 2, 3, 5, 7, 11, 1000]

CASES = [  # parser, text, engine's finish_reason, (content, calls, message's finish_reason)
    # an answer in JSON is no call: its name is no tool, or it has no arguments key
    ("llama3_json", '{"name": "Alice", "age": 30}', "stop",
     ('{"name": "Alice", "age": 30}', None, "stop")),
    ("llama3_json", '{"name": "Alice", "parameters": {"age": 30}}', "stop",
     ('{"name": "Alice", "parameters": {"age": 30}}', None, "stop")),
    ("llama3_json", '{"name": "f", "age": 30}', "stop",
     ('{"name": "f", "age": 30}', None, "stop")),
    ("mistral", 'Hi.[TOOL_CALLS][{"name": "Alice", "arguments": {}}]', "stop",
     ('Hi.[TOOL_CALLS][{"name": "Alice", "arguments": {}}]', None, "stop")),
    ("hermes", '<tool_call>{"name": "Alice", "arguments": {}}</tool_call>', "stop",
     ('<tool_call>{"name": "Alice", "arguments": {}}</tool_call>', None, "stop")),
    # a call, then something that is no call: the message is the call
    ("llama3_json", '{"name": "f", "parameters": {"a": 1}}; {"foo": 1}', "stop",
     (None, [("f", '{"a": 1}')], "tool_calls")),
    ("mistral", 'Sure.[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"x": 1}]', "stop",
     ("Sure.", [("f", '{"a": 1}')], "tool_calls")),
    ("hermes", 'Hi <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
               '<tool_call>{"x": 1}</tool_call>', "stop", ("Hi", [("f", '{"a": 1}')], "tool_calls")),
    # a tag that holds no call before one that does: the call is still index 0
    ("hermes", '<tool_call>{"x": 1}</tool_call> <tool_call>{"name": "f", "arguments": {"a": 1}}'
               '</tool_call>', "stop", (None, [("f", '{"a": 1}')], "tool_calls")),
    # cut by max_tokens: before the call was recognized, all text; after, the partial call
    ("llama3_json", '{"name": "f"', "length", ('{"name": "f"', None, "length")),
    ("llama3_json", '{"name": "f", "parameters": {"a": 1', "length",
     (None, [("f", '{"a": 1')], "length")),
    ("mistral", 'Sure.[TOOL_CALLS][{"name": "f", "arguments": {"a": [1, 2', "length",
     ("Sure.", [("f", '{"a": [1, 2')], "length")),
    ("mistral", 'Sure.[TOOL_CALLS][{"name": "f"', "length",
     ('Sure.[TOOL_CALLS][{"name": "f"', None, "length")),
    ("hermes", 'Hi <tool_call>{"name": "f", "arguments": {"a": "Par', "length",
     ("Hi", [("f", '{"a": "Par')], "length")),
    # a repeated arguments (or name) key: the first one counts
    ("llama3_json", '{"name": "f", "arguments": {"a": 1}, "parameters": {"b": 2}}', "stop",
     (None, [("f", '{"a": 1}')], "tool_calls")),
    ("llama3_json", '{"name": "f", "arguments": "a=1", "parameters": {"b": 2}}', "stop",
     (None, [("f", "a=1")], "tool_calls")),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}, "arguments": {"b": 2}}]',
     "stop", (None, [("f", '{"a": 1}')], "tool_calls")),
    ("hermes", '<tool_call>{"name": "f", "name": "get_weather", "arguments": 3, '
               '"arguments": {"b": 2}}</tool_call>', "stop", (None, [("f", "3")], "tool_calls")),
]


def choice(text: str, finish: str | None) -> Choice:
    c = Choice()
    c.text, c.finish_reason = [text], finish
    return c


def choices(parser: str) -> ToolCallChoices:
    return ToolCallChoices(functools.partial(Shapes(None).chat_choice, False), "auto", None,
                           parser, TOOLS)


def message(content, calls, finish) -> tuple:
    return content, None if calls is None else [(c.function.name, c.function.arguments)
                                                 for c in calls], finish


def whole(parser: str, text: str, finish: str) -> tuple:
    out = choices(parser)(0, choice(text, finish), whole=True)
    calls = out["message"].get("tool_calls")
    return (out["message"]["content"],
            None if calls is None else [(c["function"]["name"], c["function"]["arguments"])
                                        for c in calls], out["finish_reason"])


def streamed(parser: str, text: str, finish: str, size: int) -> tuple:
    """The stream's chunks, accumulated by the OpenAI SDK."""
    tc, state = choices(parser), ChatCompletionStreamState()
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    for k, piece in enumerate(pieces):
        out = tc(0, choice(piece, finish if k == len(pieces) - 1 else None))
        state.handle_chunk(ChatCompletionChunk.model_validate(
            {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
             "choices": [out]}))
    final = state.current_completion_snapshot.choices[0]
    return message(final.message.content, final.message.tool_calls, final.finish_reason)


@pytest.mark.parametrize("parser, text, finish, expected", CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_the_stream_adds_up_to_the_whole_message_for_any_split(parser, text, finish, expected):
    assert whole(parser, text, finish) == expected
    for size in SIZES:
        assert streamed(parser, text, finish, size) == expected, size


def test_a_name_that_is_no_tool_sends_no_header_and_the_answer_streams_as_content():
    """Llama 3's `{"name": "Alice", "age": 30}`: an answer, not a call to "Alice"."""
    tc = choices("llama3_json")
    pieces = ['{"name": "Ali', 'ce", "age": 30', '}']
    outs = [tc(0, choice(p, "stop" if k == 2 else None)) for k, p in enumerate(pieces)]
    assert [(o["delta"], o["finish_reason"]) for o in outs] == [
        ({}, None), ({}, None), ({"content": '{"name": "Alice", "age": 30}'}, "stop")]


def test_the_header_waits_for_the_arguments_key_then_carries_the_first_piece():
    tc = choices("mistral")
    pieces = ['[TOOL_CALLS][{"name": "f"', ', "argu', 'ments": {"a"', ': 1}}]']
    outs = [tc(0, choice(p, "stop" if k == 3 else None)) for k, p in enumerate(pieces)]
    deltas = [[{k: v for k, v in d.items() if k != "id"} for d in o["delta"].get("tool_calls", ())]
              for o in outs]
    assert deltas == [[], [], [{"index": 0, "type": "function",
                                "function": {"name": "f", "arguments": '{"a"'}}],
                      [{"index": 0, "function": {"arguments": ": 1}"}}]]
    assert outs[-1]["finish_reason"] == "tool_calls"
