"""Worker lifecycle without Ray: the restart backoff's numbers, the controller killing a worker
that stays unresponsive, and a request that two workers died serving refused as suspected
poison (fake engines over HTTP in-process; tests/serve/test_lifecycle_ray.py does it on Ray)."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import time

import pytest

from local_fleet import (BEFORE_FIRST, DRAINED_MID_STREAM, FROZEN_MID_STREAM, MID_STREAM,
                         LocalFleet, client_for, local_app)
from raypaged.serve.config import ServeOptions
from raypaged.serve.fleet import READY, RESTARTING, UNRESPONSIVE
from raypaged.serve.controller import HEALTHY_S, next_start, overdue, restart_delay_s
from raypaged.serve.poison import PoisonMemory
from test_controller_membership import FakeWorker, ManualController

BODY = {"model": "fake-model", "prompt": "a prompt long enough for a block or two of bytes",
        "max_tokens": 12, "ignore_eos": True, "temperature": 0}


# -- restart backoff ---------------------------------------------------------------------------
def test_restart_delays_double_from_the_second_crash_in_a_row_and_stop_at_a_minute():
    assert [restart_delay_s(k) for k in range(1, 10)] == [0, 1, 2, 4, 8, 16, 32, 60, 60]


def test_a_crash_streak_grows_while_processes_die_young_and_ends_after_a_healthy_run():
    delay, ledger = next_start(None, now=1000.0)  # the actor's first process
    assert (delay, ledger) == (0.0, {"crashes": 0, "started": 1000.0})
    delay, ledger = next_start(ledger, now=1010.0)  # died after 10 s: restarts at once
    assert (delay, ledger) == (0.0, {"crashes": 1, "started": 1010.0})
    delay, ledger = next_start(ledger, now=1020.0)
    assert (delay, ledger) == (1.0, {"crashes": 2, "started": 1021.0})
    delay, ledger = next_start(ledger, now=1025.0)
    assert (delay, ledger) == (2.0, {"crashes": 3, "started": 1027.0})
    delay, ledger = next_start(ledger, now=1027.0 + HEALTHY_S)  # served 5 minutes: a new streak
    assert (delay, ledger) == (0.0, {"crashes": 1, "started": 1027.0 + HEALTHY_S})


def test_an_unresponsive_worker_is_overdue_from_its_last_kill_not_only_from_when_it_went_silent():
    assert not overdue(100.0, None, 129.0, 30.0)
    assert overdue(100.0, None, 130.0, 30.0)
    assert not overdue(100.0, 130.0, 140.0, 30.0)  # killed at 130: the kill is still landing
    assert overdue(100.0, 130.0, 160.0, 30.0)


# -- a worker whose node died ------------------------------------------------------------------
def test_a_down_worker_whose_node_died_is_marked_node_lost_until_it_answers_again(monkeypatch):
    import raypaged.serve.controller as controller
    monkeypatch.setattr(controller, "NODES_EVERY_S", 0.0)

    async def main():
        a, b = FakeWorker("worker-0"), FakeWorker("worker-1")
        a.stats = dataclasses.replace(a.stats, node_id="node-a")
        b.stats = dataclasses.replace(b.stats, node_id="node-b")
        live, asked = {"node-a", "node-b"}, []

        async def live_nodes():
            asked.append(sorted(live))
            return set(live)
        c = ManualController([("worker-0", a), ("worker-1", b)], lambda h, since: h.probe(),
                             poll_interval_s=60, poll_timeout_s=0.05, live_nodes=live_nodes)
        await c.poll_once()
        assert asked == []  # nobody down: the cluster is not asked
        b.behaviour = RESTARTING  # its process died
        await c.poll_once()
        view = (await c.snapshot()).worker("worker-1")
        assert (view.state, view.node_lost, view.error) == (RESTARTING, False, None)
        live.discard("node-b")  # the cluster's health checks found its node dead
        await c.poll_once()
        view = (await c.snapshot()).worker("worker-1")
        assert (view.state, view.node_lost) == (RESTARTING, True)
        assert view.error == "its node node-b is dead"
        assert (await c.snapshot()).to_json()["workers"][1]["node_lost"] is True
        await c.poll_once()
        assert len(asked) == 2  # known lost: not asked again
        # the polls after it keep saying why (Ray's "unavailable" carries no cause)
        assert (await c.snapshot()).worker("worker-1").error == "its node node-b is dead"
        b.restart()  # Ray placed a new process on another node
        b.stats = dataclasses.replace(b.stats, node_id="node-c")
        await c.poll_once()
        view = (await c.snapshot()).worker("worker-1")
        assert (view.state, view.node_lost, view.error) == (READY, False, None)
        assert not (await c.snapshot()).worker("worker-0").node_lost
    asyncio.run(main())


# -- the controller kills a worker that stays unresponsive ----------------------------------
def test_the_controller_kills_a_worker_unresponsive_past_its_deadline_once_per_deadline():
    async def main():
        a, b = FakeWorker("worker-0"), FakeWorker("worker-1")
        killed = []
        c = ManualController([("worker-0", a), ("worker-1", b)], lambda h, since: h.probe(),
                             poll_interval_s=0.05, poll_timeout_s=0.05, kill=killed.append,
                             unresponsive_timeout_s=0.5)
        await c.poll_once()
        a.behaviour = "hang"  # SIGSTOP, or an engine step that never ends
        await c.poll_once()
        await c.poll_once()
        view = (await c.snapshot()).worker("worker-0")
        assert view.state == UNRESPONSIVE and killed == [] and view.kills == 0
        await asyncio.sleep(0.5)
        await c.poll_once()
        await c.poll_once()  # the kill has not landed yet: not killed twice
        view = (await c.snapshot()).worker("worker-0")
        assert killed == [a] and view.kills == 1 and view.state == UNRESPONSIVE
        assert re.fullmatch(r"killed after \d+ s unresponsive \(no answer\)", view.error)
        await asyncio.sleep(0.5)
        await c.poll_once()  # still silent a whole deadline after the kill: again
        assert killed == [a, a]
        a.restart()  # Ray's new process answers
        await c.poll_once()
        view = (await c.snapshot()).worker("worker-0")
        assert (view.state, view.restarts, view.kills) == (READY, 1, 2)
        assert (await c.snapshot()).to_json()["workers"][0]["kills"] == 2
        assert (await c.snapshot()).worker("worker-1").kills == 0
    asyncio.run(main())


# -- suspected poison ----------------------------------------------------------------------
def run_all(fleet: LocalFleet, *steps):
    """Each step(client) in turn on one router (one dispatcher, one poison memory)."""
    app, metrics = local_app(fleet)

    async def main():
        async with client_for(app) as client:
            return [await step(client) for step in steps]
    try:
        return asyncio.run(main()), metrics
    finally:
        fleet.shutdown()


def post(body):
    return lambda c: c.post("/v1/completions", json=body)


def events(r) -> list[str]:
    return [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]


@pytest.mark.parametrize("death", [MID_STREAM, FROZEN_MID_STREAM])
def test_a_request_two_workers_died_serving_is_refused_as_suspected_poison(death):
    fleet = LocalFleet(n=3, step_delay_s=0.005)
    fleet.failing.update({w: death for w in fleet.workers})
    (r,), metrics = run_all(fleet, post(BODY))
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == "suspected_poison_request"
    assert "suspected poison request" in error["message"]
    assert "not retried again" in error["message"]
    # retried once (on a second worker), never on the third
    assert metrics.counters["request_retries"] == {"": 1.0}
    assert metrics.counters["suspected_poison_requests"] == {"refused": 1.0}
    assert sum(w.stats().num_active for w in fleet.workers.values()) == 0


def test_a_stream_two_workers_died_serving_ends_with_the_poison_error_event():
    fleet = LocalFleet(n=3, step_delay_s=0.005)
    fleet.failing.update({w: MID_STREAM for w in fleet.workers})
    (r,), _ = run_all(fleet, post({**BODY, "stream": True}))
    ev = events(r)
    assert ev[-1] == "[DONE]"
    assert json.loads(ev[-2])["error"]["code"] == "suspected_poison_request"
    assert all("choices" in json.loads(e) for e in ev[:-2])


def test_the_same_request_sent_again_is_refused_before_any_worker_sees_it():
    fleet = LocalFleet(n=3, step_delay_s=0.005)
    fleet.failing.update({w: MID_STREAM for w in fleet.workers})

    def heal(c):
        fleet.failing.clear()  # the next links are healthy: only the memory can refuse now
        return asyncio.sleep(0)

    submitted = []
    for w in fleet.workers.values():
        w.submit = (lambda real: lambda *a, **k: submitted.append(a[1]) or real(*a, **k))(w.submit)

    (first, _, again, other), metrics = run_all(
        fleet, post(BODY), heal, post(BODY), post({**BODY, "prompt": BODY["prompt"] + "!"}))
    assert first.status_code == 400
    assert again.status_code == 400
    assert again.json()["error"]["code"] == "suspected_poison_request"
    assert other.status_code == 200  # a different request is served as ever
    # two workers died serving the first; the second never reached a worker
    first_id = submitted[0]
    assert submitted[:2] == [first_id, f"{first_id}-1"] and len(submitted) == 3
    assert metrics.counters["suspected_poison_requests"] == {"refused": 1.0,
                                                             "refused_again": 1.0}


def test_one_death_is_retried_and_served():
    fleet = LocalFleet(n=3, step_delay_s=0.005)
    (clean,), _ = run_all(LocalFleet(n=3, step_delay_s=0.005), post(BODY))
    fleet.failing[clean.headers["x-raypaged-worker"]] = MID_STREAM
    (r,), metrics = run_all(fleet, post(BODY))
    assert r.status_code == 200 and r.json()["choices"] == clean.json()["choices"]
    assert not metrics.counters["suspected_poison_requests"]


def test_workers_the_request_never_reached_do_not_make_it_poison():
    fleet = LocalFleet(n=3, step_delay_s=0.005)
    (clean,), _ = run_all(LocalFleet(n=3, step_delay_s=0.005), post(BODY))
    home = clean.headers["x-raypaged-worker"]
    others = [w for w in fleet.workers if w != home]
    fleet.failing.update({home: BEFORE_FIRST, others[0]: BEFORE_FIRST, others[1]: MID_STREAM})
    (r,), metrics = run_all(fleet, post(BODY))
    # two workers lost at submit, one after accepting it: MAX_FAILOVERS (503), not poison
    assert r.status_code == 503 and r.json()["error"]["code"] == "worker_unavailable"
    assert not metrics.counters["suspected_poison_requests"]


def test_a_worker_that_drained_away_does_not_count_as_a_death():
    fleet = LocalFleet(n=3, step_delay_s=0.005)
    (clean,), _ = run_all(LocalFleet(n=3, step_delay_s=0.005), post(BODY))
    home = clean.headers["x-raypaged-worker"]
    fleet.failing[home] = DRAINED_MID_STREAM  # leaves the fleet: the stream goes on elsewhere
    for w in fleet.workers:
        if w != home:
            fleet.failing[w] = MID_STREAM  # ... where one worker then dies
    fleet.failing[sorted(w for w in fleet.workers if w != home)[0]] = None
    (r,), metrics = run_all(fleet, post(BODY))
    assert r.status_code == 200, r.text
    assert r.json()["choices"] == clean.json()["choices"]
    assert not metrics.counters["suspected_poison_requests"]


# -- the last ready worker is spared ----------------------------------------------------------
def _spared(restart: bool, other_fails: str | None = None, node_dies: bool = False):
    """On 2 workers the request's worker dies mid-stream and restarts (or not; or its node
    dies with it): what each worker was sent, in order, and the responses of the request and of
    another one sent while the first waited."""
    fleet = LocalFleet(n=2, step_delay_s=0.005, restart_on_death=True)
    (clean,), _ = run_all(LocalFleet(n=2, step_delay_s=0.005), post(BODY))
    home = clean.headers["x-raypaged-worker"]
    other = next(w for w in fleet.workers if w != home)
    fleet.failing[home] = MID_STREAM
    if other_fails:
        fleet.failing[other] = other_fails
    sent = []  # (worker, request id), across restarts
    for wid, w in fleet.workers.items():
        record_submits(w, wid, sent)
    app, metrics = local_app(fleet)

    async def main():
        async with client_for(app) as client:
            first = asyncio.create_task(client.post("/v1/completions", json=BODY))
            while home not in fleet.restarting:
                await asyncio.sleep(0.01)
            if node_dies:
                fleet.node_lost.add(home)
            meanwhile = None if other_fails else await client.post(
                "/v1/completions", json={**BODY, "prompt": "someone else's prompt"})
            await asyncio.sleep(0.5)  # two watch periods: still waiting, not on `other`
            waiting = not first.done()
            if restart:
                sent.append(("restarted", home))
                fleet.restart(home)
                record_submits(fleet.workers[home], home, sent)
            return await first, meanwhile, waiting
    try:
        (r, meanwhile, waiting) = asyncio.run(main())
    finally:
        fleet.shutdown()
    return r, meanwhile, waiting, sent, home, other, clean, metrics


def record_submits(worker, worker_id: str, sent: list) -> None:
    real = worker.submit

    def submit(*args, **kwargs):
        sent.append((worker_id, args[1]))  # (router id, request id, ...)
        return real(*args, **kwargs)
    worker.submit = submit


def test_a_request_whose_worker_died_waits_for_its_restart_not_the_last_ready_worker():
    r, meanwhile, waiting, sent, home, other, clean, metrics = _spared(restart=True)
    assert r.status_code == 200 and r.json()["choices"] == clean.json()["choices"]
    assert waiting  # half a second after the death, with `other` ready, it had not moved there
    assert meanwhile.status_code == 200 and meanwhile.headers["x-raypaged-worker"] == other
    first_id = sent[0][1]
    # sent to home, continued on `other` only once home was back: never while `other` was the
    # last ready worker
    mine = [s for s in sent if s[1].startswith(first_id) or s[0] == "restarted"]
    assert mine == [(home, first_id), ("restarted", home), (other, f"{first_id}-1")]
    assert metrics.counters["request_retries"] == {"": 1.0}


def test_a_worker_that_does_not_come_back_in_time_leaves_the_request_to_the_last_one(
        monkeypatch):
    import raypaged.serve.failover as failover
    monkeypatch.setattr(failover, "SPARE_WAIT_S", 1.0)
    r, meanwhile, waiting, sent, home, other, clean, _ = _spared(restart=False)
    assert r.status_code == 200 and r.json()["choices"] == clean.json()["choices"]
    assert waiting and meanwhile.status_code == 200
    first_id = sent[0][1]
    assert [s for s in sent if s[1].startswith(first_id)] == [(home, first_id),
                                                             (other, f"{first_id}-1")]


def test_a_request_does_not_wait_for_a_worker_whose_node_died(monkeypatch):
    import raypaged.serve.failover as failover
    monkeypatch.setattr(failover, "SPARE_WAIT_S", 30.0)
    start = time.monotonic()
    r, meanwhile, waiting, sent, home, other, clean, metrics = _spared(restart=False,
                                                                       node_dies=True)
    assert r.status_code == 200 and r.json()["choices"] == clean.json()["choices"]
    assert not waiting  # half a second after the death it was served on `other`
    assert time.monotonic() - start < failover.SPARE_WAIT_S / 2
    first_id = sent[0][1]
    assert [s for s in sent if s[1].startswith(first_id)] == [(home, first_id),
                                                             (other, f"{first_id}-1")]
    assert metrics.counters["request_retries"] == {"": 1.0}


def test_a_worker_lost_serving_the_request_takes_it_again_as_a_new_process_if_none_is_left():
    # home dies mid-stream and restarts; then `other` is lost before the request reaches it
    r, _, waiting, sent, home, other, clean, metrics = _spared(restart=True,
                                                               other_fails=BEFORE_FIRST)
    assert r.status_code == 200, r.text
    assert r.json()["choices"] == clean.json()["choices"]
    first_id = sent[0][1]
    mine = [s for s in sent if s[1].startswith(first_id) or s[0] == "restarted"]
    # `other` never took it (lost at submit); the new process of home did, not a 503
    assert mine == [(home, first_id), ("restarted", home), (home, f"{first_id}-2")]
    assert metrics.counters["request_retries"] == {"": 2.0}


def test_a_stream_waiting_for_a_spare_ends_at_its_deadline_and_is_not_sent_again():
    fleet = LocalFleet(n=2, step_delay_s=0.005, restart_on_death=True)
    (clean,), _ = run_all(LocalFleet(n=2, step_delay_s=0.005), post(BODY))
    home = clean.headers["x-raypaged-worker"]
    fleet.failing[home] = MID_STREAM  # dies, and is never restarted
    sent = []
    for wid, w in fleet.workers.items():
        record_submits(w, wid, sent)
    app, _ = local_app(fleet, options=ServeOptions(request_timeout_s=1.5))

    async def main():
        async with client_for(app) as client:
            start = time.monotonic()
            r = await client.post("/v1/completions", json={**BODY, "stream": True})
            return r, time.monotonic() - start
    try:
        r, took = asyncio.run(main())
    finally:
        fleet.shutdown()
    ev = events(r)
    assert ev[-1] == "[DONE]" and json.loads(ev[-2])["error"]["code"] == "request_timeout"
    assert 1.5 <= took < 5  # at its deadline, not SPARE_WAIT_S
    assert len(sent) == 1  # never sent to the last ready worker


def test_the_poison_memory_forgets_after_its_time_and_keeps_only_the_newest():
    memory = PoisonMemory(remember_s=10.0, most=2)
    memory.remember(b"a", "A", now=0.0)
    memory.remember(b"b", "B", now=1.0)
    memory.remember(b"c", "C", now=2.0)  # pushes "a" out
    assert [memory.refused(k, now=5.0) for k in (b"a", b"b", b"c")] == [None, "B", "C"]
    assert memory.refused(b"b", now=11.0) is None and memory.refused(b"c", now=11.0) == "C"
    assert memory.refused(b"c", now=12.0) is None and not memory
