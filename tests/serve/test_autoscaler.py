"""The controller's autoscaler without Ray: fake workers whose stats say how loaded they are,
polled on a manual clock. Scale-out spawns a worker, scale-in drains the idlest one: it leaves
the routers' ready set at once, the fleet when its streams are done (or at the drain deadline),
and its actor is retired after the grace."""
from __future__ import annotations

import asyncio
import dataclasses

from fake_engine import FakeEngine
from raypaged.core.autoscale_policy import ScalePolicy
from raypaged.serve.autoscaler import DRAIN_GRACE_S, Autoscaler
from raypaged.serve.controller import Controller
from raypaged.serve.fleet import READY, STARTING
from raypaged.serve.worker import Worker

POLICY = ScalePolicy(min_workers=1, max_workers=2, target_wait_s=2.0, scale_in_load=0.5,
                     window_s=5.0, out_cooldown_s=2.0, in_cooldown_s=8.0)


class FakeWorker:
    def __init__(self, worker_id: str):
        self.base = Worker(FakeEngine(), worker_id).stats()
        self.computed = self.queued = self.active = 0
        self.answering = True

    async def probe(self):
        if not self.answering:
            await asyncio.sleep(10)
        e = self.base.engine
        preemption = dataclasses.replace(e.preemption, computed_tokens=self.computed)
        engine = dataclasses.replace(e, num_queued_tokens=self.queued, preemption=preemption)
        return dataclasses.replace(self.base, engine=engine, num_active=self.active)


class Fleet:
    def __init__(self):
        self.workers = {"worker-0": FakeWorker("worker-0")}
        self.retired = []
        self.controller = Controller([("worker-0", self.workers["worker-0"])],
                                     lambda h, since: h.probe(), poll_timeout_s=0.05)
        self.controller._ensure_polling = lambda: None  # polled by tick() alone
        self.controller.autoscaler = Autoscaler(POLICY, self.spawn, self.retired.append,
                                                drain_timeout_s=4.0, start_s=0.0, desired=1)
        self.now = 0.0

    def spawn(self):
        wid = f"worker-{len(self.workers)}"
        self.workers[wid] = FakeWorker(wid)
        self.workers[wid].answering = False  # loading its model
        return wid, self.workers[wid]

    def tick(self, computed_per_s=0, queued=0):
        """One second: every answering worker computed and has queued this much."""
        self.now += 1.0
        for w in self.workers.values():
            if w.answering:
                w.computed += computed_per_s
                w.queued = queued
        asyncio.run(self.controller.poll_once())
        self.controller.autoscaler.step(self.controller, self.now)
        return asyncio.run(self.controller.snapshot())


def test_scales_out_under_a_queue_then_drains_the_idle_worker_back_to_one():
    fleet = Fleet()
    snap = fleet.tick()
    assert [w.worker_id for w in snap.ready()] == ["worker-0"]
    # saturated: 5000 tokens queued, 1000 computed a second -> capacity 1000/s, wait 5 s
    fleet.tick(1000, 5000)
    snap = fleet.tick(1000, 5000)
    assert snap.scaling["capacity_tokens_per_s"] == 1000.0
    assert snap.scaling["predicted_wait_s"] == 5.0
    snap = fleet.tick(1000, 5000)  # the second poll over target (the first only measured)
    assert snap.scaling["desired"] == 2
    assert snap.scaling["decisions"][-1] == {"time": 4.0, "from": 1, "to": 2,
                                             "reason": "queue_wait", "wait_s": 5.0}
    assert {w.worker_id: w.state for w in snap.workers} == {"worker-0": READY,
                                                            "worker-1": STARTING}
    assert snap.scaling["starting"] == 1
    for _ in range(3):  # still loading: no second spawn however long the queue
        snap = fleet.tick(1000, 5000)
    assert len(fleet.workers) == 2 and snap.scaling["desired"] == 2
    fleet.workers["worker-1"].answering = True
    snap = fleet.tick(1000, 2000)
    assert [w.worker_id for w in snap.ready()] == ["worker-0", "worker-1"]
    assert snap.scaling["cold_starts"] == {"count": 1, "seconds_sum": 4.0, "last_s": 4.0}
    # the load goes: hold for in_cooldown_s (8 s) from worker-1 joining (last seen starting
    # at t=7)
    fleet.workers["worker-0"].active = 1  # one stream left on worker-0, none on worker-1
    for t in range(9, 15):
        snap = fleet.tick(0, 0)
        assert snap.scaling["desired"] == 2, t
    snap = fleet.tick(0, 0)  # t=15
    assert snap.scaling["desired"] == 1
    assert snap.scaling["decisions"][-1]["reason"] == "low_load"
    # the idlest worker drains: out of the ready set; nothing left on it, it leaves at the next
    # round, and its actor is retired DRAIN_GRACE_S later
    assert [w.worker_id for w in snap.ready()] == ["worker-0"]
    assert snap.worker("worker-1").draining_since == 15.0 and snap.worker("worker-1").state == READY
    snap = fleet.tick()
    assert [w.worker_id for w in snap.workers] == ["worker-0"]
    assert snap.scaling["drains"] == {"count": 1, "seconds_sum": 1.0, "last_s": 1.0,
                                      "streams_moved": 0}
    assert fleet.retired == []
    for _ in range(int(DRAIN_GRACE_S)):
        snap = fleet.tick()
    assert fleet.retired == [fleet.workers["worker-1"]]
    assert snap.scaling["desired"] == 1 and snap.scaling["serving"] == 1
    assert snap.to_json()["scaling"]["decisions_total"] == [
        {"direction": "in", "reason": "low_load", "count": 1},
        {"direction": "out", "reason": "queue_wait", "count": 1}]


