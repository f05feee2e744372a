"""Requests as OpenAI's clients send them, over the in-process HTTP app (fake engines, no Ray):
the shapes OpenAI's API and vLLM's server accept must be accepted here too."""
from __future__ import annotations

import asyncio

import pytest

from local_fleet import LocalFleet, client_for, local_app

COMPLETION = {"model": "fake-model", "prompt": "a prompt", "max_tokens": 4, "ignore_eos": True}
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        "ignore_eos": True}


def send(method: str, path: str, **kwargs):
    fleet = LocalFleet()
    app, _ = local_app(fleet)

    async def main():
        async with client_for(app) as client:
            return await client.request(method, path, **kwargs)
    try:
        return asyncio.run(main())
    finally:
        fleet.shutdown()


# OpenAI's schema makes these nullable (null: the default); so does vLLM's
@pytest.mark.parametrize("path,body,field", [
    ("/v1/completions", COMPLETION, "n"),
    ("/v1/completions", COMPLETION, "echo"),
    ("/v1/chat/completions", CHAT, "n"),
    ("/v1/chat/completions", CHAT, "logprobs"),
    ("/v1/chat/completions", CHAT, "parallel_tool_calls"),
])
def test_null_for_a_nullable_field_means_its_default(path, body, field):
    r = send("POST", path, json={**body, field: None})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 1 and choices[0]["logprobs"] is None
