"""The HAProxy `raypaged serve --ingress haproxy` starts: Serve's config with the stats page and
exporter on the loopback and the client's address forwarded (raypaged/serve/haproxy_local.py),
and the router's reading of that address (client_gate.client_of)."""
from __future__ import annotations

import subprocess

import pytest

from raypaged.serve.client_gate import client_of
from raypaged.serve.haproxy_local import api_frontend_lines, local_config
from raypaged.serve.ingress import _local_haproxy

# The lines of Ray Serve 2.60's HAProxy template that matter here, as it renders them
SERVE_CONFIG = """global
    stats socket /tmp/rp1/admin.sock mode 666 level admin expose-fd listeners
defaults
    mode http
frontend prometheus
    bind :9101
    mode http
frontend http_frontend
    bind 127.0.0.1:8000
    acl healthcheck path -i /-/healthz
backend default_backend
    server replica_1 127.0.0.1:30001 check
listen stats
  bind *:8404
  stats enable
"""


def test_every_interface_bind_moves_to_the_loopback_and_the_api_forwards_and_times_out():
    assert local_config(SERVE_CONFIG, 30) == SERVE_CONFIG.replace(
        "bind :9101", "bind 127.0.0.1:9101").replace(
        "bind *:8404", "bind 127.0.0.1:8404").replace(
        "frontend http_frontend\n", "frontend http_frontend\n" + api_frontend_lines(30))
    assert api_frontend_lines(2.5) == ("    http-request del-header X-Forwarded-For\n"
                                       "    option forwardfor\n"
                                       "    option http-buffer-request\n"
                                       "    timeout http-request 2500ms\n")


def test_the_api_frontend_keeps_the_host_it_was_given():
    wide = SERVE_CONFIG.replace("bind 127.0.0.1:8000", "bind 0.0.0.0:8000")
    assert "bind 0.0.0.0:8000" in local_config(wide, 30)


def test_a_config_without_the_api_frontend_is_refused():
    with pytest.raises(ValueError, match="http_frontend"):
        local_config(SERVE_CONFIG.replace("frontend http_frontend", "frontend other"), 30)


def test_serve_starts_the_real_binary_as_the_same_process_on_the_rewritten_config(tmp_path):
    real = tmp_path / "real-haproxy"
    real.write_text('#!/bin/sh\necho "pid $$ args $*"\ncat "$3"\n')
    real.chmod(0o755)
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(SERVE_CONFIG)
    wrapper = _local_haproxy(str(real), str(tmp_path), 7.5)
    proc = subprocess.Popen([wrapper, "-db", "-f", str(cfg), "-sf", "123"],
                            stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=60)
    first, rest = out.split("\n", 1)
    # exec all the way: the pid Serve started (and signals) is the real binary's
    assert first == f"pid {proc.pid} args -db -f {cfg}.local -sf 123"
    assert rest == local_config(SERVE_CONFIG, 7.5)
    assert cfg.read_text() == SERVE_CONFIG  # Serve's own file untouched


def _scope(peer: str, *xff: bytes) -> dict:
    return {"client": (peer, 5000), "headers": [(b"x-forwarded-for", v) for v in xff]}


def test_the_forwarded_address_is_the_client_only_from_the_loopback():
    assert client_of(_scope("127.0.0.1", b"10.1.2.3"), forwarded=True) == "10.1.2.3"
    # HAProxy drops the client's own header; were one left, its own comes last
    assert client_of(_scope("127.0.0.1", b"6.6.6.6, 10.1.2.3"), forwarded=True) == "10.1.2.3"
    assert client_of(_scope("127.0.0.1", b"6.6.6.6", b"10.1.2.3"), forwarded=True) == "10.1.2.3"
    # a peer that is not a local HAProxy names itself, whatever it claims
    assert client_of(_scope("192.168.0.9", b"10.1.2.3"), forwarded=True) == "192.168.0.9"
    # Serve's Python proxy, or an HAProxy that forwards nothing: the peer
    assert client_of(_scope("127.0.0.1", b"10.1.2.3"), forwarded=False) == "127.0.0.1"
    assert client_of(_scope("127.0.0.1"), forwarded=True) == "127.0.0.1"
