"""The HTTP layer over an in-process fleet (fake engines, no Ray): retries, queue limits, stream
errors — the cases that are hard to stage on a real cluster on cue."""
from __future__ import annotations

import asyncio
import json
import re

import pytest

from local_fleet import BEFORE_FIRST, MID_STREAM, LocalFleet, client_for, local_app
from local_fleet import run_against as run
from raypaged.serve.failover import MAX_FAILOVERS

BODY = {"model": "fake-model", "prompt": "a prompt long enough for a block or two of bytes",
        "max_tokens": 8, "ignore_eos": True}


def preferred_worker(fleet: LocalFleet) -> str:
    async def ask(client):
        return (await client.post("/v1/completions", json=BODY)).headers["x-raypaged-worker"]
    return run(fleet, ask)[0]


def other(worker_id: str) -> str:
    return "worker-1" if worker_id == "worker-0" else "worker-0"


def test_a_worker_gone_before_the_first_token_is_retried_on_the_next_one():
    home = preferred_worker(LocalFleet())
    fleet = LocalFleet()
    fleet.failing[home] = BEFORE_FIRST
    r, metrics = run(fleet, lambda c: c.post("/v1/completions", json=BODY))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    assert r.headers["x-raypaged-worker"] == other(home)
    assert metrics.counters["request_retries"] == {"": 1.0}


def test_a_request_gives_up_with_503_after_max_failovers():
    fleet = LocalFleet(n=MAX_FAILOVERS + 1)
    fleet.failing.update({w: BEFORE_FIRST for w in fleet.workers})
    r, metrics = run(fleet, lambda c: c.post("/v1/completions", json=BODY))
    assert r.status_code == 503 and r.headers["retry-after"]
    assert r.json()["error"]["code"] == "worker_unavailable"
    assert r.headers["x-raypaged-worker"] in fleet.workers  # the last worker it tried
    assert metrics.counters["request_retries"] == {"": float(MAX_FAILOVERS)}


def test_a_stream_whose_every_worker_dies_ends_with_an_error_event_then_done():
    fleet = LocalFleet(n=MAX_FAILOVERS + 1, step_delay_s=0.01)
    fleet.failing.update({w: MID_STREAM for w in fleet.workers})
    r, _ = run(fleet, lambda c: c.post("/v1/completions", json={**BODY, "stream": True}))
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    # the second worker that dies with it accepted refuses it (test_worker_lifecycle.py)
    assert json.loads(events[-2])["error"]["code"] == "suspected_poison_request"
    assert all("choices" in json.loads(e) for e in events[:-2])
    assert all(w.stats().num_active == 0 for w in fleet.workers.values())


def full(worker) -> None:
    """As if max_queued requests were waiting for its KV space (Worker tests cover when)."""
    worker.bound.full = lambda: True


def test_full_queues_everywhere_give_503_with_retry_after():
    fleet = LocalFleet()
    for w in fleet.workers.values():
        full(w)
    r, metrics = run(fleet, lambda c: c.post("/v1/completions", json=BODY))
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "queue_full"
    assert metrics.counters["request_errors"] == {"503": 1.0}


def test_one_full_queue_sends_the_request_to_the_other_worker():
    fleet = LocalFleet()
    home = preferred_worker(LocalFleet())
    full(fleet.workers[home])
    r, _ = run(fleet, lambda c: c.post("/v1/completions", json=BODY))
    assert r.status_code == 200 and r.headers["x-raypaged-worker"] == other(home)


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {**BODY, "prompt": ["first prompt here", "second prompt here"], "n": 2}),
    ("/v1/chat/completions", {"model": "fake-model", "max_tokens": 4, "n": 3,
                              "messages": [{"role": "user", "content": "hi"}]}),
])
def test_choices_are_indexed_prompt_major_then_sample(path, body):
    r, _ = run(LocalFleet(), lambda c: c.post(path, json=body))
    indexes = [c["index"] for c in r.json()["choices"]]
    assert indexes == list(range(len(indexes))) and len(indexes) in (3, 4)


def test_a_completion_of_several_prompts_has_one_id_streamed_or_not():
    """vLLM's and OpenAI's shape: the response is named once ("cmpl-<hex>"); the per-prompt
    generations' "-<i>" names stay inside the server."""
    body = {**BODY, "prompt": ["first prompt here", "second prompt here"], "max_tokens": 2}

    async def both(client):
        whole = (await client.post("/v1/completions", json=body)).json()["id"]
        stream = await client.post("/v1/completions", json={**body, "stream": True})
        ids = {json.loads(line[6:])["id"] for line in stream.text.splitlines()
               if line.startswith("data: {")}
        return whole, ids
    (whole, streamed), _ = run(LocalFleet(), both)
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", whole)
    assert len(streamed) == 1 and re.fullmatch(r"cmpl-[0-9a-f]{32}", streamed.pop())


