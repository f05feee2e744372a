"""The router's event loop never waits on tokenization: /health keeps answering while
multi-megabyte prompts are being tokenized (here by the real model's tokenizer)."""
from __future__ import annotations

import asyncio

from transformers import AutoTokenizer

from local_fleet import LocalFleet, client_for
from raypaged.serve.frontend import ModelInfo, OpenAIFrontend
from raypaged.serve.generation import Dispatcher
from raypaged.serve.http_app import build_http_app
from raypaged.serve.metrics import RequestMetrics, render
from raypaged.serve.config import ServeOptions
from raypaged.serve.routing import Router


def test_health_answers_while_big_prompts_are_tokenized(default_model_dir):
    fleet = LocalFleet()
    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir))
    metrics = RequestMetrics()
    info = ModelInfo("fake-model", 1024, len(tokenizer), 0)
    frontend = OpenAIFrontend(Dispatcher(fleet, Router(ServeOptions(), 16), metrics), tokenizer,
                              info)
    app = build_http_app(frontend, fleet.snapshot, metrics,
                         lambda: render(fleet.snapshot(), metrics.snapshot(), info.name),
                         None, 64 << 20)
    big = {"model": "fake-model", "prompt": "hello world, this is a prompt. " * 100_000}  # 3 MB

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
