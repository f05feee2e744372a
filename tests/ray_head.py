"""A one-node Ray cluster with Ray's token authentication, started as the Helm chart's head is:
`ray start --head` with RAY_AUTH_MODE=token and the token in RAY_AUTH_TOKEN (how KubeRay's
authOptions hand it to every Ray container). Loopback only, free ports, its own temp dir and
token; its process group is stopped afterwards (never `ray stop`, which stops every cluster of
this user on the machine)."""
from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

BIN = Path(sys.executable).parent


@dataclass(frozen=True)
class RayHead:
    dashboard: str      # http://127.0.0.1:PORT: the dashboard and the Jobs API
    gcs: str            # 127.0.0.1:PORT
    client: str         # ray://127.0.0.1:PORT
    token: str
    env: dict           # the environment of a tool that holds the token


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def without_token(env: dict, home: Path) -> dict:
    """`env` as a tool on another pod would have it: no token in the environment, and a HOME
    without ~/.ray/auth_token."""
    out = {k: v for k, v in env.items() if not k.startswith("RAY_AUTH")}
    out["HOME"] = str(home)
    return out


def start_ray_head(num_cpus: int = 1, env: dict | None = None):
    """(the head's process, RayHead) once the Jobs API answers the token's holder; `env` is added
    to the environment of the head and of tools that use it."""
    gcs, dash, client, agent, agent_grpc, metrics, runtime_env, nm, om = free_ports(9)
    temp_dir = tempfile.mkdtemp(prefix="rpa", dir="/tmp")  # short: Ray's socket paths are limited
    token = secrets.token_hex(32)
    env = {**os.environ, **(env or {}), "PATH": f"{BIN}:{os.environ['PATH']}",
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}
    env.pop("RAY_ADDRESS", None)
    head = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
         f"--port={gcs}", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
         f"--dashboard-port={dash}", f"--ray-client-server-port={client}",
         f"--dashboard-agent-listen-port={agent}", f"--dashboard-agent-grpc-port={agent_grpc}",
         f"--metrics-export-port={metrics}", f"--runtime-env-agent-port={runtime_env}",
         f"--node-manager-port={nm}", f"--object-manager-port={om}", f"--num-cpus={num_cpus}",
         f"--temp-dir={temp_dir}", "--disable-usage-stats"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    address = f"http://127.0.0.1:{dash}"
    deadline = time.monotonic() + 120
    while True:
        if head.poll() is not None:
            raise RuntimeError("ray start --head exited")
        try:  # the Jobs API is up once the dashboard answers for the token's holder
            if httpx.get(f"{address}/api/jobs/", timeout=2,
                         headers={"Authorization": f"Bearer {token}"}).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            stop(head)
            raise TimeoutError("the dashboard did not come up in 120 s")
        time.sleep(0.5)
    return head, RayHead(address, f"127.0.0.1:{gcs}", f"ray://127.0.0.1:{client}", token, env)


def stop(head: subprocess.Popen) -> None:
    for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 0)):
        try:
            os.killpg(head.pid, sig)
        except ProcessLookupError:
            break
        time.sleep(wait_s)
    head.wait(timeout=30)
