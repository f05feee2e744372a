"""Hundreds of distinct malformed requests, generated field by field over both routes: every one
gets a 4xx in OpenAI's error shape: none is accepted, none reaches the engine, none is a 5xx.

Values are raw JSON text, so NaN, Infinity, 1e400, 2**63 and lone surrogates travel exactly as a
hostile or buggy client would send them."""
from __future__ import annotations

import json

import httpx
import pytest

from test_malformed_requests import CHAT, CMPL, M, assert_openai_error

USER = '[{"role": "user", "content": "hi"}]'
NON_FINITE = ["NaN", "Infinity", "-Infinity", "1e400", "-1e400"]
NOT_A_NUMBER = ['"0.5"', "[]", "{}", "true", '"\\ud800"']
NOT_AN_INT = ["1.5", '"3"', "[]", "true", "NaN", "1e400"]

# field -> raw JSON values that must be refused on both routes
BAD = {
    "temperature": NON_FINITE + NOT_A_NUMBER + ["-1", "-0.001"],
    "top_p": NON_FINITE + NOT_A_NUMBER + ["0", "1.5", "-0.1"],
    "min_p": NON_FINITE + NOT_A_NUMBER + ["1.01", "-0.5"],
    "presence_penalty": NON_FINITE + NOT_A_NUMBER + ["2.5", "-3"],
    "frequency_penalty": NON_FINITE + NOT_A_NUMBER + ["3", "-2.01"],
    "repetition_penalty": NON_FINITE + NOT_A_NUMBER + ["0", "-1"],
    "top_k": NOT_AN_INT + ["-7", "-2", "100000000000000000000", "9223372036854775808"],
    "seed": NOT_AN_INT + ["1180591620717411303424", "-9223372036854775809"],
    "n": NOT_AN_INT + ["0", "-1", "17", "1000"],
    "max_tokens": NOT_AN_INT + ["0", "-3", "100000000000000000000"],
    "min_tokens": NOT_AN_INT + ["-1", "-100"],
    "stop": ["5", '[""]', "[1, 2]", '{"a": 1}', '"\\ud800"', '["ok", "\\udfff"]', "true"],
    "stop_token_ids": ["[99999999]", "[-5]", "[1.5]", '["a"]', "5", "[9223372036854775808]",
                       "[49152]", "[[1]]"],
    "ignore_eos": ['"yes"', "1", "null", "[]"],
    "include_stop_str_in_output": ['"no"', "0", "{}"],
    "stream": ['"yes please"', "1", "[]"],
    "cache_salt": ["7", '""', '"\\ud800"', "[]"],
    "user": ["5", '"\\udfff"', "{}"],
    # vLLM's fields not implemented here, set to ask for something
    "use_beam_search": ["true"], "prompt_logprobs": ["1"], "bad_words": ['["x"]'],
    "allowed_token_ids": ["[1]"], "priority": ["1"], "truncate_prompt_tokens": ["0", "-2", '"5"', "1.5"],
    "logit_bias": ['{"5": 101}', '{"5": "NaN"}', '{"x": 1}', '{"49152": 1}', "[5]"],
    "structured_outputs": ['{"regex": "a("}', '{"json": {"type": "foo"}}', '{"regexp": "a"}',
                           '{"regex": "a", "choice": ["b"]}', "{}", '"json"'],
    "response_format": ['{"type": "json_schema"}', '{"type": "xml"}', '"text"', "5"],
}
BAD_COMPLETION_ONLY = {
    "prompt": ['"\\ud800"', '["ok", "\\ud800"]', "[[1, -1]]", "[[]]", "null", "true", "{}",
               "[1, 1.5]", '""', "[]", "[49152]", "42", '[["a"]]'],
    "logprobs": ["21", "-1", "1.5", '"x"', "NaN"],
    "echo": ["true", '"yes"'],
    "suffix": ['"and then"', "5"],
    "best_of": ["3", '"x"'],
}
BAD_CHAT_ONLY = {
    "messages": ['[{"role": "user", "content": "\\ud800"}]',
                 '[{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]',
                 '[{"role": "wizard", "content": "hi"}]', '[{"role": "user"}]', "[]", "null",
                 '"hi"', '[{"role": "user", "content": 3}]', '[{"content": "hi"}]', "[[]]",
                 '[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]',
                 '[{"role": "user", "content": "hi", "name": 5}]'],
    "top_logprobs": ["2", "99"],          # without logprobs: true
    "logprobs": ['"yes"', "5", "NaN"],
    "max_completion_tokens": NOT_AN_INT + ["0", "-1"],
    "tools": ['[{"type": "function"}]', '[{"type": "retrieval", "function": {"name": "f"}}]'],
    "tool_choice": ['"required"', '"always"', '{"type": "function", "function": {"name": "f"}}'],
    "add_generation_prompt": ['"yes"'],
    "echo": ["true"], "chat_template": ['"{{ messages }}"'],
    "chat_template_kwargs": ['{"tokenize": true}', '{"add_generation_prompt": false}', "5"],
    "continue_final_message": ["true", '"yes"'],     # true: with add_generation_prompt (default)
}


