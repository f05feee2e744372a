"""A router replica's queue is bounded (router_max_ongoing_requests, router_max_queued_requests):
past it, Serve's proxy answers 503 with Retry-After before the request reaches the router."""
from __future__ import annotations

import asyncio

import httpx

from fake_engine import SLOW_FAKE_MODEL
from serve_testing import deploy


def test_past_the_routers_queue_requests_get_503_with_retry_after(ray_serve):
    from ray import serve

    served = deploy("raypaged-backpressure", "/backpressure", ray_serve, None, workers=1,
                    cpus_per_worker=1, max_model_len=256, router_max_ongoing_requests=1,
                    router_max_queued_requests=1,
                    model=SLOW_FAKE_MODEL)
    try:
        served.wait_ready(1)
        body = {"prompt": "a prompt", "max_tokens": 60, "ignore_eos": True}  # ~1.2 s each

        async def flood():
            async with httpx.AsyncClient(timeout=60) as client:
                return await asyncio.gather(*(
                    client.post(served.url + "/v1/completions", json=body) for _ in range(8)))

        responses = asyncio.run(flood())
        codes = sorted(r.status_code for r in responses)
        refused = [r for r in responses if r.status_code == 503]
        assert 200 in codes and refused, codes
        assert set(codes) == {200, 503}, codes
        assert all(r.headers.get("retry-after") == "1" for r in refused)
        # the refused ones cost nothing: the fleet is idle again and serves a request
        r = httpx.post(served.url + "/v1/completions", json={**body, "max_tokens": 2},
                       timeout=60)
        assert r.status_code == 200
    finally:
        serve.delete(served.name)
