"""On a real Ray fleet (fake engines at 20 ms a step, so it runs in seconds): a worker killed
with SIGKILL or frozen with SIGSTOP under 30 concurrent mixed requests (streaming and not,
greedy and seeded, n = 1 and 2) fails none of them, and every client gets exactly the text an
undisturbed run gives. The frozen worker is marked unresponsive within a few seconds."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest

N_REQUESTS = 30


def body(i: int) -> dict:
    kind = i % 3
    b = {"prompt": f"request {i}: a prompt that fills a block or two", "max_tokens": 80,
         "ignore_eos": True}
    if kind == 0:
        return {**b, "temperature": 0, "stream": True}
    if kind == 1:
        return {**b, "temperature": 1.0, "seed": i, "n": 2}
    return {**b, "temperature": 1.0, "seed": i, "stream": True}

async def one(client: httpx.AsyncClient, url: str, i: int) -> tuple[int, dict[int, str], str]:
    """(status, choice index -> text, the error events' text if any)."""
    b = body(i)
    if not b.get("stream"):
        r = await client.post(url, json=b)
        if r.status_code != 200:
            return r.status_code, {}, r.text
        return 200, {c["index"]: c["text"] for c in r.json()["choices"]}, ""
    texts: dict[int, str] = {}
    errors = ""
    async with client.stream("POST", url, json=b) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                errors += line
            for c in event.get("choices", []):
                texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    return r.status_code, texts, errors

async def load(url: str, during=None):
    async with httpx.AsyncClient(timeout=60) as client:
        tasks = [asyncio.create_task(one(client, f"{url}/v1/completions", i))
                 for i in range(N_REQUESTS)]
        if during is not None:
            await during()
        return await asyncio.gather(*tasks)

@pytest.fixture(scope="module")
def undisturbed(fake_fleet):
    results = asyncio.run(load(fake_fleet.url))
    assert all(status == 200 and not errors for status, _, errors in results)
    return [texts for _, texts, _ in results]

def retries(app) -> float:
    """Failovers so far, summed over router replicas (the router ships them every second)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{app.url}/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text)
               if f.name == "raypaged:request_retries" for s in f.samples)

def wait_for_retries(app, above: float) -> float:
    deadline = time.monotonic() + 5
    while (now := retries(app)) <= above and time.monotonic() < deadline:
        time.sleep(0.2)
    return now

def pids(app) -> dict[str, int]:
    return {w["worker_id"]: w["pid"] for w in app.fleet()["workers"] if "pid" in w}

def busiest(app) -> str:
    return max(app.fleet()["workers"], key=lambda w: w.get("load", 0))["worker_id"]

def test_sigkill_of_a_worker_under_load_fails_no_request(fake_fleet, undisturbed):
    restarts = {w["worker_id"]: w["restarts"] for w in fake_fleet.fleet()["workers"]}
    before = retries(fake_fleet)
    box = {}

    async def kill():
        await asyncio.sleep(0.8)  # every request is routed and streaming
        box["victim"] = victim = busiest(fake_fleet)
        os.kill(pids(fake_fleet)[victim], signal.SIGKILL)

    results = asyncio.run(load(fake_fleet.url, kill))
    assert [(s, e) for s, _, e in results] == [(200, "")] * N_REQUESTS
    assert [texts for _, texts, _ in results] == undisturbed
    assert wait_for_retries(fake_fleet, before) >= before + 5  # requests really were cut off
    fleet = fake_fleet.wait_ready(2, timeout=60)  # the killed worker restarts and rejoins
    victim = box["victim"]
    assert {w["worker_id"]: w["restarts"] for w in fleet["workers"]}[victim] == restarts[victim] + 1

def test_sigstop_of_a_worker_under_load_fails_no_request_and_it_is_marked_unresponsive(
        fake_fleet, undisturbed):
    before = retries(fake_fleet)
    box = {}

    async def freeze():
        await asyncio.sleep(0.8)
        box["victim"] = victim = busiest(fake_fleet)
        box["pid"] = pids(fake_fleet)[victim]
        os.kill(box["pid"], signal.SIGSTOP)
        box["frozen_at"] = time.monotonic()

    try:
        started = time.monotonic()
        results = asyncio.run(load(fake_fleet.url, freeze))
        took = time.monotonic() - started
        state = {w["worker_id"]: w["state"] for w in fake_fleet.fleet()["workers"]}
    finally:
        if "pid" in box:
            os.kill(box["pid"], signal.SIGCONT)
    assert [(s, e) for s, _, e in results] == [(200, "")] * N_REQUESTS
    assert [texts for _, texts, _ in results] == undisturbed
    assert state[box["victim"]] == "unresponsive"
    assert wait_for_retries(fake_fleet, before) >= before + 5
    assert took < 20
    fake_fleet.wait_ready(2, timeout=30)  # thawed, it answers again and is re-admitted
