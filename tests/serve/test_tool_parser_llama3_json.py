"""tool_choice "auto" with the llama3_json parser: the exact content and delta.tool_calls a stream
sends for a Llama 3.x model's JSON calls, whatever pieces its text arrives in."""
from __future__ import annotations

import pytest

from raypaged.serve.tool_parsers import parse_whole
from raypaged.serve.tool_parsers.llama3_json import Llama3JsonStream
from tests.serve.tool_parser_chunks import calls_sent, chunks_of, without_ids

TWO = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris; \\"Nord\\""}}; '
       '{"name": "get_time", "arguments": {"zone": "CET"}}')


def stream(pieces) -> list[tuple[str, list[dict]]]:
    return chunks_of(Llama3JsonStream, pieces)


def test_each_calls_name_then_its_arguments_in_the_pieces_they_arrive_in():
    pieces = ["<|python", "_tag|>{\"name\": \"get_", "weather\", \"param", "eters\": {\"ci",
              "ty\": \"Paris; \\\"Nord\\\"\"}}", "; {\"name\": \"get_time\", \"arguments\": ",
              "{\"zone\": \"CET\"}}"]
    assert "".join(pieces) == TWO
    chunks = stream(pieces)
    assert without_ids(chunks) == [
        ("", []),           # "<|python" may begin the tag: held
        ("", []),           # the name is not complete yet
        ("", []),           # a call needs its "parameters" key too
        ("", [{"index": 0, "type": "function",
               "function": {"name": "get_weather", "arguments": '{"ci'}}]),
        # a ";" inside a string is text, not the separator
        ("", [{"index": 0, "function": {"arguments": 'ty": "Paris; \\"Nord\\""}'}}]),
        ("", [{"index": 1, "type": "function",
               "function": {"name": "get_time", "arguments": ""}}]),
        ("", [{"index": 1, "function": {"arguments": '{"zone": "CET"}'}}]),
        ("", []),           # finish
    ]
    ids = [d["id"] for _, deltas in chunks for d in deltas if "id" in d]
    assert len(ids) == 2 and all(i.startswith("call_") for i in ids) and ids[0] != ids[1]


@pytest.mark.parametrize("text", [TWO, TWO[len("<|python_tag|>"):]],
                         ids=["python_tag", "tag_skipped_as_special"])
@pytest.mark.parametrize("size", [1, 2, 5, 13, 1000])
def test_any_split_adds_up_to_the_whole_messages_calls(text, size):
    chunks = stream([text[i:i + size] for i in range(0, len(text), size)])
    calls = [("get_weather", '{"city": "Paris; \\"Nord\\""}'), ("get_time", '{"zone": "CET"}')]
    assert "".join(t for t, _ in chunks) == ""
    assert parse_whole("llama3_json", text) == (None, calls)
    assert calls_sent(chunks) == calls


def test_a_message_that_does_not_begin_with_a_call_is_content_as_it_comes():
    chunks = stream(["  Sure", ': {"name": "f"}', " done"])
    assert chunks == [("  Sure", []), (': {"name": "f"}', []), (" done", []), ("", [])]
    assert parse_whole("llama3_json", 'Sure: {"name": "f"}') == ('Sure: {"name": "f"}', None)


def test_a_json_answer_without_a_name_is_content_when_the_sample_ends():
    chunks = stream(['{"answer": ', "4}"])
    assert chunks == [("", []), ("", []), ('{"answer": 4}', [])]
    assert parse_whole("llama3_json", '{"answer": 4}') == ('{"answer": 4}', None)


def test_scalar_parameters_and_text_after_the_calls():
    # a string: as it is; text after the calls is dropped
    assert parse_whole("llama3_json", '{"name": "f", "parameters": {}}; '
                                      '{"name": "g", "parameters": "x=1"} ok') \
        == (None, [("f", "{}"), ("g", "x=1")])
    # without "parameters" (or "arguments") an object is no call (vLLM's llama3_json agrees)
    assert parse_whole("llama3_json", '{"name": "f"}') == ('{"name": "f"}', None)
    chunks = stream(['{"name": "f", "parameters": 3', "}"])
    assert without_ids(chunks) == [
        ("", [{"index": 0, "type": "function", "function": {"name": "f", "arguments": ""}}]),
        ("", [{"index": 0, "function": {"arguments": "3"}}]),
        ("", [])]


def test_a_call_cut_short_keeps_the_arguments_the_stream_sent():
    text = '{"name": "f", "parameters": {"x": 1'
    assert parse_whole("llama3_json", text) == (None, [("f", '{"x": 1')])
