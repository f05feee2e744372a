"""Input lines, output lines and prefix order, without Ray or a model."""
from __future__ import annotations

import io

import pytest

from raypaged.batch.rows import group_by_prefix
from raypaged.batch.rows import digest_of
from raypaged.batch.output import error_line, success_line
from raypaged.batch.rows import CHAT_URL, COMPLETIONS_URL, Row, read_rows
from raypaged.serve.errors import bad_request

CAP = 1 << 20


def rows_of(*lines: str | bytes, cap: int = CAP) -> list[Row]:
    data = b"".join(l if isinstance(l, bytes) else l.encode() + b"\n" for l in lines)
    return list(read_rows(io.BytesIO(data), cap))


def test_openai_lines_and_plain_rows_become_endpoint_bodies():
    rows = rows_of(
        '{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi"}}',
        '{"custom_id": "b", "url": "/v1/chat/completions", "body": {"messages": []}}',
        '',
        '{"prompt": "p", "temperature": 0, "sampling_params": {"max_tokens": 3}}',
        '{"messages": [{"role": "user", "content": "x"}], "custom_id": "m"}')
    assert [(r.line_no, r.custom_id, r.url, r.body, r.error) for r in rows] == [
        (1, "a", COMPLETIONS_URL, {"prompt": "hi"}, None),
        (2, "b", CHAT_URL, {"messages": []}, None),
        (4, "line-4", COMPLETIONS_URL, {"prompt": "p", "temperature": 0, "max_tokens": 3}, None),
        (5, "m", CHAT_URL, {"messages": [{"role": "user", "content": "x"}]}, None)]


BAD = [
    (b"not json\n", 400, "line 1: the line is not valid JSON: it does not parse"),
    (b'{"prompt": "\xff"}\n', 400, "line 1: the line is not valid JSON: it does not parse"),
    (b'{"prompt": NaN}\n', 400, "line 1: the line is not valid JSON: NaN is not a JSON number"),
    (b'[1, 2]\n', 400, "line 1: a line must be a JSON object, got list"),
    (b'{"url": "/v1/completions", "body": {"prompt": "x"}}\n', 400,
     "line 1: custom_id is required on an OpenAI batch line"),
    (b'{"custom_id": 7, "prompt": "x"}\n', 400,
     "line 1: custom_id must be a non-empty string, got 7"),
    (b'{"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {}}\n', 400,
     "line 1: method must be \"POST\", got 'GET'"),
    (b'{"custom_id": "a", "url": "/v1/embeddings", "body": {}}\n', 404,
     "line 1: url '/v1/embeddings' is not supported: use one of ['/v1/completions', "
     "'/v1/chat/completions']"),
    (b'{"custom_id": "a", "url": "/v1/completions", "body": "hi"}\n', 400,
     "line 1: body must be a JSON object, got str"),
    (b'{"temperature": 0}\n', 400,
     "line 1: a plain row needs exactly one of \"prompt\" (a completion) or \"messages\" (a "
     "chat), or the OpenAI batch fields custom_id, method, url, body"),
    (b'{"prompt": "x", "sampling_params": [1]}\n', 400,
     "line 1: sampling_params must be a JSON object, got list"),
]


@pytest.mark.parametrize("line,status,message", BAD)
def test_a_bad_line_is_refused_with_its_status_and_reason(line, status, message):
    [row] = rows_of(line)
    assert (row.error.status, row.error.message) == (status, message)


def test_the_second_line_with_a_custom_id_is_the_duplicate():
    rows = rows_of('{"prompt": "x", "custom_id": "a"}', '{"prompt": "y", "custom_id": "a"}')
    assert rows[0].error is None
    assert rows[1].error.message == ("line 2: custom_id 'a' is a duplicate of an earlier line's: "
                                     "give every line its own custom_id")


def test_a_row_without_custom_id_whose_default_is_taken_is_refused_not_named_alike():
    """Line 1 names itself "line-3"; line 3 has no custom_id: its default, "line-3", would give
    two output lines the same custom_id (one for each input line)."""
    rows = rows_of('{"prompt": "x", "custom_id": "line-3"}', '{"prompt": "y"}', '{"prompt": "z"}')
    assert [(r.custom_id, r.error) for r in rows[:2]] == [("line-3", None), ("line-2", None)]
    assert (rows[2].custom_id, rows[2].error.status, rows[2].error.message) == (
        None, 400, "line 3: the line has no custom_id, and its default one, 'line-3', is an "
                   "earlier line's custom_id: give this line a custom_id of its own")


def test_each_row_carries_the_digest_of_its_line_bytes_and_where_it_ends():
    a, b = b'{"prompt": "a"}', b'{"prompt": "b"}'
    rows = rows_of(a + b"\n", b"\n", b)  # a blank line between; the last without "\n"
    assert [(r.line_no, r.digest, r.end) for r in rows] == [
        (1, digest_of(a), len(a) + 1), (3, digest_of(b), 2 * len(a) + 2)]
    assert digest_of(a) != digest_of(b)


def test_output_lines_carry_the_input_line_its_digest_and_the_http_body(tmp_path):
    row = Row(3, "c", COMPLETIONS_URL, {"prompt": "x"}, digest=0xAB)
    assert success_line(row, 200, {"id": "cmpl-1", "choices": []}) == {
        "id": "batch_req_3_00000000000000ab", "custom_id": "c",
        "response": {"status_code": 200, "request_id": "cmpl-1",
                     "body": {"id": "cmpl-1", "choices": []}}, "error": None}
    err = bad_request("max_tokens must be at least 1", "max_tokens")
    assert error_line(row, err) == {
        "id": "batch_req_3_00000000000000ab", "custom_id": "c",
        "response": {"status_code": 400, "request_id": "batch_req_3_00000000000000ab",
                     "body": err.body()},
        "error": {"code": "invalid_request", "message": "max_tokens must be at least 1"}}


def test_prefix_groups_keep_first_appearance_order_and_input_order_within():
    rows = [Row(i, f"r{i}") for i in range(6)]
    keys = [b"B", b"A", b"B", None, b"A", b"B"]
    assert [r.line_no for r in group_by_prefix(rows, keys)] == [0, 2, 5, 1, 4, 3]
