"""Cache-aware routing on Ray: worker cache summaries travel through the controller's mirror to
the router replica's views, so a shared prefix goes to the worker holding it."""
from __future__ import annotations

import time

import httpx
import pytest

from fake_engine import FAKE_MODEL
from serve_testing import deploy
from test_prefix_routing import routing_decisions

PREFIX = "Answer in one short sentence, politely, and never invent products. " * 3


@pytest.fixture
def cache_aware_app(ray_serve):
    from ray import serve

    served = deploy("raypaged-cache-aware", "/cache-aware", ray_serve, None, workers=2,
                    cpus_per_worker=0.5, max_model_len=512, routing="cache_aware",
                    model=FAKE_MODEL)
    served.wait_ready(2)
    yield served
    serve.delete(served.name)


def test_a_cached_prefix_draws_its_requests_to_its_worker(cache_aware_app):
    url = cache_aware_app.url

    def ask(i):
        r = httpx.post(f"{url}/v1/completions", timeout=30, json={
            "prompt": PREFIX + f"Question {i}?", "max_tokens": 2, "ignore_eos": True})
        assert r.status_code == 200
        return r.headers["x-raypaged-worker"], r.json()["usage"]["prompt_tokens_details"]

    home, _ = ask(0)
    time.sleep(1.5)  # a controller poll and a router refresh: the summary reaches the router
    later = [ask(i) for i in range(1, 5)]
    assert [w for w, _ in later] == [home] * 4
    assert all(details["cached_tokens"] >= 192 for _, details in later)
    assert routing_decisions(cache_aware_app).get("cache_hit", 0) >= 4
