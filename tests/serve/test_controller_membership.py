"""Controller without Ray: membership states from polls, restarts re-admitted, the fleet totals."""
from __future__ import annotations

import asyncio
import dataclasses

from fake_engine import FakeEngine
from raypaged.serve.controller import Controller, WorkerDown
from raypaged.serve.fleet import DEAD, READY, RESTARTING, STARTING, UNRESPONSIVE
from raypaged.serve.worker import Worker


class FakeWorker:
    """Answers polls as told: stats, a hang, or a WorkerDown."""

    def __init__(self, worker_id: str):
        self.stats = Worker(FakeEngine(), worker_id).stats()
        self.behaviour = "answer"

    async def probe(self):
        if self.behaviour == "hang":
            await asyncio.sleep(10)
        if self.behaviour in (RESTARTING, DEAD):
            raise WorkerDown(self.behaviour)
        return self.stats

    def restart(self):
        self.stats = dataclasses.replace(self.stats, incarnation="new-process")
        self.behaviour = "answer"


class ManualController(Controller):
    """Polls only when the test says so."""

    def _ensure_polling(self) -> None:
        pass


def make():
    a, b = FakeWorker("worker-0"), FakeWorker("worker-1")
    controller = ManualController([("worker-0", a), ("worker-1", b)], lambda h, since: h.probe(),
                            poll_interval_s=60, poll_timeout_s=0.05)
    return controller, a, b


def states(snapshot):
    return {w.worker_id: w.state for w in snapshot.workers}


def test_workers_start_as_starting_and_become_ready_when_they_answer():
    async def main():
        c, a, b = make()
        a.behaviour = "hang"  # still loading its model
        assert states(await c.snapshot()) == {"worker-0": STARTING, "worker-1": STARTING}
        await c.poll_once()
        snap = await c.snapshot()
        assert states(snap) == {"worker-0": STARTING, "worker-1": READY}
        assert [w.worker_id for w in snap.ready()] == ["worker-1"]
    asyncio.run(main())


def test_a_worker_that_stops_answering_is_unresponsive_and_keeps_its_last_stats():
    async def main():
        c, a, b = make()
        await c.poll_once()
        a.behaviour = "hang"
        await c.poll_once()
        view = (await c.snapshot()).worker("worker-0")
        assert view.state == UNRESPONSIVE and view.stats is not None and not view.ready
        a.behaviour = "answer"
        await c.poll_once()
        assert (await c.snapshot()).worker("worker-0").state == READY
    asyncio.run(main())


def test_a_restarted_worker_is_re_admitted_and_its_restart_counted():
    async def main():
        c, a, b = make()
        await c.poll_once()
        a.behaviour = RESTARTING
        await c.poll_once()
        assert (await c.snapshot()).worker("worker-0").state == RESTARTING
        a.restart()
        await c.poll_once()
        view = (await c.snapshot()).worker("worker-0")
        assert view.state == READY and view.restarts == 1
    asyncio.run(main())


def test_a_dead_worker_leaves_the_ready_set_and_the_totals():
    async def main():
        c, a, b = make()
        await c.poll_once()
        both = (await c.snapshot()).totals()
        b.behaviour = DEAD
        await c.poll_once()
        snap = await c.snapshot()
        assert states(snap)["worker-1"] == DEAD and len(snap.ready()) == 1
        one = snap.totals()
        assert one["num_blocks"] * 2 == both["num_blocks"] and one["workers_ready"] == 1
        assert one["workers_total"] == 2
    asyncio.run(main())


def test_router_metrics_reported_to_the_controller_are_in_the_snapshot():
    async def main():
        c, _, _ = make()
        await c.report_router_metrics("replica-a", {"counters": {}, "histograms": {}})
        assert set((await c.snapshot()).router_metrics) == {"replica-a"}
    asyncio.run(main())


def test_prompt_tokens_the_routers_hold_back_are_summed_while_their_reports_are_fresh(
        monkeypatch):
    """What the autoscaler adds to the workers' queues: each replica's last report, until the
    replica has been silent for HELD_FRESH_S (a router that went away holds nothing)."""
    from raypaged.serve import controller as controller_module

    async def main():
        c, _, _ = make()
        empty = {"counters": {}, "histograms": {}}
        await c.report_router_metrics("replica-a", empty, [], 1200)
        await c.report_router_metrics("replica-b", empty, [], 300)
        await c.report_router_metrics("replica-a", empty, [], 700)  # the latest counts
        assert c.held_prompt_tokens() == 1000
        now = controller_module.time.monotonic()
        monkeypatch.setattr(controller_module.time, "monotonic",
                            lambda: now + controller_module.HELD_FRESH_S + 0.1)
        await c.report_router_metrics("replica-b", empty, [], 300)
        assert c.held_prompt_tokens() == 300
    asyncio.run(main())


def test_the_controller_polls_by_itself_once_asked_for_a_snapshot():
    async def main():
        a = FakeWorker("worker-0")
        c = Controller([("worker-0", a)], lambda h, since: h.probe(), poll_interval_s=0.01,
                       poll_timeout_s=0.05)
        assert (await c.snapshot()).ready() == []
        for _ in range(100):
            await asyncio.sleep(0.01)
            if (await c.snapshot()).ready():
                break
        assert [w.worker_id for w in (await c.snapshot()).ready()] == ["worker-0"]
    asyncio.run(main())
