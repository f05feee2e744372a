"""Prefix-aware routing on the real fleet: shared prefixes meet their cached blocks, and a hot
prefix spills over to the other worker once its worker is above the load bound (the default
routing, cache_aware)."""
from __future__ import annotations

import asyncio

from prometheus_client.parser import text_string_to_metric_families
import httpx
import pytest

from serve_testing import wait_for

LONG_PREFIX = ("You are a meticulous assistant for a small bakery. The bakery sells sourdough, "
               "rye, baguettes, croissants and seasonal fruit tarts. Opening hours are seven to "
               "three on weekdays and eight to one on Saturdays; it is closed on Sundays. Answer "
               "customers politely, in one short sentence, and never invent products. ") * 2


@pytest.fixture(autouse=True)
def idle_fleet(app):
    """Each test starts on an idle fleet. The session's app is shared, and a test before these
    may leave requests running (a client that left is cancelled asynchronously): a worker over
    the concurrency cap passes a prefix's requests on, which the exact placements below forbid."""
    assert wait_for(lambda: not any(w.get("load") for w in app.fleet()["workers"]), 60, 0.25), \
        app.fleet()


def routing_decisions(app) -> dict[str, float]:
    text = httpx.get(f"{app.url}/metrics").text
    out = {}
    for fam in text_string_to_metric_families(text):
        if fam.name == "raypaged:routing_decisions":
            for s in fam.samples:
                if s.name.endswith("_total"):
                    out[s.labels["reason"]] = s.value
    return out


def test_requests_sharing_a_long_prefix_land_on_one_worker_and_hit_its_cache(client, model_name):
    workers, cached = set(), []
    for question in ("Do you sell rye?", "When do you open on Saturday?", "Any tarts today?"):
        raw = client.completions.with_raw_response.create(
            model=model_name, prompt=LONG_PREFIX + question, max_tokens=2, temperature=0)
        workers.add(raw.headers["x-raypaged-worker"])
        cached.append(raw.parse().usage.prompt_tokens_details.cached_tokens)
    assert len(workers) == 1
    assert all(c > 0 for c in cached[1:])  # the 2nd and 3rd reuse the prefix's blocks


def test_a_different_cache_salt_is_a_different_prefix(client, model_name):
    prompt = LONG_PREFIX + "Do you sell baguettes?"
    client.completions.create(model=model_name, prompt=prompt, max_tokens=1,
                              extra_body={"cache_salt": "tenant-a"})
    other = client.completions.create(model=model_name, prompt=prompt, max_tokens=1,
                                      extra_body={"cache_salt": "tenant-b"})
    again = client.completions.create(model=model_name, prompt=prompt, max_tokens=1,
                                      extra_body={"cache_salt": "tenant-a"})
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_a_hot_prefix_under_load_spills_to_the_other_worker(app, async_client, model_name):
    before = sum(routing_decisions(app).values())

    async def one(client, i):
        raw = await client.completions.with_raw_response.create(
            model=model_name, prompt=LONG_PREFIX + f"Question {i}: do you bake bread?",
            max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
        return raw.headers["x-raypaged-worker"]

    async def burst():
        async with async_client() as client:
            return await asyncio.gather(*(one(client, i) for i in range(6)))

    workers = asyncio.run(burst())
    # Idle fleet, factor 1.25 (the default cache_aware rule's concurrency cap, as hash's load
    # bound): the prefix's worker takes 2 at once, the 3rd goes over the cap.
    assert set(workers) == {"worker-0", "worker-1"}
    assert sum(routing_decisions(app).values()) == before + 6
