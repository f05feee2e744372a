"""What one request may ask, over real HTTP (uvicorn in a thread, fake engines, no Ray): each
limit refuses one past it with a 400 that names the field, the setting and its flag, before
anything is tokenized or queued; one at the limit is served."""
from __future__ import annotations

import time

import httpx
import pytest

from http_server import serving
from local_fleet import LocalFleet
from raypaged.serve.frontend import ModelInfo, OpenAIFrontend
from raypaged.serve.dispatch import Dispatcher
from raypaged.serve.config import ServeOptions
from raypaged.serve.http_app import build_http_app
from raypaged.serve.limits import RequestLimits
from raypaged.serve.metrics import RequestMetrics, render
from raypaged.serve.routing import Router

LIMITS = RequestLimits(max_prompts_per_request=3, max_n=2, max_request_output_tokens=48,
                       max_stop_strings=2, max_stop_string_chars=6, max_stop_token_ids=3,
                       max_logprobs=2, max_messages=3, max_content_parts=3)
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
USER = {"role": "user", "content": "hi"}
PART = {"type": "text", "text": "hi"}


class CountingTokenizer:
    """The fake engine's tokenizer, counting what it is asked to tokenize or render."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __len__(self):
        return len(self.inner)

    def encode(self, *a, **kw):
        self.calls += 1
        return self.inner.encode(*a, **kw)

    def apply_chat_template(self, *a, **kw):
        self.calls += 1
        return self.inner.apply_chat_template(*a, **kw)


def make_app(fleet: LocalFleet, limits: RequestLimits = LIMITS, **http):
    metrics = RequestMetrics()
    engine = next(iter(fleet.workers.values())).engine
    info = ModelInfo("fake-model", engine.max_model_len, len(engine.tokenizer), 0)
    tokenizer = CountingTokenizer(engine.tokenizer)
    frontend = OpenAIFrontend(Dispatcher(fleet, Router(ServeOptions(), engine.block_size),
                                         metrics), tokenizer, info, limits=limits,
                              request_timeout_s=http.pop("request_timeout_s", None))
    app = build_http_app(frontend, fleet.snapshot, metrics,
                         lambda: render(fleet.snapshot(), metrics.snapshot(), info.name),
                         None, 8 << 20, **http)
    return app, tokenizer


@pytest.fixture(scope="module")
def server():
    fleet = LocalFleet()
    app, tokenizer = make_app(fleet)
    with serving(app) as url:
        yield url, tokenizer, fleet
    fleet.shutdown()


# (what, path, body past the limit, the setting named, the same body at the limit)
CASES = [
    ("prompts", CMPL, {"prompt": ["a", "b", "c", "d"], "max_tokens": 2},
     "max_prompts_per_request", {"prompt": ["a", "b", "c"], "max_tokens": 2}),
    ("token-list prompts", CMPL, {"prompt": [[97], [98], [99], [100]], "max_tokens": 2},
     "max_prompts_per_request", {"prompt": [[97], [98], [99]], "max_tokens": 2}),
    ("n", CMPL, {"prompt": "a", "n": 3, "max_tokens": 2}, "max_n",
     {"prompt": "a", "n": 2, "max_tokens": 2}),
    ("n x max_tokens", CMPL, {"prompt": "a", "n": 2, "max_tokens": 25},
     "max_request_output_tokens", {"prompt": "a", "n": 2, "max_tokens": 24}),
    ("prompts x n x max_tokens", CMPL, {"prompt": ["a", "b", "c"], "n": 2, "max_tokens": 9},
     "max_request_output_tokens", {"prompt": ["a", "b", "c"], "n": 2, "max_tokens": 8}),
    ("chat n x max_completion_tokens", CHAT,
     {"messages": [USER], "n": 2, "max_completion_tokens": 25}, "max_request_output_tokens",
     {"messages": [USER], "n": 2, "max_completion_tokens": 24}),
    ("max_tokens unset", CMPL, {"prompt": "a", "max_tokens": None},
     "max_request_output_tokens", {"prompt": "a", "max_tokens": 48}),
    ("stop strings", CMPL, {"prompt": "a", "stop": ["x", "y", "z"], "max_tokens": 2},
     "max_stop_strings", {"prompt": "a", "stop": ["x", "y"], "max_tokens": 2}),
    ("stop string length", CMPL, {"prompt": "a", "stop": "abcdefg", "max_tokens": 2},
     "max_stop_string_chars", {"prompt": "a", "stop": "abcdef", "max_tokens": 2}),
    ("stop string length in a list", CHAT,
     {"messages": [USER], "stop": ["a", "abcdefg"], "max_tokens": 2}, "max_stop_string_chars",
     {"messages": [USER], "stop": ["a", "abcdef"], "max_tokens": 2}),
    ("stop_token_ids", CMPL, {"prompt": "a", "stop_token_ids": [1, 2, 3, 4], "max_tokens": 2},
     "max_stop_token_ids", {"prompt": "a", "stop_token_ids": [1, 2, 3], "max_tokens": 2}),
    ("logprobs", CMPL, {"prompt": "a", "logprobs": 3, "max_tokens": 2}, "max_logprobs",
     {"prompt": "a", "logprobs": 2, "max_tokens": 2}),
    ("top_logprobs", CHAT, {"messages": [USER], "logprobs": True, "top_logprobs": 3,
                            "max_tokens": 2}, "max_logprobs",
     {"messages": [USER], "logprobs": True, "top_logprobs": 2, "max_tokens": 2}),
    ("messages", CHAT, {"messages": [USER] * 4, "max_tokens": 2}, "max_messages",
     {"messages": [USER] * 3, "max_tokens": 2}),
    ("content parts", CHAT, {"messages": [{"role": "user", "content": [PART] * 2}] * 2,
                             "max_tokens": 2}, "max_content_parts",
     {"messages": [{"role": "user", "content": [PART] * 2}, USER,
                   {"role": "user", "content": [PART]}], "max_tokens": 2}),
]


@pytest.mark.parametrize("what,path,over,setting,at", CASES, ids=[c[0] for c in CASES])
def test_a_request_past_a_limit_gets_a_400_naming_the_setting(server, what, path, over,
                                                               setting, at):
    url, tokenizer, fleet = server
    before = tokenizer.calls
    r = httpx.post(url + path, json={"model": "fake-model", **over}, timeout=30)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert setting in message and "--" + setting.replace("_", "-") in message, message
    if what != "max_tokens unset":  # that one is known only once the prompt is tokens
        assert tokenizer.calls == before, "refused before tokenizing"
    r = httpx.post(url + path, json={"model": "fake-model", **at}, timeout=30)
    assert r.status_code == 200, r.text


def test_twenty_thousand_prompts_are_refused_at_once_with_nothing_queued():
    """The probe's request that hung the service: 20,000 one-token prompts, default limits."""
    fleet = LocalFleet()
    app, tokenizer = make_app(fleet, RequestLimits())
    body = {"model": "fake-model", "prompt": [[97]] * 20_000, "max_tokens": 1}
    try:
        with serving(app) as url:
            start = time.monotonic()
            r = httpx.post(url + CMPL, json=body, timeout=30)
            took = time.monotonic() - start
    finally:
        fleet.shutdown()
    assert r.status_code == 400 and "max_prompts_per_request" in r.text
    assert took < 1.0
    assert tokenizer.calls == 0
    assert all(w.engine.stats().num_waiting + w.engine.stats().num_running == 0
               for w in fleet.workers.values())


def test_a_token_list_prompt_longer_than_the_context_is_refused_before_validation(server):
    url, _, _ = server
    r = httpx.post(url + CMPL, json={"model": "fake-model", "prompt": [1] * 300_000}, timeout=30)
    assert r.status_code == 400 and "maximum context length is 256" in r.text
