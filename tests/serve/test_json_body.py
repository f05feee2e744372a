"""Checking a request body: refusals name the element, and the walk costs bounded memory."""
from __future__ import annotations

import tracemalloc

import pytest

from raypaged.serve.errors import APIError
from raypaged.serve.json_body import MAX_JSON_DEPTH, parse_json_body


@pytest.mark.parametrize("raw,where", [
    (b'{"a": [1, 2, {"b": [0.5, 1e400]}]}', "a.2.b.1"),
    (b'{"messages": [{"content": "ok"}, {"content": "\\ud800"}]}', "messages.1.content"),
    (b'{"x": {"\\udfff": 1}}', "x"),
    (b'NaN', None),
])
def test_a_refusal_names_the_element(raw, where):
    with pytest.raises(APIError) as exc:
        parse_json_body(raw)
    assert exc.value.status == 400 and exc.value.param == where


def test_nesting_is_bounded_without_recursion():
    parse_json_body(b"[" * (MAX_JSON_DEPTH - 1) + b"[1]" + b"]" * (MAX_JSON_DEPTH - 1))
    with pytest.raises(APIError, match="nests deeper"):
        parse_json_body(b"[" * MAX_JSON_DEPTH + b"[1]" + b"]" * MAX_JSON_DEPTH)
    with pytest.raises(APIError, match="nests deeper"):
        parse_json_body(b"[" * 100_000 + b"]" * 100_000)


def test_checking_a_long_list_costs_no_more_than_parsing_it():
    """An integer list: its parsed list is ~4.5x the body; the walk that pushed a tuple and a
    path string per element took ~70x (benchmarks/body_memory.py)."""
    body = b'{"prompt": [' + b"1," * 1_000_000 + b"1]}"
    tracemalloc.start()
    try:
        parse_json_body(body)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 6 * len(body), peak / len(body)


@pytest.mark.parametrize("raw,where", [
    (b'{"p": ["ok", "fine", "\\ud800"]}', "p.2"),
    (b'{"p": [1, 2.5, -1e400]}', "p.2"),
    (b'[1, "\\udfff"]', "1"),
])
def test_a_list_of_scalars_checked_in_bulk_still_names_the_element(raw, where):
    with pytest.raises(APIError) as exc:
        parse_json_body(raw)
    assert exc.value.status == 400 and exc.value.param == where


def test_lists_of_scalars_that_pass():
    big = 10 ** 400  # an int past float's range is a valid JSON number
    assert parse_json_body(f'{{"p": [1, true, null, 2.5, {big}]}}'.encode())["p"][-1] == big
    assert parse_json_body(b'{"p": ["a", "b", "\\u00e9"]}') == {"p": ["a", "b", "\u00e9"]}
    assert parse_json_body(b'[1, 2, 3]') == [1, 2, 3]
