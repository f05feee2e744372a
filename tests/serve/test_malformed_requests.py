"""Malformed requests: each gets its documented 4xx in OpenAI's error shape, and nobody else
notices (the fleet stays healthy, a good request still works)."""
from __future__ import annotations

import httpx
import pytest

from serve_testing import MAX_REQUEST_BYTES

M = "SmolLM2-135M-Instruct"
USER = [{"role": "user", "content": "hi"}]
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"

# (name, path, JSON body or raw bytes, expected status)
CASES = [
    ("body is not JSON", CMPL, b"{not json", 400),
    ("body is a JSON array", CMPL, [1, 2], 400),
    ("body is a JSON string", CHAT, "hello", 400),
    ("unknown model", CMPL, {"model": "gpt-17", "prompt": "hi"}, 404),
    ("unknown model (chat)", CHAT, {"model": "gpt-17", "messages": USER}, 404),
    ("missing prompt", CMPL, {"model": M}, 400),
    ("prompt is a number", CMPL, {"model": M, "prompt": 42}, 400),
    ("prompt is empty", CMPL, {"model": M, "prompt": ""}, 400),
    ("prompt is an empty list", CMPL, {"model": M, "prompt": []}, 400),
    ("prompt token id out of vocabulary", CMPL, {"model": M, "prompt": [1, 10_000_000]}, 400),
    ("negative prompt token id", CMPL, {"model": M, "prompt": [1, -5]}, 400),
    ("prompt longer than max_model_len", CMPL, {"model": M, "prompt": [1] * 1100}, 400),
    ("prompt + max_tokens over max_model_len", CMPL,
     {"model": M, "prompt": [1] * 1000, "max_tokens": 100}, 400),
    ("max_tokens zero", CMPL, {"model": M, "prompt": "hi", "max_tokens": 0}, 400),
    ("max_tokens negative", CMPL, {"model": M, "prompt": "hi", "max_tokens": -3}, 400),
    ("max_tokens a string", CMPL, {"model": M, "prompt": "hi", "max_tokens": "ten"}, 400),
    ("temperature negative", CMPL, {"model": M, "prompt": "hi", "temperature": -1}, 400),
    ("top_p zero", CMPL, {"model": M, "prompt": "hi", "top_p": 0}, 400),
    ("top_p above one", CMPL, {"model": M, "prompt": "hi", "top_p": 1.5}, 400),
    ("top_k negative", CMPL, {"model": M, "prompt": "hi", "top_k": -7}, 400),
    ("min_p above one", CMPL, {"model": M, "prompt": "hi", "min_p": 2}, 400),
    ("n zero", CMPL, {"model": M, "prompt": "hi", "n": 0}, 400),
    ("n too large", CMPL, {"model": M, "prompt": "hi", "n": 1000}, 400),
    ("stop with an empty string", CMPL, {"model": M, "prompt": "hi", "stop": [""]}, 400),
    ("stop a number", CMPL, {"model": M, "prompt": "hi", "stop": 5}, 400),
    ("logprobs above 20", CMPL, {"model": M, "prompt": "hi", "logprobs": 50}, 400),
    ("presence_penalty out of range", CMPL,
     {"model": M, "prompt": "hi", "presence_penalty": 3}, 400),
    ("frequency_penalty out of range", CMPL,
     {"model": M, "prompt": "hi", "frequency_penalty": -2.5}, 400),
    ("seed not an integer", CMPL, {"model": M, "prompt": "hi", "seed": "abc"}, 400),
    ("stream not a boolean", CMPL, {"model": M, "prompt": "hi", "stream": "yes please"}, 400),
    ("stream_options without stream", CMPL,
     {"model": M, "prompt": "hi", "stream_options": {"include_usage": True}}, 400),
    ("echo unsupported", CMPL, {"model": M, "prompt": "hi", "echo": True}, 400),
    ("cache_salt not a string", CMPL, {"model": M, "prompt": "hi", "cache_salt": 7}, 400),
    ("missing messages", CHAT, {"model": M}, 400),
    ("empty messages", CHAT, {"model": M, "messages": []}, 400),
    ("unknown role", CHAT, {"model": M, "messages": [{"role": "wizard", "content": "hi"}]}, 400),
    ("user message without content", CHAT, {"model": M, "messages": [{"role": "user"}]}, 400),
    ("message content a number", CHAT,
     {"model": M, "messages": [{"role": "user", "content": 3}]}, 400),
    ("image content part", CHAT, {"model": M, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, 400),
    ("top_logprobs without logprobs", CHAT, {"model": M, "messages": USER, "top_logprobs": 2}, 400),
    ("top_logprobs above 20", CHAT,
     {"model": M, "messages": USER, "logprobs": True, "top_logprobs": 99}, 400),
    ("tool_choice naming no tool given", CHAT, {
        "model": M, "messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}],
        "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400),
    ("json_schema response_format without a schema", CHAT,
     {"model": M, "messages": USER, "response_format": {"type": "json_schema"}}, 400),
    ("chat max_tokens over the context", CHAT,
     {"model": M, "messages": USER, "max_tokens": 5000}, 400),
    ("body over the size limit", CMPL, {"model": M, "prompt": "x" * (MAX_REQUEST_BYTES + 10)}, 413),
]


def send(app, path, body, headers=None, method="POST"):
    headers = {**app.headers, **(headers or {})}
    if isinstance(body, bytes):
        return httpx.request(method, app.url + path, content=body, timeout=30,
                             headers={**headers, "Content-Type": "application/json"})
    return httpx.request(method, app.url + path, json=body, headers=headers, timeout=30)


def assert_openai_error(r, status):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]


@pytest.mark.parametrize("name,path,body,status", CASES, ids=[c[0] for c in CASES])
def test_malformed_request_gets_its_4xx(app, name, path, body, status):
    assert_openai_error(send(app, path, body), status)


def test_there_are_at_least_30_kinds():
    assert len(CASES) >= 30


def test_long_prompt_error_names_the_limit(app):
    r = send(app, CMPL, {"model": M, "prompt": [1] * 1100})
    assert "1024" in r.json()["error"]["message"]


def test_invalid_parameter_error_names_the_parameter(app):
    r = send(app, CMPL, {"model": M, "prompt": "hi", "top_p": 7})
    assert r.json()["error"]["param"] == "top_p"


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "x"}])
def test_missing_or_wrong_key_is_401(app, headers):
    r = httpx.post(app.url + CMPL, json={"model": M, "prompt": "hi"}, headers=headers, timeout=30)
    assert_openai_error(r, 401)


def test_unknown_route_and_wrong_method(app):
    assert_openai_error(httpx.get(app.url + "/v1/nothing-here", headers=app.headers), 404)
    assert_openai_error(httpx.get(app.url + CMPL, headers=app.headers), 405)


def test_health_and_metrics_stay_open_and_the_fleet_unharmed(app, client):
    for _, path, body, _ in CASES:  # the whole barrage again
        send(app, path, body)
    assert httpx.get(app.url + "/health").status_code == 200
    assert httpx.get(app.url + "/metrics").status_code == 200
    assert all(w["state"] == "ready" and w["load"] == 0 for w in app.fleet()["workers"])
    r = client.completions.create(model=M, prompt="Hello", max_tokens=2)
    assert r.usage.completion_tokens >= 1
