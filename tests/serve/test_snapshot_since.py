"""What a router's refresh carries (no Ray): nothing when it holds the controller's latest
snapshot, worker handles only the first time it sees them, everything from a controller of
another epoch; and the router's fleet client puts the handles back."""
from __future__ import annotations

import asyncio
import pickle

from test_controller_membership import FakeWorker, ManualController
from raypaged.serve.metrics import RequestMetrics
from raypaged.serve.ray_fleet import RayFleetClient


def make(n: int = 3):
    workers = {f"worker-{i}": FakeWorker(f"worker-{i}") for i in range(n)}
    controller = ManualController(list(workers.items()), lambda h, since: h.probe(),
                                  poll_interval_s=60, poll_timeout_s=0.05)
    return controller, workers


def handles(snapshot):
    return {v.worker_id: v.handle for v in snapshot.workers}


def test_a_router_holding_the_latest_gets_nothing_and_handles_go_once():
    async def main():
        c, workers = make()
        await c.poll_once()
        first = await c.snapshot()
        assert handles(first) == workers  # a router with nothing gets every handle
        assert await c.snapshot((first.epoch, first.version)) is None

        await c.poll_once()
        second = await c.snapshot((first.epoch, first.version))
        assert second.version == first.version + 1
        assert handles(second) == {w: None for w in workers}  # it holds them already
        assert len(pickle.dumps(second)) < len(pickle.dumps(await c.snapshot()))

        c.add_worker("worker-9", FakeWorker("worker-9"))
        third = await c.snapshot((second.epoch, second.version))
        assert {w: h is not None for w, h in handles(third).items()} == {
            "worker-0": False, "worker-1": False, "worker-2": False, "worker-9": True}
        # another controller's versions mean nothing here: every handle
        assert all(h is not None for h in handles(await c.snapshot(("other", third.version))))
    asyncio.run(main())


class Remote:
    """The controller as a Ray actor handle would present it to the fleet client."""

    def __init__(self, controller):
        self.asked = []

        def method(fn, record=False):
            class M:
                @staticmethod
                def remote(*args):
                    if record:
                        self.asked.append(args)
                    return fn(*args)
            return M

        self.snapshot = method(controller.snapshot, record=True)
        self.cache_deltas = method(controller.cache_deltas)
        self.report_router_metrics = method(controller.report_router_metrics)


def test_the_fleet_client_keeps_every_handle_across_refreshes_that_leave_them_out():
    async def main():
        c, workers = make()
        remote = Remote(c)

        async def resolve():
            return remote

        client = RayFleetClient(resolve, "replica", RequestMetrics())
        await c.poll_once()
        await client._refresh()
        await client._refresh()  # nothing new: the controller answers None
        assert remote.asked == [(None,), ((c.epoch, c._version),)]
        await c.poll_once()
        c.add_worker("worker-9", FakeWorker("worker-9"))
        await client._refresh()
        snap = client.snapshot()
        assert snap.version == c._version
        assert handles(snap) == {**workers, "worker-9": c._views["worker-9"].handle}
    asyncio.run(main())
