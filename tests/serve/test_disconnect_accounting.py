"""A client that leaves is an abort: counted in request_success{finished_reason="abort"} and in
e2e latency, never as a 500, and with no traceback in the logs."""
from __future__ import annotations

import glob
import os

import httpx
from prometheus_client.parser import text_string_to_metric_families

BODY = {"prompt": "a prompt for a request its client abandons", "max_tokens": 200,
        "ignore_eos": True}


def metric(app, name: str, **labels) -> float:
    text = httpx.get(f"{app.url}/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def errors_by_status(app) -> dict[str, float]:
    text = httpx.get(f"{app.url}/metrics").text
    return {s.labels.get("status", ""): s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == "raypaged:request_errors_total"}


def tracebacks() -> int:
    """Tracebacks and unretrieved task errors in every log of the local Ray session."""
    import ray

    logs = ray._private.worker._global_node.get_logs_dir_path()
    count = 0
    for path in glob.glob(os.path.join(logs, "**", "*"), recursive=True):
        if os.path.isfile(path) and path.endswith((".log", ".err", ".out")):
            with open(path, errors="replace") as f:
                text = f.read()
            count += text.count("Traceback") + text.count("never retrieved")
    return count


def settled(app, name: str, want: float, **labels) -> float:
    import time

    deadline = time.monotonic() + 5  # the router ships its metrics every second
    while (value := metric(app, name, **labels)) < want and time.monotonic() < deadline:
        time.sleep(0.2)
    return value


def test_disconnects_count_as_aborts_not_errors_and_log_no_traceback(fake_fleet):
    aborts = metric(fake_fleet, "raypaged:request_success_total", finished_reason="abort")
    e2e = metric(fake_fleet, "raypaged:e2e_request_latency_seconds_count")
    errors = metric(fake_fleet, "raypaged:request_errors_total")
    logged = tracebacks()

    with httpx.stream("POST", f"{fake_fleet.url}/v1/completions", json={**BODY, "stream": True},
                      timeout=60) as r:
        assert r.status_code == 200
        events = 0
        for line in r.iter_lines():  # leaving the loop closes the connection
            events += line.startswith("data: ")
            if events == 3:
                break
    try:
        httpx.post(f"{fake_fleet.url}/v1/completions", json=BODY, timeout=1.0)
    except httpx.TimeoutException:
        pass
    else:
        raise AssertionError("the non-streaming request finished before its client left")

    assert settled(fake_fleet, "raypaged:request_success_total", aborts + 2,
                   finished_reason="abort") == aborts + 2
    assert metric(fake_fleet, "raypaged:e2e_request_latency_seconds_count") == e2e + 2
    assert metric(fake_fleet, "raypaged:request_errors_total") == errors, errors_by_status(fake_fleet)
    assert tracebacks() == logged