def test_a_draining_worker_with_streams_leaves_at_the_drain_deadline():
    fleet = Fleet()
    fleet.controller.autoscaler.round.desired = 2  # as if it had scaled out
    fleet.tick()
    fleet.workers["worker-1"].answering = True
    fleet.tick()
    fleet.workers["worker-0"].active = 3
    fleet.workers["worker-1"].active = 2  # fewer: drained first
    fleet.controller.autoscaler.round.desired = 1
    fleet.controller.autoscaler.step(fleet.controller, fleet.now)
    snap = asyncio.run(fleet.controller.snapshot())
    assert [w.worker_id for w in snap.ready()] == ["worker-0"]
    # worker_up means "takes requests": a draining worker takes none (its other series stay)
    from raypaged.serve.metrics import RequestMetrics, render
    text = render(snap, RequestMetrics().snapshot(), "m").decode()
    assert 'raypaged:worker_up{model_name="m",worker="worker-0"} 1.0' in text
    assert 'raypaged:worker_up{model_name="m",worker="worker-1"} 0.0' in text
    assert 'raypaged:num_requests_running{model_name="m",worker="worker-1"}' in text
    draining_at = fleet.now
    for _ in range(3):  # 2 streams still running: it stays until drain_timeout_s (4 s)
        snap = fleet.tick()
        assert snap.worker("worker-1") is not None
    snap = fleet.tick()
    assert snap.worker("worker-1") is None
    assert fleet.now - draining_at == 4.0
    assert snap.scaling["drains"]["streams_moved"] == 2


def test_metrics_show_desired_and_actual_workers_decisions_and_drains():
    from raypaged.serve.metrics import RequestMetrics, render

    fleet = Fleet()
    fleet.tick()
    for _ in range(3):
        snap = fleet.tick(1000, 5000)
    text = render(snap, RequestMetrics().snapshot(), "m").decode()
    for line in ('raypaged:autoscaler_workers{model_name="m",state="desired"} 2.0',
                 'raypaged:autoscaler_workers{model_name="m",state="serving"} 1.0',
                 'raypaged:autoscaler_workers{model_name="m",state="starting"} 1.0',
                 'raypaged:autoscaler_workers{model_name="m",state="max_workers"} 2.0',
                 'raypaged:autoscaler_predicted_wait_seconds{model_name="m"} 5.0',
                 'raypaged:autoscaler_decisions_total{direction="out",model_name="m",'
                 'reason="queue_wait"} 1.0',
                 'raypaged:autoscaler_drains_total{model_name="m"} 0.0',
                 'raypaged:autoscaler_cold_starts_total{model_name="m"} 0.0'):
        assert line in text, line
