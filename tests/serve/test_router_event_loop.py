"""The router's event loop never waits on tokenization: /health keeps answering while
multi-megabyte prompts are being tokenized (here by the real model's tokenizer)."""
from __future__ import annotations

import asyncio

from transformers import AutoTokenizer

from local_fleet import LocalFleet, client_for
from raypaged.serve.frontend import ModelInfo, OpenAIFrontend
from raypaged.serve.dispatch import Dispatcher
from raypaged.serve.http_app import build_http_app
from raypaged.serve.metrics import RequestMetrics, render
from raypaged.serve.config import ServeOptions
from raypaged.serve.routing import Router


def test_health_answers_while_big_prompts_are_tokenized(default_model_dir):
    fleet = LocalFleet()
    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir))
    metrics = RequestMetrics()
    # a max_model_len whose byte bound (64K x 81 bytes) lets 3 MB through to the tokenizer
    info = ModelInfo("fake-model", 64 * 1024, len(tokenizer), 0)
    frontend = OpenAIFrontend(Dispatcher(fleet, Router(ServeOptions(), 16), metrics), tokenizer,
                              info)
    app = build_http_app(frontend, fleet.snapshot, metrics,
                         lambda: render(fleet.snapshot(), metrics.snapshot(), info.name),
                         None, 64 << 20)
    big = {"model": "fake-model", "prompt": "hello world, this is a prompt. " * 100_000}  # 3 MB
    assert len(big["prompt"]) < (info.max_model_len - 1) * frontend.max_token_bytes

    async def main():
        async with client_for(app) as client:
            prompts = [asyncio.create_task(client.post("/v1/completions", json=big))
                       for _ in range(4)]
            await asyncio.sleep(0.05)  # the bodies are in; tokenization has started
            answered = 0
            while not all(p.done() for p in prompts):
                r = await client.get("/health")
                assert r.status_code == 200
                answered += 1
                await asyncio.sleep(0.05)
            statuses = [p.result().status_code for p in prompts]
            return answered, statuses

    try:
        answered, statuses = asyncio.run(main())
    finally:
        fleet.shutdown()
    # the prompts are far over max_model_len: refused after tokenizing, as they should be
    assert statuses == [400] * 4
    # with tokenization on the event loop, /health could not answer until all four were done
    assert answered >= 3


class CountingTokenizer:
    """The real tokenizer, recording each call that tokenizes or renders a chat template."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __len__(self) -> int:
        return len(self.inner)

    def encode(self, text, **kwargs):
        self.calls.append("encode")
        return self.inner.encode(text, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        self.calls.append("apply_chat_template")
        return self.inner.apply_chat_template(*args, **kwargs)


# The default model's longest token is a newline and 80 spaces (test_prompt_bound): at
# max_model_len 1024 a prompt of more than 1023 x 81 bytes cannot fit.
LIMIT, MAX_TOKEN_BYTES = 1024, 81
BOUND = (LIMIT - 1) * MAX_TOKEN_BYTES


def post(default_model_dir, route: str, body: dict):
    fleet = LocalFleet()
    tokenizer = CountingTokenizer(AutoTokenizer.from_pretrained(str(default_model_dir)))
    metrics = RequestMetrics()
    info = ModelInfo("fake-model", LIMIT, len(tokenizer), 0)
    frontend = OpenAIFrontend(Dispatcher(fleet, Router(ServeOptions(), 16), metrics), tokenizer,
                              info)
    assert frontend.max_token_bytes == MAX_TOKEN_BYTES
    app = build_http_app(frontend, fleet.snapshot, metrics, lambda: b"", None, 8 << 20)

    async def main():
        async with client_for(app) as client:
            return await client.post(route, json=body)

    try:
        reply = asyncio.run(main())
    finally:
        fleet.shutdown()
    return reply, tokenizer


def unfittable(size: int, param: str) -> dict:
    return {"error": {
        "message": f"This model's maximum context length is {LIMIT} tokens, but the prompt is "
                   f"{size} bytes, so at least {-(-size // MAX_TOKEN_BYTES)} tokens (no token "
                   f"covers more than {MAX_TOKEN_BYTES} bytes): shorten it to at most "
                   f"{LIMIT - 1} tokens",
        "type": "invalid_request_error", "param": param, "code": "invalid_request"}}


def test_a_prompt_too_long_to_fit_is_refused_without_tokenizing(default_model_dir):
    reply, tokenizer = post(default_model_dir, "/v1/completions",
                            {"prompt": "a" * (BOUND + 1), "max_tokens": 1})
    assert (reply.status_code, reply.json()) == (400, unfittable(BOUND + 1, "prompt"))
    assert tokenizer.calls == []
    # bytes, not characters: 2-byte characters, half as many
    reply, tokenizer = post(default_model_dir, "/v1/completions",
                            {"prompt": "é" * (BOUND // 2 + 1), "max_tokens": 1})
    assert (reply.status_code, reply.json()) == (400, unfittable(BOUND + 1, "prompt"))
    assert tokenizer.calls == []
    # one unfittable prompt in a list: refused before any of them is tokenized
    reply, tokenizer = post(default_model_dir, "/v1/completions",
                            {"prompt": ["hi", "a" * (BOUND + 1)], "max_tokens": 1})
    assert (reply.status_code, reply.json()) == (400, unfittable(BOUND + 1, "prompt"))
    assert tokenizer.calls == []


def test_a_prompt_at_the_bound_is_tokenized_and_refused_by_its_token_count(default_model_dir):
    text = "a" * BOUND
    reply, tokenizer = post(default_model_dir, "/v1/completions",
                            {"prompt": text, "max_tokens": 1})
    count = len(tokenizer.inner.encode(text))
    assert tokenizer.calls == ["encode"]
    assert (reply.status_code, reply.json()["error"]["message"]) == (
        400, f"This model's maximum context length is {LIMIT} tokens, but the prompt is "
             f"{count} tokens: shorten it to at most {LIMIT - 1} tokens")


def test_a_prompt_that_fits_is_answered(default_model_dir):
    reply, tokenizer = post(default_model_dir, "/v1/completions",
                            {"prompt": "hi there", "max_tokens": 2})
    assert reply.status_code == 200
    assert tokenizer.calls == ["encode"]
    assert reply.json()["usage"] == {"prompt_tokens": 2, "completion_tokens": 2,
                                     "total_tokens": 4,
                                     "prompt_tokens_details": {"cached_tokens": 0}}


def chat_body(content: str) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 1}


def test_a_conversation_too_long_to_fit_is_refused_after_templating_without_tokenizing(
        default_model_dir):
    # the rendered text is measured (a template may trim contents): find its fixed part
    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir))
    fixed = len(tokenizer.apply_chat_template(chat_body("")["messages"], tokenize=False,
                                              add_generation_prompt=True).encode())
    reply, counting = post(default_model_dir, "/v1/chat/completions",
                           chat_body("a" * (BOUND + 1 - fixed)))
    assert (reply.status_code, reply.json()) == (400, unfittable(BOUND + 1, "messages"))
    assert counting.calls == ["apply_chat_template"]
    reply, counting = post(default_model_dir, "/v1/chat/completions",
                           chat_body("a" * (BOUND - fixed)))
    assert counting.calls == ["apply_chat_template", "encode"]
    assert reply.status_code == 400
    assert "tokens: shorten it to at most 1023 tokens" in reply.json()["error"]["message"]