def test_truncate_prompt_tokens_keeps_each_prompts_last_k_tokens_as_vllm_does():
    """One token per byte here (max_model_len 256): a 600-byte prompt, and a chat, with
    truncate_prompt_tokens k are served from their last k tokens; without it the prompt is a
    400, and k past max_model_len (or 0) a 400 naming the field."""
    long = "x" * 590 + "0123456789"

    async def ask(client):
        post = client.post
        cut = await post("/v1/completions", json={**BODY, "prompt": [long, "short"],
                                                  "truncate_prompt_tokens": 20})
        ids = await post("/v1/completions", json={**BODY, "prompt": [65] * 299,
                                                  "truncate_prompt_tokens": 7})
        chat = await post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": long}], "max_tokens": 2,
            "truncate_prompt_tokens": 30})
        whole = await post("/v1/completions", json={**BODY, "prompt": long})
        too_many = await post("/v1/completions", json={**BODY, "truncate_prompt_tokens": 257})
        zero = await post("/v1/completions", json={**BODY, "truncate_prompt_tokens": 0})
        return cut, ids, chat, whole, too_many, zero
    (cut, ids, chat, whole, too_many, zero), _ = run(LocalFleet(), ask)
    assert cut.status_code == 200, cut.text
    assert cut.json()["usage"]["prompt_tokens"] == 20 + len("short")
    assert ids.status_code == 200, ids.text
    assert ids.json()["usage"]["prompt_tokens"] == 7
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens"] == 30
    assert whole.status_code == 400 and whole.json()["error"]["param"] == "prompt"
    for refused in (too_many, zero):
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "truncate_prompt_tokens"


def test_a_model_is_retrieved_by_its_id_an_unknown_one_is_404_a_wrong_method_405_with_allow():
    async def ask(client):
        listed = (await client.get("/v1/models")).json()["data"][0]
        one = await client.get(f"/v1/models/{listed['id']}")
        unknown = await client.get("/v1/models/org/other-model")  # a slash in the id
        wrong = await client.get("/v1/completions")  # a 405 says what the route takes
        assert (wrong.status_code, wrong.headers.get("allow")) == (405, "POST")
        return listed, one, unknown
    (listed, one, unknown), _ = run(LocalFleet(), ask)
    assert one.status_code == 200 and one.json() == listed
    assert unknown.status_code == 404
    assert unknown.json()["error"] == {
        "message": f"The model `org/other-model` does not exist; this server serves "
                   f"`{listed['id']}`", "type": "not_found_error", "param": "model",
        "code": "model_not_found"}


def test_api_key_guards_the_api_but_not_health_or_metrics():
    fleet = LocalFleet()
    app, _ = local_app(fleet, api_key="sekrit")

    async def main():
        async with client_for(app) as c:
            assert (await c.post("/v1/completions", json=BODY)).status_code == 401
            assert (await c.get("/v1/models")).status_code == 401
            assert (await c.get("/v1/models/any")).status_code == 401
            assert (await c.get("/fleet")).status_code == 401
            assert (await c.get("/health")).status_code == 200
            assert (await c.get("/metrics")).status_code == 200
            ok = await c.post("/v1/completions", json=BODY,
                              headers={"Authorization": "Bearer sekrit"})
            assert ok.status_code == 200
    try:
        asyncio.run(main())
    finally:
        fleet.shutdown()


def test_continuous_usage_stats_puts_the_running_usage_on_every_chunk():
    async def stream(client):
        body = {**BODY, "stream": True, "stream_options": {"include_usage": True,
                                                            "continuous_usage_stats": True}}
        r = await client.post("/v1/completions", json=body)
        return [json.loads(line[6:]) for line in r.text.splitlines()
                if line.startswith("data: {")]
    chunks, _ = run(LocalFleet(), stream)
    token_chunks = [c for c in chunks if c["choices"]]
    assert token_chunks and all("usage" in c for c in token_chunks)
    completion = [c["usage"]["completion_tokens"] for c in token_chunks]
    assert completion == sorted(completion) and completion[-1] == 8
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8


