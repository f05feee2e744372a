"""The real thing: `ray job submit -- raypaged batch` against a cluster this test starts with
`ray start --head` on loopback (free ports, its own temp dir), stopped at the end."""
from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from batch_inputs import numbered_prompts, read_output, write_lines
from batch_testing import ENGINE, ROOT

BIN = Path(sys.executable).parent


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@pytest.fixture
def ray_head():
    """(dashboard address, env) of a one-node cluster; all its processes stopped afterwards."""
    gcs, dash, client, agent, agent_grpc, metrics, runtime_env, nm, om = free_ports(9)
    temp_dir = tempfile.mkdtemp(prefix="rpj", dir="/tmp")  # short: Ray's socket paths are
    # Ray's token authentication, with this cluster's own token (not whatever ~/.ray holds)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PATH": f"{BIN}:{os.environ['PATH']}",
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    env.pop("RAY_ADDRESS", None)
    head = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
         f"--port={gcs}", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
         f"--dashboard-port={dash}", f"--ray-client-server-port={client}",
         f"--dashboard-agent-listen-port={agent}", f"--dashboard-agent-grpc-port={agent_grpc}",
         f"--metrics-export-port={metrics}", f"--runtime-env-agent-port={runtime_env}",
         f"--node-manager-port={nm}", f"--object-manager-port={om}", "--num-cpus=2",
         f"--temp-dir={temp_dir}", "--disable-usage-stats"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    address = f"http://127.0.0.1:{dash}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert head.poll() is None, "ray start --head exited"
            try:  # any answer will do (401: Ray's token authentication is on)
                httpx.get(f"{address}/api/version", timeout=2)
                break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the dashboard did not come up in 120 s"
            time.sleep(0.5)
        yield address, env
    finally:
        # The process group this test started (never `ray stop`: it stops every cluster of
        # this user on the machine): SIGTERM, then SIGKILL for whatever is left.
        for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 0)):
            try:
                os.killpg(head.pid, sig)
            except ProcessLookupError:
                break
            time.sleep(wait_s)
        head.wait(timeout=30)


def test_ray_job_submit_runs_raypaged_batch_to_success(ray_head, tmp_path):
    address, env = ray_head
    work = tmp_path / "work"
    work.mkdir()
    write_lines(work / "in.jsonl", numbered_prompts(6, max_tokens=4))
    out = tmp_path / "out.jsonl"
    engine_flags = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE.items()]
    job_id = f"raypaged-batch-test-{os.getpid()}"
    submit = subprocess.run(
        [str(BIN / "ray"), "job", "submit", "--address", address, "--submission-id", job_id,
         "--working-dir", str(work), "--",
         "raypaged", "batch", "in.jsonl", str(out), "--workers=1", "--cpus-per-worker=1",
         "--progress-interval-s=1", *engine_flags],
        env=env, capture_output=True, text=True, timeout=400)
    logs = submit.stdout + submit.stderr
    assert submit.returncode == 0, logs
    status = subprocess.run([str(BIN / "ray"), "job", "status", "--address", address, job_id],
                            env=env, capture_output=True, text=True, timeout=60)
    assert f"Job '{job_id}' succeeded" in status.stdout, status.stdout + status.stderr  # SUCCEEDED
    assert "completed        6" in logs
    lines = read_output(out)
    assert sorted(o["custom_id"] for o in lines) == [f"r{i}" for i in range(6)]
    assert all(o["response"]["body"]["usage"]["completion_tokens"] == 4 for o in lines)
