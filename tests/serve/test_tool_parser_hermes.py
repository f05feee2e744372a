"""tool_choice "auto": the exact content and delta.tool_calls a stream sends for a model that
writes Hermes calls (<tool_call>{...}</tool_call>), whatever pieces its text arrives in."""
from __future__ import annotations

import pytest

from raypaged.serve.tool_parsers import parse_whole
from raypaged.serve.tool_parsers.hermes import HermesStream
from tests.serve.tool_parser_chunks import calls_sent, chunks_of, without_ids


def parse_hermes(text: str):
    return parse_whole("hermes", text)

TWO = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
       '"Paris </tool_call>"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
       '{"zone": "CET"}}\n</tool_call>')


def stream(pieces) -> list[tuple[str, list[dict]]]:
    return chunks_of(HermesStream, pieces)


def test_content_first_then_each_calls_name_then_its_arguments_in_the_pieces_they_arrive_in():
    pieces = ["Let me", " check.\n<tool", "_call>\n{\"name\": \"get_", "weather\", \"argu",
              "ments\": {\"ci", "ty\": \"Paris </tool_call>\"}}\n</tool_", "call>\n<tool_call>\n{",
              "\"name\": \"get_time\", \"arguments\": {\"zone\": \"CET\"}}", "\n</tool_call>"]
    assert "".join(pieces) == TWO
    chunks = stream(pieces)
    assert without_ids(chunks) == [
        ("Let me", []),
        (" check.", []),    # "\n<tool" held back: it may begin a tag, and space before one goes
        ("", []),
        ("", [{"index": 0, "type": "function",
               "function": {"name": "get_weather", "arguments": ""}}]),
        ("", [{"index": 0, "function": {"arguments": '{"ci'}}]),
        # a </tool_call> inside a string is text; the one after the object ends the tag
        ("", [{"index": 0, "function": {"arguments": 'ty": "Paris </tool_call>"}'}}]),
        ("", []),
        ("", [{"index": 1, "type": "function",
               "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}]),
        ("", []),
        ("", []),           # finish
    ]
    ids = [d["id"] for _, deltas in chunks for d in deltas if "id" in d]
    assert len(ids) == 2 and all(i.startswith("call_") for i in ids) and ids[0] != ids[1]


@pytest.mark.parametrize("size", [1, 2, 5, 11, len(TWO)])
def test_any_split_adds_up_to_the_whole_messages_content_and_calls(size):
    chunks = stream([TWO[i:i + size] for i in range(0, len(TWO), size)])
    content = "".join(text for text, _ in chunks)
    whole_content, calls = parse_hermes(TWO)
    assert whole_content == content == "Let me check."
    assert calls == [("get_weather", '{"city": "Paris </tool_call>"}'),
                     ("get_time", '{"zone": "CET"}')]
    assert calls_sent(chunks) == calls


def test_text_that_only_looks_like_a_tag_streams_as_content():
    chunks = stream(["I use <", "tool", "s> daily.  ", "Bye"])
    # held back: "<" then "<tool" (a tag may begin), the space before them, the trailing spaces
    assert chunks == [("I use", []), ("", []), (" <tools> daily.", []), ("  Bye", []),
                      ("", [])]
    assert parse_hermes("I use <tools> daily.  Bye") == ("I use <tools> daily.  Bye", None)


def test_a_tag_without_a_named_call_is_content_after_all_when_the_sample_ends():
    text = 'Hi <tool_call>{"args": 1}</tool_call> bye'
    chunks = stream([text[:9], text[9:]])
    assert chunks == [("Hi", []), ("", []), (' <tool_call>{"args": 1}</tool_call> bye', [])]
    assert parse_hermes(text) == (text, None)


def test_arguments_that_are_not_an_object_or_absent_come_as_json_when_the_tag_ends():
    chunks = stream(['<tool_call>{"name": "f", "arguments": 3}', "</tool_call>"])
    assert without_ids(chunks) == [
        ("", [{"index": 0, "type": "function", "function": {"name": "f", "arguments": ""}}]),
        ("", [{"index": 0, "function": {"arguments": "3"}}]),
        ("", [])]
    # no closing tag before the sample ends: the object is complete, so it is a call
    assert parse_hermes('<tool_call>{"name": "f"}') == (None, [("f", "{}")])


def test_a_call_cut_short_keeps_the_arguments_the_stream_sent():
    """max_tokens cut the call: it is still the call, its arguments partial (as OpenAI's, with
    finish_reason "length"), in the whole message as in the stream."""
    text = '<tool_call>{"name": "f", "arguments": {"x": 1'
    assert parse_hermes(text) == (None, [("f", '{"x": 1')])
