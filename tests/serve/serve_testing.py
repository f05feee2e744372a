"""Helpers for the serve tests: deploying an application, and a handle on a deployed one."""
from __future__ import annotations

import socket
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "test-key"
MAX_REQUEST_BYTES = 256 * 1024


def wait_for(condition, within_s: float, poll_s: float = 0.02) -> bool:
    """Whether `condition()` came true within `within_s`, asked every `poll_s`."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(poll_s)
    return False


@contextmanager
def raypaged_serve_process(flags: list[str], log: Path, env: dict):
    """Runs `raypaged serve FLAGS` with exactly `env` (plus PYTHONPATH) and yields the process
    once /health answers on --port: benchmarks/serve_process.py's launcher (output to `log`,
    its own session, 600 s to come up, stop() at the end)."""
    sys.path.insert(0, str(ROOT))  # benchmarks/ is not installed: it runs from the checkout
    from benchmarks.serve_process import launch_command, stop

    port = flags[flags.index("--port") + 1]
    cmd = [sys.executable, "-c", "import sys; from raypaged.cli import main; sys.exit(main())",
           "serve", *flags]
    proc, _ = launch_command(cmd, f"http://127.0.0.1:{port}", log,
                             {**env, "PYTHONPATH": str(ROOT)})
    try:
        yield proc
    finally:
        stop(proc)


@dataclass
class ServedApp:
    name: str
    url: str
    api_key: str | None

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def fleet(self) -> dict:
        return httpx.get(f"{self.url}/fleet", headers=self.headers, timeout=10).json()

    def controller(self):
        """The application's controller (a deployment-scoped actor), from this Ray driver."""
        import ray
        from raypaged.serve.app import CONTROLLER

        prefix = f"SERVE_DEPLOYMENT_ACTOR::{self.name}::OpenAIRouter::"
        names = [a for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["name"].startswith(prefix) and a["name"].endswith(f"::{CONTROLLER}")]
        if not names:
            raise ValueError(f"no raypaged controller for application {self.name!r}")
        return ray.get_actor(names[0]["name"], namespace=names[0]["namespace"])

    def workers(self) -> dict:
        """worker id -> Ray actor handle."""
        import ray
        snap = ray.get(self.controller().snapshot.remote())
        return {w.worker_id: w.handle for w in snap.workers}

    def wait_ready(self, n: int, timeout: float = 120.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            fleet = self.fleet()
            if sum(w["state"] == "ready" for w in fleet["workers"]) >= n:
                return fleet
            time.sleep(0.25)
        raise TimeoutError(f"fewer than {n} workers ready after {timeout} s: {self.fleet()}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def deploy(name: str, route_prefix: str, base_url: str, api_key: str | None, **args) -> ServedApp:
    from ray import serve

    from raypaged.serve.app import build_app

    serve.run(build_app({"app_name": name, "api_key": api_key, **args}), name=name,
              route_prefix=route_prefix)
    return ServedApp(name, base_url + (route_prefix if route_prefix != "/" else ""), api_key)
