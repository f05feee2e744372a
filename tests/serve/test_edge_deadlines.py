"""Deadlines at the edge, over real HTTP (uvicorn in a thread, slow fake engines, no Ray): a
request past request_timeout_s ends (504, or an error event and [DONE] mid-stream) and its
work is aborted on the worker; a body not received within body_timeout_s gets 408 and the
connection is closed."""
from __future__ import annotations

import json
import socket
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from http_server import serving
from local_fleet import LocalFleet
from raypaged.serve.limits import RequestLimits
from test_request_limits import make_app

# 20 ms a step, 200 tokens: ~4 s of work against a 0.5 s deadline
SLOW = {"model": "fake-model", "prompt": "a prompt", "max_tokens": 200, "ignore_eos": True}


def idle(fleet: LocalFleet, within: float = 5.0) -> bool:
    """Every worker back to no request in flight and nothing in its engine."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if all(w.stats().num_active == 0 and not w.engine.has_unfinished()
               for w in fleet.workers.values()):
            return True
        time.sleep(0.05)
    return False


def test_a_request_past_its_deadline_gets_504_and_is_aborted_on_its_worker():
    fleet = LocalFleet(step_delay_s=0.02)
    app, _ = make_app(fleet, RequestLimits(), request_timeout_s=0.5)
    try:
        with serving(app) as url:
            start = time.monotonic()
            r = httpx.post(url + "/v1/completions", json=SLOW, timeout=30)
            took = time.monotonic() - start
            assert idle(fleet)
            small = httpx.post(url + "/v1/completions", json={**SLOW, "max_tokens": 2},
                               timeout=30)
            assert errors_counted(url) == {"504": 1.0}
    finally:
        fleet.shutdown()
    assert r.status_code == 504, r.text
    err = r.json()["error"]
    assert err["code"] == "request_timeout" and "request_timeout_s" in err["message"]
    assert 0.5 <= took < 2.0
    assert small.status_code == 200  # the deadline is per request, not per server


def errors_counted(url: str) -> dict[str, float]:
    """raypaged:request_errors_total by status, as Prometheus scrapes it."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return {s.labels["status"]: s.value for f in text_string_to_metric_families(text)
            if f.name == "raypaged:request_errors" for s in f.samples
            if s.name.endswith("_total")}


def test_a_stream_past_its_deadline_ends_with_an_error_event_and_done():
    fleet = LocalFleet(step_delay_s=0.02)
    app, _ = make_app(fleet, RequestLimits(), request_timeout_s=0.5)
    try:
        with serving(app) as url:
            r = httpx.post(url + "/v1/completions", json={**SLOW, "stream": True}, timeout=30)
            assert idle(fleet)
            # an error after the stream's 200 is an error answered all the same
            assert errors_counted(url) == {"504": 1.0}
    finally:
        fleet.shutdown()
    assert r.status_code == 200
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "request_timeout"
    chunks = [json.loads(e) for e in events[:-2]]
    assert chunks and all("choices" in c for c in chunks)  # tokens came, then the deadline
    assert sum(len(c["choices"][0]["text"]) for c in chunks) < 200


def test_no_deadline_lets_a_long_request_finish():
    fleet = LocalFleet(step_delay_s=0.002)
    app, _ = make_app(fleet, RequestLimits(), request_timeout_s=None)
    try:
        with serving(app) as url:
            r = httpx.post(url + "/v1/completions", json=SLOW, timeout=30)
    finally:
        fleet.shutdown()
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 200


def test_a_slow_body_gets_408_and_its_connection_closed():
    fleet = LocalFleet()
    app, _ = make_app(fleet, RequestLimits(), body_timeout_s=0.5)
    try:
        with serving(app) as url:
            port = int(url.rsplit(":", 1)[1])
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                start = time.monotonic()  # the server's clock starts with the headers
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                          b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
                          b'{"prompt": ')  # ...and the rest never comes
                received = b""
                while chunk := s.recv(65536):  # until the server closes the connection
                    received += chunk
                took = time.monotonic() - start
            fast = httpx.post(url + "/v1/completions", timeout=30,
                              json={"model": "fake-model", "prompt": "a", "max_tokens": 2})
    finally:
        fleet.shutdown()
    assert received.startswith(b"HTTP/1.1 408"), received[:200]
    assert b"body_timeout_s" in received
    assert 0.5 <= took < 3.0
    assert fast.status_code == 200