def cases():
    out = []
    for route, base, extra in ((CMPL, f'"model": "{M}", "prompt": "hi"', BAD_COMPLETION_ONLY),
                               (CHAT, f'"model": "{M}", "messages": {USER}', BAD_CHAT_ONLY)):
        for field, values in [*BAD.items(), *extra.items()]:
            for raw in values:
                # the bad field last: it overrides a valid one in `base` (JSON keeps the last key)
                out.append((route, f"{field}={raw}", f"{{{base}, \"{field}\": {raw}}}"))
        out.append((route, "model=lone surrogate", f'{{"model": "\\ud800", "prompt": "hi", '
                                                   f'"messages": {USER}}}'))
        out.append((route, "nested 100,000 deep", f'{{"model": "{M}", "prompt": '
                    + "[" * 100_000 + "]" * 100_000 + "}"))
        out.append((route, "nested 65 deep", f'{{"model": "{M}", "user": '
                    + "[" * 65 + "]" * 65 + "}"))
        out.append((route, "NaN at the top", "NaN"))
        out.append((route, "key with a lone surrogate", f'{{"model": "{M}", "\\ud800": 1}}'))
    return out


CASES = cases()


def test_at_least_200_distinct_malformed_inputs():
    assert len({(route, body) for route, _, body in CASES}) >= 200


@pytest.mark.parametrize("route,name,raw", CASES, ids=[f"{r[4:]}:{n}" for r, n, _ in CASES])
def test_every_malformed_input_gets_a_400_in_openai_shape(app, route, name, raw):
    r = httpx.post(app.url + route, content=raw.encode(), timeout=30,
                   headers={**app.headers, "Content-Type": "application/json"})
    assert_openai_error(r, 400)


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", ""])
def test_a_body_that_is_not_declared_json_gets_415(app, content_type):
    r = httpx.post(app.url + CMPL, content=json.dumps({"model": M, "prompt": "hi"}).encode(),
                   headers={**app.headers, "Content-Type": content_type}, timeout=30)
    assert_openai_error(r, 415)
    assert "application/json" in r.json()["error"]["message"]


def test_errors_name_the_field_and_the_fix(app):
    def error(raw):
        r = httpx.post(app.url + CMPL, content=raw.encode(), timeout=30,
                       headers={**app.headers, "Content-Type": "application/json"})
        return r.json()["error"]
    e = error(f'{{"model": "{M}", "prompt": "hi", "stop_token_ids": [99999999]}}')
    assert e["param"] == "stop_token_ids" and "[0, 49152)" in e["message"]
    e = error(f'{{"model": "{M}", "prompt": "hi", "temperature": NaN}}')
    assert "NaN is not a JSON number" in e["message"]
    e = error(f'{{"model": "{M}", "prompt": "hi", "temperature": 1e400}}')
    assert e["param"] == "temperature" and "finite" in e["message"]
    e = error(f'{{"model": "{M}", "prompt": ["ok", "\\ud800"]}}')
    assert e["param"] == "prompt.1" and "unpaired surrogate" in e["message"]
