"""Two Ray nodes on this machine (own CPUs, own loopback addresses), a worker on each: stopping
one node's raylet in the middle of a load loses no request (they go on on the other node's
worker, once the cluster has found the node dead: not after a wait for a restart that has
nowhere to happen), and the fleet reports the lost worker and its node."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ray_nodes import Node, node_env
from serve_testing import ROOT, free_port

MAX_TOKENS = 120


@pytest.fixture(scope="module")
def cluster_app(default_model_dir):
    """The head (1 CPU) and `raypaged serve` with 2 workers: the router, controller and worker-0
    land on the head; the second node joins afterwards and gets worker-1 alone."""
    temp_dir = tempfile.mkdtemp(prefix="rpmn-", dir="/tmp")
    head = Node("127.0.0.2", num_cpus=1, temp_dir=temp_dir)
    nodes, serve_proc = [head], None
    try:
        head.wait_started()
        port = free_port()
        serve_proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; from raypaged.cli import main; sys.exit(main())",
             "serve", "--address", head.address, "--port", str(port), "--workers", "2",
             "--cpus-per-worker", "1", "--kv-memory-mb", "32", "--max-model-len", "256",
             "--model", str(default_model_dir)],
            cwd=ROOT, env={**node_env(), "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: health(url), 240, serve_proc)
        nodes.append(Node("127.0.0.3", num_cpus=1, temp_dir=temp_dir,
                          head_address=head.address))
        nodes[1].wait_started()
        wait_for(lambda: states(url) == {"worker-0": "ready", "worker-1": "ready"}, 240,
                 serve_proc)
        yield url, nodes[1]
    finally:
        if serve_proc is not None:
            serve_proc.send_signal(signal.SIGTERM)
            try:
                serve_proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(serve_proc.pid, signal.SIGKILL)
        for node in reversed(nodes):
            node.stop()
        shutil.rmtree(temp_dir, ignore_errors=True)


def wait_for(condition, timeout: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, "raypaged serve exited"
        assert time.monotonic() < deadline, f"not within {timeout} s"
        time.sleep(0.5)


def health(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def worker_view(url: str, worker_id: str) -> dict:
    workers = httpx.get(f"{url}/fleet", timeout=5).json()["workers"]
    return next(w for w in workers if w["worker_id"] == worker_id)


def states(url: str) -> dict[str, str]:
    try:
        workers = httpx.get(f"{url}/fleet", timeout=5).json()["workers"]
    except httpx.HTTPError:
        return {}
    return {w["worker_id"]: w["state"] for w in workers}


async def request(client: httpx.AsyncClient, url: str, i: int) -> tuple[int, int, str]:
    """(status, completion tokens, error events)."""
    body = {"prompt": f"Write item {i} of a long list of animals:", "max_tokens": MAX_TOKENS,
            "ignore_eos": True, "temperature": 0}
    if i % 2:
        r = await client.post(f"{url}/v1/completions", json=body)
        tokens = r.json()["usage"]["completion_tokens"] if r.status_code == 200 else 0
        return r.status_code, tokens, "" if r.status_code == 200 else r.text
    body.update(stream=True, stream_options={"include_usage": True})
    tokens, errors = 0, ""
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                errors += line if "error" in event else ""
                tokens = (event.get("usage") or {}).get("completion_tokens", tokens)
    return r.status_code, tokens, errors


def test_stopping_a_nodes_raylet_mid_load_loses_no_request_and_the_fleet_reports_it(
        cluster_app):
    url, second = cluster_app

    async def load():
        async with httpx.AsyncClient(timeout=180) as client:
            tasks = [asyncio.create_task(request(client, url, i)) for i in range(12)]
            # kill once the second node's worker is generating (not after a fixed time: on an
            # idle machine short requests could all be done by then)
            while not any(w["worker_id"] == "worker-1" and w.get("num_running", 0) > 0
                          for w in (await client.get(f"{url}/fleet")).json()["workers"]):
                await asyncio.sleep(0.1)
            os.kill(second.raylet_pid(), signal.SIGKILL)
            return await asyncio.gather(*tasks)

    results = asyncio.run(load())
    assert results == [(200, MAX_TOKENS, "")] * 12
    deadline = time.monotonic() + 30
    while states(url).get("worker-1") == "ready" and time.monotonic() < deadline:
        time.sleep(0.5)
    assert states(url) == {"worker-0": "ready", "worker-1": states(url)["worker-1"]}
    assert states(url)["worker-1"] in ("unresponsive", "restarting", "dead")
    # once Ray's health checks find the node dead (~15 s), the fleet says so: requests that
    # would wait for the worker's restart (failover.wait_for_spare) stop waiting then
    deadline = time.monotonic() + 60
    while not (lost := worker_view(url, "worker-1")).get("node_lost"):
        assert time.monotonic() < deadline, lost
        time.sleep(0.5)
    assert lost["state"] in ("unresponsive", "restarting") and lost["error"].endswith(" is dead")
    text = httpx.get(f"{url}/metrics", timeout=10).text
    up = {s.labels["worker"]: s.value for f in text_string_to_metric_families(text)
          if f.name == "raypaged:worker_up" for s in f.samples}
    assert up == {"worker-0": 1.0, "worker-1": 0.0}
    retries = sum(s.value for f in text_string_to_metric_families(text)
                  if f.name == "raypaged:request_retries" for s in f.samples)
    assert retries >= 1  # requests under way on the lost node went on on the other
