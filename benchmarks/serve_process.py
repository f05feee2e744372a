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


def split_env(spec: list[str]) -> tuple[dict[str, str], list[str]]:
    """`["RAY_SERVE_ENABLE_HA_PROXY=1", "--workers", "2"]` -> ({env}, [flags]): leading NAME=VALUE
    words are environment variables for the server (as with `env`), the rest its flags. Ray
    Serve's own switches are environment variables read by every Serve process, so a benchmark
    variant needs both."""
    env = {}
    for i, word in enumerate(spec):
        name, sep, value = word.partition("=")
        if not (sep and name.isidentifier() and not name.startswith("-")):
            return env, spec[i:]
        env[name] = value
    return env, []


def launch(flags: list[str], log: Path, env: dict[str, str] | None = None):
    """`raypaged serve FLAGS` with `env` added to this process's environment (a local Ray cluster
    started by it passes the environment on to every Ray process)."""
    port = free_port()
    cmd = [sys.executable, "-c", "import sys; from raypaged.cli import main; sys.exit(main())",
           "serve", "--port", str(port), *flags]
    return launch_command(cmd, f"http://127.0.0.1:{port}", log,
                          {**os.environ, **env} if env else None)


def launch_command(cmd: list[str], url: str, log: Path, env: dict | None = None,
                   health: str = "/health", cwd: Path | None = None, timeout_s: float = 600):
    """Start any server (its own session: stop() reaches its children) and wait until `url` +
    `health` answers 200 (600 s: a loaded shared machine took > 300 s to start raypaged)."""
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True, env=env, cwd=cwd)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[0]} exited ({proc.returncode}); {log} ends:\n"
                               f"{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}{health}", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop(proc)
    raise TimeoutError(f"{url}{health} not up after {timeout_s} s; {log} ends:\n"
                       f"{log.read_text()[-3000:]}")


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
