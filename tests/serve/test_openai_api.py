"""The OpenAI API end to end: the official client against the deployed app (default model)."""
from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_chat_completion_answers_paris(client, model_name):
    r = client.chat.completions.create(model=model_name, messages=QUESTION, max_tokens=12,
                                       temperature=0)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_stream_matches_non_stream_and_reports_usage(client, model_name):
    whole = client.chat.completions.create(model=model_name, messages=QUESTION, max_tokens=12,
                                           temperature=0)
    chunks = list(client.chat.completions.create(
        model=model_name, messages=QUESTION, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks
                if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_completion_stream_and_not(client, model_name):
    prompt = "The three primary colors are"
    whole = client.completions.create(model=model_name, prompt=prompt, max_tokens=8,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 8
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model_name, prompt=prompt, max_tokens=8, temperature=0, stream=True,
        extra_body={"ignore_eos": True}))
    assert streamed == whole.choices[0].text


def test_a_list_of_prompts_gives_one_choice_each(client, model_name):
    by_text = client.completions.create(model=model_name, prompt="Hello, my name is",
                                        max_tokens=4, temperature=0)
    batch = client.completions.create(model=model_name, prompt=["Hello, my name is", "One, two,"],
                                      max_tokens=4, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == by_text.choices[0].text
    assert batch.usage.prompt_tokens > by_text.usage.prompt_tokens


def test_token_id_prompt_gives_the_same_text_as_the_string(client, model_name, default_model_dir):
    from transformers import AutoTokenizer

    prompt = "The largest planet in the solar system is"
    ids = AutoTokenizer.from_pretrained(default_model_dir).encode(prompt)
    by_ids = client.completions.create(model=model_name, prompt=ids, max_tokens=6, temperature=0)
    by_text = client.completions.create(model=model_name, prompt=prompt, max_tokens=6,
                                        temperature=0)
    assert by_ids.usage.prompt_tokens == len(ids) == by_text.usage.prompt_tokens
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_n_returns_n_choices(client, model_name):
    r = client.chat.completions.create(model=model_name, messages=QUESTION, max_tokens=6, n=2,
                                       temperature=1.0, seed=7)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert all(c.message.content for c in r.choices)
    streamed = list(client.chat.completions.create(model=model_name, messages=QUESTION,
                                                   max_tokens=6, n=2, temperature=1.0, seed=7,
                                                   stream=True))
    for i in (0, 1):
        text = "".join(ch.delta.content or "" for c in streamed for ch in c.choices
                       if ch.index == i)
        assert text == r.choices[i].message.content


def test_seed_reproduces_the_text_across_calls(client, model_name):
    def sample():
        return client.completions.create(model=model_name, prompt="Once upon a time",
                                         max_tokens=10, temperature=1.0, seed=1234,
                                         extra_body={"ignore_eos": True}).choices[0].text
    assert sample() == sample()


def test_parallel_requests_all_complete(async_client, model_name):
    async def one(client, i):
        r = await client.completions.create(model=model_name, prompt=f"Fact number {i}:",
                                            max_tokens=6, temperature=0,
                                            extra_body={"ignore_eos": True})
        return r.usage.completion_tokens

    async def main():
        async with async_client() as client:
            return await asyncio.gather(*(one(client, i) for i in range(8)))
    assert asyncio.run(main()) == [6] * 8


def test_stop_string_and_logprobs(client, model_name):
    r = client.completions.create(model=model_name, prompt="1, 2, 3, 4,", max_tokens=12,
                                  temperature=0, logprobs=2, stop=[" 7"])
    choice = r.choices[0]
    assert " 7" not in choice.text
    assert len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs) > 0
    assert all(len(t) <= 2 for t in choice.logprobs.top_logprobs)
    chat = client.chat.completions.create(model=model_name, messages=QUESTION, max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert content and all(len(c.top_logprobs) == 2 for c in content)


def test_models_lists_the_model_with_max_model_len(app, model_name):
    data = httpx.get(f"{app.url}/v1/models", headers=app.headers).json()["data"]
    assert data[0]["id"] == model_name and data[0]["max_model_len"] == 1024


def test_health_is_open_and_ok(app):
    r = httpx.get(f"{app.url}/health")
    assert r.status_code == 200 and r.json()["workers_ready"] == 2


def test_response_names_the_worker(client, model_name):
    raw = client.completions.with_raw_response.create(model=model_name, prompt="Hi", max_tokens=1)
    assert raw.headers["x-raypaged-worker"] in ("worker-0", "worker-1")


def test_wrong_key_is_refused(app, model_name):
    bad = openai.OpenAI(base_url=f"{app.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=model_name, prompt="Hi", max_tokens=1)


def test_tokenize_counts_what_a_completion_and_a_chat_would_be_given(app, client, model_name):
    """vLLM's /tokenize and /detokenize: the counts agree with the usage the same prompt and
    conversation are billed, and the ids decode back to the prompt."""
    def post(path, body):
        return httpx.post(f"{app.url}{path}", json=body, headers=app.headers, timeout=60)

    prompt = "naïve café, 日本語"
    got = post("/tokenize", {"model": model_name, "prompt": prompt, "return_token_strs": True})
    assert got.status_code == 200, got.text
    body = got.json()
    billed = client.completions.create(model=model_name, prompt=prompt, max_tokens=1).usage
    assert body["count"] == len(body["tokens"]) == billed.prompt_tokens
    assert body["max_model_len"] == 1024 and len(body["token_strs"]) == body["count"]
    assert post("/detokenize", {"tokens": body["tokens"]}).json() == {"prompt": prompt}

    chat = post("/tokenize", {"model": model_name, "messages": QUESTION}).json()
    billed = client.chat.completions.create(model=model_name, messages=QUESTION,
                                            max_tokens=1).usage
    assert chat["count"] == billed.prompt_tokens and chat["token_strs"] is None
    without = post("/tokenize", {"messages": QUESTION, "add_generation_prompt": False}).json()
    assert without["tokens"] == chat["tokens"][:without["count"]] < chat["tokens"]


def test_tokenize_refuses_what_a_request_would_be_refused_naming_the_field(app):
    def error(path, body, headers=app.headers):
        r = httpx.post(f"{app.url}{path}", json=body, headers=headers, timeout=60)
        return r.status_code, r.json()["error"]["param"]

    assert error("/detokenize", {"tokens": [1, 49152]}) == (400, "tokens")
    assert error("/detokenize", {"tokens": [1] * 1025}) == (400, "tokens")
    assert error("/tokenize", {"prompt": 5}) == (400, "prompt")
    assert error("/tokenize", {"messages": []}) == (400, "messages")
    assert error("/tokenize", {"prompt": "hi", "model": "other"}) == (404, "model")
    assert error("/tokenize", {"prompt": "hi"}, headers={})[0] == 401


def test_continue_final_message_goes_on_with_the_assistants_prefill(app, client, model_name):
    """vLLM's continue_final_message: the final message is left open (no end of turn), so the
    model continues it; with add_generation_prompt also true it is a 400 naming the field."""
    prefill = [*QUESTION, {"role": "assistant", "content": "The capital of France is"}]
    shown = httpx.post(f"{app.url}/tokenize", headers=app.headers, timeout=60, json={
        "messages": prefill, "add_generation_prompt": False, "continue_final_message": True})
    tokens = shown.json()["tokens"]
    closed = httpx.post(f"{app.url}/tokenize", headers=app.headers, timeout=60, json={
        "messages": prefill, "add_generation_prompt": False}).json()["tokens"]
    assert closed[:len(tokens)] == tokens and len(closed) > len(tokens)  # the end of turn, cut
    got = client.chat.completions.create(
        model=model_name, messages=prefill, max_tokens=3, temperature=0,
        extra_body={"add_generation_prompt": False, "continue_final_message": True})
    assert got.usage.prompt_tokens == len(tokens)
    assert "Paris" in got.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=model_name, messages=prefill, max_tokens=3,
                                       extra_body={"continue_final_message": True})
    assert refused.value.body["param"] == "continue_final_message"