def test_a_poisoned_request_fails_alone_with_400_and_nobody_else_notices():
    from fake_engine import POISON_SEED

    fleet = LocalFleet(step_delay_s=0.005)
    good = {**BODY, "max_tokens": 20}

    async def burst(client):
        home = (await client.post("/v1/completions", json=BODY)).headers["x-raypaged-worker"]
        streams = [client.post("/v1/completions", json={**good, "stream": True})
                   for _ in range(3)]
        plain = [client.post("/v1/completions", json=good) for _ in range(3)]
        poison = client.post("/v1/completions", json={**BODY, "seed": POISON_SEED})
        rs = await asyncio.gather(*streams, *plain, poison)
        after = await client.post("/v1/completions", json=BODY)  # the same prefix: same worker
        return home, rs, after

    (home, rs, after), metrics = run(fleet, burst)
    *others, poison = rs
    assert poison.status_code == 400
    assert "the request failed in the engine: IndexError" in poison.json()["error"]["message"]
    for r in others[:3]:
        chunks = [json.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: {")]
        assert "error" not in r.text and r.text.rstrip().endswith("data: [DONE]")
        assert sum(len(c["choices"][0]["text"]) for c in chunks if c["choices"]) == 20
    assert [r.status_code for r in others[3:]] == [200] * 3
    assert all(r.json()["usage"]["completion_tokens"] == 20 for r in others[3:])
    # not the worker's fault: never retried elsewhere, and the worker is not avoided after
    assert not metrics.counters.get("request_retries")
    assert after.status_code == 200 and after.headers["x-raypaged-worker"] == home


def test_a_client_leaving_mid_stream_through_serve_is_an_abort_not_a_500():
    """Serve's proxy cancels the task behind `receive` when a client leaves; the app must end
    the stream as a disconnect: no 500 counted, no exception escaping to Serve's replica."""
    from ray.exceptions import TaskCancelledError

    fleet = LocalFleet(step_delay_s=0.01)
    app, metrics = local_app(fleet)
    body = json.dumps({"prompt": "hello there", "max_tokens": 200, "ignore_eos": True,
                       "stream": True}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "server": ("local", 80),
             "client": ("local", 1), "headers": [(b"content-type", b"application/json"),
                                                  (b"content-length", str(len(body)).encode())]}
    sent = []

    async def run():
        first = True
        events = asyncio.Event()

        async def receive():
            nonlocal first
            if first:
                first = False
                return {"type": "http.request", "body": body, "more_body": False}
            await events.wait()  # the client is there until it has seen a few events
            raise TaskCancelledError()

        async def send(message):
            sent.append(message)
            if sum(m.get("body", b"").count(b"data: ") for m in sent) >= 3:
                events.set()

        await asyncio.wait_for(app(scope, receive, send), 10)

    try:
        asyncio.run(run())
    finally:
        fleet.shutdown()
    assert sent[0]["status"] == 200
    assert metrics.counters["request_errors"] == {}
    assert metrics.counters["request_success"] == {"abort": 1.0}
    assert all(w.stats().num_active == 0 for w in fleet.workers.values())


def fail_after(fleet: LocalFleet, marker: bytes, tokens: int) -> None:
    """Every step of a request whose prompt holds `marker` raises once it has `tokens` outputs
    (a request that breaks the engine mid-way: it fails alone, with a 400)."""
    mark = list(marker)
    for w in fleet.workers.values():
        runner = w.engine.core.runner
        execute = runner.execute

        def failing(batch, execute=execute):
            for sr in batch.requests:
                prompt = list(sr.prompt_token_ids)
                if (sr.num_samples and len(sr.output_token_ids) >= tokens
                        and any(prompt[i:i + len(mark)] == mark for i in range(len(prompt)))):
                    raise IndexError("index 99999999 is out of bounds")
            return execute(batch)
        runner.execute = failing


def test_a_prompt_failing_mid_way_ends_the_other_prompts_of_a_non_streaming_request():
    fleet = LocalFleet(n=1, step_delay_s=0.01)
    fail_after(fleet, b"BREAKS", 3)
    body = {**BODY, "prompt": ["a prompt that goes on", "a prompt that BREAKS"],
            "max_tokens": 100}

    async def post_then_look(client):
        r = await client.post("/v1/completions", json=body)
        await asyncio.sleep(1.0)  # the good prompt alone would still be running
        left = [t.get_coro().__qualname__ for t in asyncio.all_tasks()
                if t is not asyncio.current_task()]
        return r, left

    (r, left), _ = run(fleet, post_then_look)
    assert r.status_code == 400
    assert "the request failed in the engine: IndexError" in r.json()["error"]["message"]
    # nothing of the request is left on the router (its other prompt's generation included)
    assert [name for name in left if name.startswith("Generation")] == []
    assert fleet.workers["worker-0"].stats().num_active == 0


def test_streamed_logprobs_text_offsets_count_from_the_start_of_the_completion():
    """As vLLM and OpenAI: each token's offset in the choice's whole text, also when it comes
    in a later chunk (fake engine: one letter per token)."""
    body = {**BODY, "logprobs": 1, "n": 2, "temperature": 1.0, "seed": 5}

    async def both(client):
        whole = await client.post("/v1/completions", json=body)
        streamed = await client.post("/v1/completions", json={**body, "stream": True})
        return whole, streamed
    (whole, streamed), _ = run(LocalFleet(step_delay_s=0.005), both)
    offsets: dict[int, list[int]] = {0: [], 1: []}
    for line in streamed.text.splitlines():
        if line.startswith("data: {"):
            for c in json.loads(line[6:])["choices"]:
                offsets[c["index"]] += c["logprobs"]["text_offset"]
    assert offsets == {0: list(range(8)), 1: list(range(8))}
    assert [c["logprobs"]["text_offset"] for c in whole.json()["choices"]] == [
        list(range(8)), list(range(8))]

