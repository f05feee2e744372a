"""Worker failures on the real engine: requests and streams under way survive a worker's death
(they go on on the other worker), the worker comes back, and nothing hangs."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import ray

from fake_engine import FAKE_MODEL
from serve_testing import deploy


async def stream_lines(client: httpx.AsyncClient, url: str, body: dict, started: asyncio.Event,
                       box: dict) -> list[str]:
    lines = []
    async with client.stream("POST", url, json=body) as r:
        box["worker"] = r.headers["x-raypaged-worker"]
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                lines.append(line[6:])
                if len(lines) == 3:
                    started.set()
    return lines


def retries(app) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{app.url}/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text)
               if f.name == "raypaged:request_retries" for s in f.samples)


def test_killing_a_worker_mid_load_loses_no_request_and_the_fleet_recovers(
        app, model_name):
    restarts_before = {w["worker_id"]: w["restarts"] for w in app.fleet()["workers"]}
    retries_before = retries(app)

    async def scenario():
        async with httpx.AsyncClient(headers=app.headers, timeout=120) as client:
            url = f"{app.url}/v1/completions"
            started, box = asyncio.Event(), {}
            stream = asyncio.create_task(stream_lines(
                client, url, {"model": model_name, "prompt": "Tell me a long story.",
                              "max_tokens": 300, "ignore_eos": True, "stream": True,
                              "stream_options": {"include_usage": True}},
                started, box))
            await asyncio.wait_for(started.wait(), 60)
            victim = box["worker"]

            def ask(i):
                return client.post(url, json={"model": model_name, "prompt": f"Item {i} of a list:",
                                              "max_tokens": 24, "ignore_eos": True})
            before_kill = [asyncio.create_task(ask(i)) for i in range(8)]
            await asyncio.sleep(1.0)  # every one of them is routed and generating
            ray.kill(app.workers()[victim], no_restart=False)
            after_kill = [asyncio.create_task(ask(100 + i)) for i in range(4)]
            answers = await asyncio.wait_for(asyncio.gather(*before_kill, *after_kill), 120)
            lines = await asyncio.wait_for(stream, 60)
            return victim, answers, lines

    victim, answers, lines = asyncio.run(scenario())

    assert [r.status_code for r in answers] == [200] * 12, [r.text for r in answers]
    assert all(r.json()["usage"]["completion_tokens"] == 24 for r in answers)
    assert retries(app) > retries_before  # some were generating on the victim, and were retried
    assert lines[-1] == "[DONE]"
    assert not any("error" in json.loads(line) for line in lines[:-1])
    assert json.loads(lines[-2])["usage"]["completion_tokens"] == 300  # none lost, none twice

    fleet = app.wait_ready(2, timeout=180)  # the killed worker restarts and rejoins
    restarted = {w["worker_id"]: w["restarts"] for w in fleet["workers"]}
    assert restarted[victim] == restarts_before[victim] + 1


@pytest.fixture
def small_app(ray_serve):
    """A one-worker application on the fast fake engine, ours to break."""
    from ray import serve

    served = deploy("raypaged-faults", "/faults", ray_serve, None, workers=1, cpus_per_worker=1,
                    max_model_len=256, model=FAKE_MODEL)
    served.wait_ready(1)
    yield served
    serve.delete(served.name)


def test_with_every_worker_gone_health_and_requests_get_503_not_a_hang(small_app):
    url = small_app.url
    ok = httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200

    ray.kill(small_app.workers()["worker-0"], no_restart=True)
    deadline = time.monotonic() + 10
    while httpx.get(f"{url}/health", timeout=5).status_code != 503:
        assert time.monotonic() < deadline, "/health still 200 10 s after the last worker died"
        time.sleep(0.1)

    started = time.monotonic()
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 2}, timeout=30)
    assert r.status_code == 503 and r.headers.get("retry-after")
    assert r.json()["error"]["code"] == "no_workers"
    s = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": "hi"}], "stream": True})
    assert s.status_code == 503
    assert time.monotonic() - started < 5


def test_an_engine_config_that_cannot_work_fails_the_deployment_with_the_reason(ray_serve):
    from ray import serve

    from raypaged.serve.app import deployment_failure

    started = time.monotonic()
    with pytest.raises(RuntimeError):
        deploy("raypaged-bad", "/bad", ray_serve, None, workers=1, cpus_per_worker=1,
               kv_memory_mb=1, max_model_len=1024)
    reason = deployment_failure("raypaged-bad")
    serve.delete("raypaged-bad")
    assert "every worker failed to start" in reason and "max_model_len=1024" in reason
    assert time.monotonic() - started < 120
