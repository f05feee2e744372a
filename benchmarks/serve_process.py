"""A `raypaged serve` process for benchmarks: launch on a free loopback port, wait for /health,
stop it (SIGTERM: it removes what it started; SIGKILL to its process group if it hangs), and
find the processes under it (workers, routers, the controller) in /proc."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(flags: list[str], log: Path):
    port = free_port()
    cmd = [sys.executable, "-c", "import sys; from raypaged.cli import main; sys.exit(main())",
           "serve", "--port", str(port), *flags]
    return launch_command(cmd, f"http://127.0.0.1:{port}", log)


def launch_command(cmd: list[str], url: str, log: Path, env: dict | None = None):
    """Start any OpenAI server (its own session: stop() reaches its children) and wait until
    `url`/health answers 200."""
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True, env=env)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[0]} server exited ({proc.returncode}); see {log}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    stop(proc)
    raise TimeoutError(f"server not healthy after 600 s; see {log}")


def stop(proc) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def descendants(root: int) -> dict[int, str]:
    """pid -> process name (comm) of every process under root (root excluded)."""
    children: dict[int, list[int]] = {}
    names = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            names[int(d)] = stat[stat.index("(") + 1:stat.rindex(")")]
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(d))
    out, todo = {}, list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        out[pid] = names.get(pid, "")
        todo.extend(children.get(pid, ()))
    return out
