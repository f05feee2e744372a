"""A worker that dies or freezes mid-request costs the client nothing: the request goes on on
another worker from the tokens already sent, and the client gets exactly what an uninterrupted
run gives (fake engines, no Ray: the failures are staged on cue)."""
from __future__ import annotations

import json
import time

import pytest

from local_fleet import FROZEN, FROZEN_MID_STREAM, MID_STREAM, LocalFleet, post_once

GREEDY = {"model": "fake-model", "prompt": "a prompt long enough for a block or two of bytes",
          "max_tokens": 12, "ignore_eos": True, "temperature": 0}
SEEDED_N3 = {**GREEDY, "temperature": 1.0, "seed": 7, "n": 3}


def run(fleet: LocalFleet, body: dict, path: str = "/v1/completions"):
    return post_once(fleet, body, path)


def stream_text(r) -> dict[int, str]:
    """Choice index -> the concatenated text deltas of an SSE response."""
    texts: dict[int, str] = {}
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            for c in json.loads(line[6:])["choices"]:
                texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    return texts


def home_of(body: dict) -> str:
    """The worker that gets this request when nothing fails (routing is deterministic)."""
    r, _ = run(LocalFleet(step_delay_s=0.005), body)
    return r.headers["x-raypaged-worker"]


def other(worker_id: str) -> str:
    return "worker-1" if worker_id == "worker-0" else "worker-0"


@pytest.mark.parametrize("body", [GREEDY, SEEDED_N3], ids=["greedy", "seeded_n3"])
@pytest.mark.parametrize("failure", [MID_STREAM, FROZEN_MID_STREAM])
def test_a_stream_continues_on_another_worker_with_the_uninterrupted_text(body, failure):
    body = {**body, "stream": True}
    clean, _ = run(LocalFleet(step_delay_s=0.005), body)
    fleet = LocalFleet(step_delay_s=0.005)
    home = clean.headers["x-raypaged-worker"]
    fleet.failing[home] = failure
    r, metrics = run(fleet, body)
    assert r.status_code == 200
    assert r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text
    assert stream_text(r) == stream_text(clean)
    assert all(len(t) == 12 for t in stream_text(r).values())
    assert metrics.counters["request_retries"] == {"": 1.0}
    assert metrics.counters["request_success"] == {"length": 1.0}
    assert fleet.workers[other(home)].stats().num_active == 0


@pytest.mark.parametrize("failure", [MID_STREAM, FROZEN_MID_STREAM])
def test_a_non_streaming_request_continues_elsewhere_and_names_the_worker_that_finished(failure):
    clean, _ = run(LocalFleet(step_delay_s=0.005), SEEDED_N3)
    home = clean.headers["x-raypaged-worker"]
    fleet = LocalFleet(step_delay_s=0.005)
    fleet.failing[home] = failure
    r, _ = run(fleet, SEEDED_N3)
    assert r.status_code == 200
    assert r.json()["choices"] == clean.json()["choices"]
    assert r.json()["usage"]["completion_tokens"] == 3 * 12
    assert r.json()["usage"]["prompt_tokens"] == clean.json()["usage"]["prompt_tokens"]
    assert r.headers["x-raypaged-worker"] == other(home)


def test_each_continuation_counts_the_blocks_of_its_one_sample_where_it_goes(monkeypatch):
    """The router counts each leg's KV blocks on its worker (Dispatcher.opened) and ranks the
    workers with room for it first (Dispatcher.rank): the first leg the whole request's, n = 3 samples; each sample
    carried on alone after the failover, one sample's, not the request's three."""
    from raypaged.core.fair_admission import blocks_needed
    from raypaged.serve.dispatch import Dispatcher

    placed = []
    real = Dispatcher.opened

    def record(self, worker_id, blocks=0, n=1):
        placed.append((worker_id, n * blocks))
        return real(self, worker_id, blocks, n)
    monkeypatch.setattr(Dispatcher, "opened", record)
    ranked, real_rank = [], Dispatcher.rank

    def rank(self, tokens, cache_salt, exclude, blocks, count):
        ranked.append(blocks)
        return real_rank(self, tokens, cache_salt, exclude, blocks, count)
    monkeypatch.setattr(Dispatcher, "rank", rank)
    home = home_of(SEEDED_N3)
    placed.clear()
    ranked.clear()
    fleet = LocalFleet(step_delay_s=0.005)
    fleet.failing[home] = MID_STREAM
    block_size = fleet.workers[home].stats().block_size
    r, _ = run(fleet, SEEDED_N3)
    prompt = r.json()["usage"]["prompt_tokens"]
    whole, one = (blocks_needed(prompt, 12, n, block_size, 0) for n in (3, 1))
    assert [b for _, b in placed if b > 0] == [whole, one, one, one]
    assert ranked == [whole, one, one, one]  # room_first weighs each leg as it will be placed
    assert {w for w, b in placed if b == one} == {other(home)}
    assert sum(b for _, b in placed) == 0  # every leg given back


