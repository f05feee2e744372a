"""Streamed tool calls for tool_choice "required": the exact delta.tool_calls a stream sends
for a constrained call list, whatever the pieces the text arrives in."""
from __future__ import annotations

from raypaged.serve.tool_call_stream import CallListScanner
from raypaged.serve.tool_calls import parse_calls

TWO = ('[{"name": "get_weather", "parameters": {"city": "Paris \\"Nord\\"", "days": [1, 2]}},\n'
       ' {"name": "get_time", "parameters": {"zone": "CET"}}]')


def stream(pieces) -> list[list[dict]]:
    scanner = CallListScanner()
    return [scanner.feed(p) for p in pieces]


def without_ids(chunks):
    return [[{k: v for k, v in d.items() if k != "id"} for d in c] for c in chunks]


def test_the_name_comes_first_then_the_arguments_in_the_pieces_they_arrive_in():
    pieces = ['[{"name": "get_', 'weather", "param', 'eters": {"ci', 'ty": "Paris \\"Nord\\"", ',
              '"days": [1, 2]}},\n {"name": "get_time", "parameters": {"zone"', ': "CET"}}]']
    chunks = stream(pieces)
    assert without_ids(chunks) == [
        [],
        [{"index": 0, "type": "function", "function": {"name": "get_weather", "arguments": ""}}],
        [{"index": 0, "function": {"arguments": '{"ci'}}],
        [{"index": 0, "function": {"arguments": 'ty": "Paris \\"Nord\\"", '}}],
        [{"index": 0, "function": {"arguments": '"days": [1, 2]}'}},
         {"index": 1, "type": "function", "function": {"name": "get_time",
                                                       "arguments": '{"zone"'}}],
        [{"index": 1, "function": {"arguments": ': "CET"}'}}],
    ]
    ids = [d["id"] for c in chunks for d in c if "id" in d]
    assert len(ids) == 2 and all(i.startswith("call_") for i in ids) and ids[0] != ids[1]


def test_character_by_character_the_arguments_add_up_to_the_whole_messages():
    args: dict[int, str] = {}
    names: dict[int, str] = {}
    for chunk in stream(TWO):
        for d in chunk:
            if "id" in d:
                names[d["index"]] = d["function"]["name"]
            args[d["index"]] = args.get(d["index"], "") + d["function"]["arguments"]
    whole = parse_calls(TWO, "required", None)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole] == [
        ("get_weather", '{"city": "Paris \\"Nord\\"", "days": [1, 2]}'),
        ("get_time", '{"zone": "CET"}')]
    assert [(names[k], args[k]) for k in sorted(args)] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole]
