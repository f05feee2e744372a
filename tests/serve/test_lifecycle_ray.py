"""Worker lifecycle on a real Ray fleet (fake engines): a worker frozen with SIGSTOP is killed
and replaced by a new process after --worker-unresponsive-timeout-s; a request that crashes
every worker it reaches takes two workers down, not more, is refused as suspected poison, and
is refused at once when sent again; workers that crash again soon back off."""
from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from fake_engine import CRASH_SEED, FAKE_MODEL
from serve_testing import deploy

UNRESPONSIVE_S = 10.0  # longer than a kill takes to land on a stopped process (~6 s)


@pytest.fixture(scope="module")
def fleet(ray_serve):
    from ray import serve

    served = deploy("raypaged-lifecycle", "/lifecycle", ray_serve, None, workers=2,
                    cpus_per_worker=1, max_model_len=256,
                    worker_unresponsive_timeout_s=UNRESPONSIVE_S,
                    model=FAKE_MODEL)
    served.wait_ready(2)
    yield served
    serve.delete(served.name)


def workers(app) -> dict[str, dict]:
    return {w["worker_id"]: w for w in app.fleet()["workers"]}


def wait_until(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.25)
    raise TimeoutError(what)


def test_a_frozen_worker_is_killed_and_replaced_by_a_new_process(fleet):
    before = workers(fleet)["worker-0"]
    pid = before["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_until(lambda: workers(fleet)["worker-0"]["state"] == "unresponsive", 30,
                   "the frozen worker was never marked unresponsive")
        # never thawed: only the kill brings it back
        after = wait_until(lambda: (w := workers(fleet)["worker-0"])["state"] == "ready"
                           and w.get("pid") != pid and w, 120,
                           f"worker-0 not replaced: {workers(fleet)['worker-0']}")
    finally:
        if os.path.exists(f"/proc/{pid}"):
            os.kill(pid, signal.SIGCONT)
    assert after["kills"] == before["kills"] + 1
    assert after["restarts"] == before["restarts"] + 1
    assert not os.path.exists(f"/proc/{pid}") or _zombie(pid)
    r = httpx.post(f"{fleet.url}/v1/completions", timeout=30,
                   json={"prompt": "hello", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200


def _zombie(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "Z"


def poison_body(prompt: str) -> dict:
    return {"prompt": prompt, "max_tokens": 4, "temperature": 1.0, "seed": CRASH_SEED}


def counter(app, name: str) -> dict[str, float]:
    text = httpx.get(f"{app.url}/metrics", timeout=10).text
    return {s.labels.get("outcome", ""): s.value for f in text_string_to_metric_families(text)
            if f.name == name for s in f.samples if s.name.endswith("_total")}


def crash_ledger(handle) -> dict:
    raw = ray.experimental.internal_kv._internal_kv_get(
        f"raypaged:restarts:{handle._actor_id.hex()}")
    return json.loads(raw)


def test_a_request_that_kills_its_workers_takes_down_two_then_is_refused_and_remembered(fleet):
    fleet.wait_ready(2, timeout=120)
    pids = {w: v["pid"] for w, v in workers(fleet).items()}
    restarts = {w: v["restarts"] for w, v in workers(fleet).items()}

    r = httpx.post(f"{fleet.url}/v1/completions", json=poison_body("crash me"), timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "suspected_poison_request"
    assert "worker-0" in error["message"] and "worker-1" in error["message"]
    assert "not retried again" in error["message"]

    # both restarted (first crash: no wait), the second just before the refusal: the fleet
    # sees it die a poll later
    def restarted():
        now = fleet.fleet()
        return now if all(w["state"] == "ready" and w["restarts"] > restarts[w["worker_id"]]
                          for w in now["workers"]) else None
    back = wait_until(restarted, 120, "both workers not restarted")
    assert {w["worker_id"]: w["restarts"] for w in back["workers"]} == {
        w: n + 1 for w, n in restarts.items()}
    new_pids = {w["worker_id"]: w["pid"] for w in back["workers"]}
    assert all(new_pids[w] != pids[w] for w in pids)

    again = httpx.post(f"{fleet.url}/v1/completions", json=poison_body("crash me"), timeout=60)
    assert again.status_code == 400
    assert again.json()["error"]["code"] == "suspected_poison_request"
    assert {w["worker_id"]: w["pid"] for w in workers(fleet).values()} == new_pids  # none died

    def counted():
        c = counter(fleet, "raypaged:suspected_poison_requests")
        return c if c.get("refused_again") == 1 else None
    assert wait_until(counted, 10, "metrics not pushed") == {"refused": 1.0, "refused_again": 1.0}
    # /fleet has it from the controller, which routers push to every second
    assert wait_until(lambda: fleet.fleet()["suspected_poison_requests"].get("refused_again"),
                      10, "/fleet never counted it")
    assert fleet.fleet()["suspected_poison_requests"] == {"refused": 1.0, "refused_again": 1.0}


def test_workers_that_crash_again_soon_wait_before_they_restart(fleet):
    fleet.wait_ready(2, timeout=120)
    handles = fleet.workers()
    before = {w: crash_ledger(h)["crashes"] for w, h in handles.items()}
    # a different request (not remembered) that crashes both workers once more
    r = httpx.post(f"{fleet.url}/v1/completions", json=poison_body("crash me too"), timeout=60)
    assert r.json()["error"]["code"] == "suspected_poison_request"
    # the second worker died just before the refusal: its restart is a poll or more away
    wait_until(lambda: all(crash_ledger(h)["crashes"] > before[w] for w, h in handles.items()),
               120, "both crashes not recorded")
    fleet.wait_ready(2, timeout=120)
    ledgers = {w: crash_ledger(h) for w, h in handles.items()}
    # the second crash in a row within 5 minutes: each waited 1 s (lifecycle.restart_delay_s)
    assert {w: v["crashes"] for w, v in ledgers.items()} == {w: n + 1 for w, n in before.items()}
    assert all(v["crashes"] >= 2 for v in ledgers.values())