def test_a_worker_frozen_before_its_first_token_is_left_for_another():
    home = home_of(GREEDY)
    fleet = LocalFleet(step_delay_s=0.005)
    fleet.failing[home] = FROZEN
    started = time.monotonic()
    r, metrics = run(fleet, GREEDY)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 12
    assert r.headers["x-raypaged-worker"] == other(home)
    assert time.monotonic() - started < 5
    assert metrics.counters["request_retries"] == {"": 1.0}


def test_a_stop_string_and_min_tokens_hold_across_the_failover():
    body = {**GREEDY, "stream": True, "max_tokens": 40, "min_tokens": 20, "ignore_eos": False}
    clean, _ = run(LocalFleet(step_delay_s=0.005), body)
    stop = stream_text(clean)[0][5:8]  # three letters first seen after the failover point
    body["stop"] = [stop]
    clean, _ = run(LocalFleet(step_delay_s=0.005), body)
    fleet = LocalFleet(step_delay_s=0.005)
    fleet.failing[clean.headers["x-raypaged-worker"]] = MID_STREAM
    r, _ = run(fleet, body)
    assert stream_text(r) == stream_text(clean)
    assert stop not in stream_text(r)[0] and '"finish_reason": "stop"' in r.text


def test_per_sample_inter_token_latency_is_not_divided_by_n():
    body = {**GREEDY, "n": 4, "temperature": 1.0, "seed": 3, "max_tokens": 6}
    r, metrics = run(LocalFleet(step_delay_s=0.02), body)
    assert r.status_code == 200
    buckets, total = metrics.histograms["inter_token_latency_seconds"]
    count = sum(buckets)
    assert count == 4 * 5  # 5 gaps per sample
    assert total / count >= 0.015  # each gap is a step (20 ms), not a quarter of one


def test_a_sample_refused_on_failover_leaves_no_other_sample_opening_behind():
    """n = 2, the worker dies mid-stream, the other takes one continuation and then has a full
    queue: the stream ends with 503 queue_full, and nothing of it goes on on the router."""
    import asyncio

    from local_fleet import client_for, local_app

    body = {**SEEDED_N3, "n": 2, "max_tokens": 30, "stream": True}
    home = home_of({**body, "stream": False})
    fleet = LocalFleet(step_delay_s=0.005)
    fleet.failing[home] = MID_STREAM
    spare = fleet.workers[other(home)]
    spare.bound.full = lambda: spare.bound.count >= 1  # room for one request
    app, _ = local_app(fleet)

    async def main():
        async with client_for(app) as client:
            r = await client.post("/v1/completions", json=body)
            await asyncio.sleep(1.0)
            return r, [t.get_coro().__qualname__ for t in asyncio.all_tasks()
                       if t is not asyncio.current_task()]
    try:
        r, left = asyncio.run(main())
    finally:
        fleet.shutdown()
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "queue_full"
    assert [name for name in left if name.startswith("Generation")] == []
    assert spare.stats().num_active == 0


def test_a_stream_failing_over_to_a_slow_worker_still_ends_at_its_deadline():
    """The continuation's first token is 4 s away on the worker it moved to: the stream ends at
    its 1 s deadline, as it would on the worker it started on, and leaves that worker."""
    import asyncio

    from local_fleet import client_for, local_app
    from raypaged.serve.config import ServeOptions

    body = {**GREEDY, "max_tokens": 30, "stream": True}
    home = home_of({**body, "stream": False})
    fleet = LocalFleet(step_delay_s=0.005)
    fleet.failing[home] = MID_STREAM
    spare = fleet.workers[other(home)]
    execute = spare.engine.core.runner.execute

    def slow(batch):
        time.sleep(4.0)
        return execute(batch)
    spare.engine.core.runner.execute = slow
    app, _ = local_app(fleet, options=ServeOptions(request_timeout_s=1.0))

    async def main():
        async with client_for(app) as client:
            start = time.monotonic()
            r = await client.post("/v1/completions", json=body)
            return r, time.monotonic() - start, spare.stats().num_active
    try:
        r, took, active = asyncio.run(main())
    finally:
        fleet.shutdown()
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "request_timeout"
    assert 1.0 <= took < 2.5
    assert active == 0
