"""tool_choice "auto" with the mistral parser: the exact content and delta.tool_calls a stream
sends for a Mistral model's [TOOL_CALLS] list, whatever pieces its text arrives in."""
from __future__ import annotations

import functools

import pytest

from raypaged.serve.responses import Choice, Shapes
from raypaged.serve.tool_calls import ToolCallChoices
from raypaged.serve.tool_parsers import parse_whole
from raypaged.serve.tool_parsers.mistral import MistralStream
from tests.serve.tool_parser_chunks import calls_sent, chunks_of, without_ids

TWO = ('Let me check. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "[Paris]"}}, '
       '{"name": "get_time", "arguments": {"zone": "CET"}}]')
CALLS = [("get_weather", '{"city": "[Paris]"}'), ("get_time", '{"zone": "CET"}')]


def stream(pieces) -> list[tuple[str, list[dict]]]:
    return chunks_of(MistralStream, pieces)


def test_content_first_then_each_calls_name_then_its_arguments_in_pieces():
    pieces = ["Let me", " check. [TOOL", "_CALLS] [{\"name\": \"get_weather\"", ", \"arguments\"",
              ": {\"city\": \"[Par", "is]\"}}, {\"name\": \"get_time\", \"arguments\": ",
              "{\"zone\": \"CET\"}}]"]
    assert "".join(pieces) == TWO
    chunks = stream(pieces)
    assert without_ids(chunks) == [
        ("Let me", []),
        (" check.", []),    # " [TOOL" held back: it may begin the marker
        ("", []),           # a call needs its "arguments" key too
        ("", [{"index": 0, "type": "function",
               "function": {"name": "get_weather", "arguments": ""}}]),
        ("", [{"index": 0, "function": {"arguments": '{"city": "[Par'}}]),
        # brackets inside a string are text; call 0 ends, call 1 begins in the same piece
        ("", [{"index": 0, "function": {"arguments": 'is]"}'}},
              {"index": 1, "type": "function",
               "function": {"name": "get_time", "arguments": ""}}]),
        ("", [{"index": 1, "function": {"arguments": '{"zone": "CET"}'}}]),
        ("", []),           # finish
    ]
    ids = [d["id"] for _, deltas in chunks for d in deltas if "id" in d]
    # Mistral's ids: 9 letters and digits (its templates refuse any other)
    assert len(ids) == 2 and ids[0] != ids[1]
    assert all(len(i) == 9 and i.isalnum() and i.isascii() for i in ids)


@pytest.mark.parametrize("size", [1, 2, 5, 12, 1000])
def test_any_split_adds_up_to_the_whole_messages_content_and_calls(size):
    chunks = stream([TWO[i:i + size] for i in range(0, len(TWO), size)])
    assert "".join(t for t, _ in chunks) == "Let me check."
    assert parse_whole("mistral", TWO) == ("Let me check.", CALLS)
    assert calls_sent(chunks) == CALLS


def test_the_list_without_its_marker_skipped_as_a_special_token_is_the_calls():
    text = TWO[len("Let me check. [TOOL_CALLS]"):]
    assert parse_whole("mistral", text) == (None, CALLS)
    # ... only where a message begins: later it is text
    later = "See: " + text
    assert parse_whole("mistral", later) == (later, None)


def test_a_bracket_that_begins_no_call_list_streams_as_content():
    assert stream(["[1] Paris", " is", " [TOOL"]) == [
        ("[1] Paris", []), (" is", []), ("", []), (" [TOOL", [])]


def test_one_object_string_arguments_and_text_after_the_calls():
    text = '[TOOL_CALLS]{"name": "f", "arguments": "{\\"a\\": 1}"} {"name": "g"} bye'
    assert parse_whole("mistral", text) == (None, [("f", '{"a": 1}')])
    # no "arguments" key: no call, so all of it is content
    assert parse_whole("mistral", '[TOOL_CALLS][{"name": "f"}] bye') == \
        ('[TOOL_CALLS][{"name": "f"}] bye', None)


def test_a_marker_without_a_named_call_is_content_after_all():
    text = 'Hi [TOOL_CALLS] [{"args": 1}]'
    assert stream([text]) == [("Hi", []), (' [TOOL_CALLS] [{"args": 1}]', [])]
    assert parse_whole("mistral", text) == (text, None)


def choice(text: str, finish: str | None):
    c = Choice()
    c.text, c.finish_reason = [text], finish
    return c


@pytest.mark.parametrize("mode, name, text", [
    ("required", None, '[{"name": "f", "parameters": {"a": 1}}]'),
    ("named", "f", '{"a": 1}')])
def test_a_mistral_model_gets_mistral_ids_when_the_call_is_forced_too(mode, name, text):
    """Its template refuses other ids when the calls come back in the conversation."""
    choices = ToolCallChoices(functools.partial(Shapes(None).chat_choice, False), mode, name,
                              "mistral")
    [call] = choices(0, choice(text, "stop"), whole=True)["message"]["tool_calls"]
    streamed = choices(0, choice(text, "stop"))
    [first] = [d for d in streamed["delta"]["tool_calls"] if "id" in d]
    assert (call["function"], first["function"]) == ({"name": "f", "arguments": '{"a": 1}'},) * 2
    assert all(len(i) == 9 and i.isalnum() for i in (call["id"], first["id"]))
