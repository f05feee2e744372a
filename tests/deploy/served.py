"""A real `raypaged serve` (its own local Ray, 127.0.0.1 only) and a real Prometheus scraping it."""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path

import yaml

from deploy_tools import ROOT, tool

sys.path.insert(0, str(ROOT))  # benchmarks/ is not installed: it runs from the checkout
from benchmarks.serve_process import free_port, launch_command, stop  # noqa: E402


@contextmanager
def raypaged_serve(tmp: Path, *flags: str):
    """Yields the base URL of a `raypaged serve` on 127.0.0.1 with one small worker."""
    port = free_port()
    log = tmp / "raypaged.log"
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAYPAGED_API_KEY")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-c", "import sys; from raypaged.cli import main; sys.exit(main())",
           "serve", "--host", "127.0.0.1", "--port", str(port), "--num-cpus", "2",
           # --max-workers 2: the autoscaler's metrics are on /metrics (the dashboard queries
           # them); the few requests sent never scale it out
           "--workers", "1", "--max-workers", "2", "--cpus-per-worker", "1",
           "--kv-memory-mb", "16",
           "--max-model-len", "512", *flags]
    proc, url = launch_command(cmd, f"http://127.0.0.1:{port}", log, env, cwd=tmp)
    try:
        yield url
    finally:
        stop(proc)


@contextmanager
def prometheus(tmp: Path, target: str, scrape_interval: str = "1s"):
    """Prometheus from the distribution's package, run with deploy/prometheus.yml retargeted at
    `target` (host:port), on 127.0.0.1, with a throwaway data folder. `timeout` bounds its life
    even if this process dies."""
    config = yaml.safe_load((ROOT / "deploy/prometheus.yml").read_text())
    config["global"]["scrape_interval"] = scrape_interval
    (job,) = config["scrape_configs"]
    job["static_configs"][0]["targets"] = [target]
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = tmp / "prometheus.log"
    proc, url = launch_command(
        ["timeout", "900", tool("prometheus"), f"--config.file={tmp / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
        f"http://127.0.0.1:{port}", log, health="/-/ready", timeout_s=60)
    try:
        yield url
    finally:
        stop(proc)
