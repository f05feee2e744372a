"""The controller's death on a real Ray fleet (fake engines at 20 ms a step): a stream under way
finishes whole, new requests are served from the routers' last snapshot while Serve recreates
the controller, the new controller adopts the same worker actors (no restart, no model load) and
removes a stale worker of another configuration, and deleting the application leaves no worker
behind."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest
import ray

from fake_engine import SLOW_FAKE_MODEL
from raypaged.serve.detached_workers import WORKER_NAMESPACE, named_workers
from serve_testing import deploy

STREAM_TOKENS = 150
STALE = "raypaged-ctl:worker-0:0000000000000000"  # a worker of another configuration


@ray.remote(num_cpus=0)
class Idle:
    def ping(self) -> str:
        return "pong"


@pytest.fixture(scope="module")
def ctl_app(ray_serve):
    from ray import serve

    served = deploy("raypaged-ctl", "/ctl", ray_serve, None, workers=2, cpus_per_worker=0.5,
                    max_model_len=256,
                    model=SLOW_FAKE_MODEL)
    served.wait_ready(2)
    yield served
    serve.delete(served.name)


def actor_ids(app) -> dict[str, str]:
    return {wid: h._actor_id.hex() for wid, h in app.workers().items()}


def controller_pid(app) -> tuple[str, int]:
    ctl = app.controller()
    return ctl._actor_id.hex(), ray.get(ctl.__ray_call__.remote(lambda self: os.getpid()))


def new_controller_polled(app, old_id: str) -> bool:
    try:
        ctl = app.controller()
        return (ctl._actor_id.hex() != old_id
                and ray.get(ctl.snapshot.remote(), timeout=5).version > 0)
    except (ValueError, ray.exceptions.RayError):
        return False


async def stream(client: httpx.AsyncClient, url: str, started: asyncio.Event) -> list[str]:
    body = {"prompt": "a long story", "max_tokens": STREAM_TOKENS, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    lines = []
    async with client.stream("POST", url, json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                lines.append(line[6:])
                if len(lines) == 5:
                    started.set()
    return lines


async def ask(client: httpx.AsyncClient, url: str, i: int) -> tuple[int, int]:
    r = await client.post(url, json={"prompt": f"item {i}", "max_tokens": 8, "ignore_eos": True})
    return r.status_code, r.json()["usage"]["completion_tokens"] if r.status_code == 200 else 0


def test_killing_the_controller_fails_no_request_and_its_workers_are_adopted(ctl_app):
    ids, pids = actor_ids(ctl_app), {w["worker_id"]: w["pid"] for w in ctl_app.fleet()["workers"]}
    stale = Idle.options(name=STALE, namespace=WORKER_NAMESPACE, lifetime="detached").remote()
    ray.get(stale.ping.remote())
    old_id, pid = controller_pid(ctl_app)

    async def scenario():
        url = f"{ctl_app.url}/v1/completions"
        async with httpx.AsyncClient(timeout=60) as client:
            started = asyncio.Event()
            streaming = asyncio.create_task(stream(client, url, started))
            await asyncio.wait_for(started.wait(), 30)
            os.kill(pid, signal.SIGKILL)
            away, i = [], 0
            deadline = time.monotonic() + 60
            while not await asyncio.to_thread(new_controller_polled, ctl_app, old_id):
                assert time.monotonic() < deadline, "Serve did not recreate the controller"
                away.append(await ask(client, url, i))
                i += 1
                await asyncio.sleep(0.3)
            after = await asyncio.gather(*(ask(client, url, 100 + j) for j in range(6)))
            return await streaming, away, after

    lines, away, after = asyncio.run(scenario())

    assert lines[-1] == "[DONE]"
    assert not any("error" in json.loads(line) for line in lines[:-1])
    assert json.loads(lines[-2])["usage"]["completion_tokens"] == STREAM_TOKENS
    assert len(away) >= 3 and away == [(200, 8)] * len(away)  # served while it was gone
    assert after == [(200, 8)] * 6
    assert actor_ids(ctl_app) == ids  # adopted: the same actors ...
    fleet = ctl_app.wait_ready(2, timeout=10)
    assert {w["worker_id"]: (w["pid"], w["restarts"]) for w in fleet["workers"]} == {
        wid: (p, 0) for wid, p in pids.items()}  # ... in the same processes, never restarted
    assert STALE not in named_workers(ctl_app.name) and len(named_workers(ctl_app.name)) == 2
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(stale.ping.remote(), timeout=10)


def test_deleting_the_application_removes_every_worker(ctl_app):
    from ray import serve

    handles = ctl_app.workers()
    assert len(named_workers(ctl_app.name)) == 2
    serve.delete(ctl_app.name)
    deadline = time.monotonic() + 20
    while named_workers(ctl_app.name) and time.monotonic() < deadline:
        time.sleep(0.25)
    assert named_workers(ctl_app.name) == []
    for handle in handles.values():  # gone for good, not restarting
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(handle.health.remote(), timeout=10)
