"""A router's fleet client while its controller dies and comes back, without Ray: the last
snapshot stays in use, a new controller's unpolled snapshot does not replace it, and the cache
views are re-synced whole from the new controller."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

from ray.exceptions import ActorDiedError

from raypaged.core.cache_summary import CacheSummary
from raypaged.serve.fleet import READY, STARTING, FleetSnapshot, WorkerView
from raypaged.serve.metrics import RequestMetrics
from raypaged.serve.ray_fleet import RayFleetClient


class Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        async def call():
            return self.fn(*args)
        return call()


class FakeController:
    """Answers snapshot / cache_deltas like the controller actor, or raises as a dead one."""

    def __init__(self, snapshot: FleetSnapshot, cache: CacheSummary):
        self.dead = False
        self.asked_versions: list[dict] = []

        def answer(fn):
            def call(*args):
                if self.dead:
                    raise ActorDiedError()
                return fn(*args)
            return Method(call)

        def deltas(versions):
            self.asked_versions.append(dict(versions))
            return {"worker-0": cache.delta_since(versions.get("worker-0", -1))}

        self.snapshot = answer(lambda known=None: self.current)  # always the whole view
        self.cache_deltas = answer(deltas)
        self.report_router_metrics = answer(lambda *a: None)
        self.current = snapshot


def fleet(version: int, state: str) -> FleetSnapshot:
    return FleetSnapshot(version, (WorkerView("worker-0", state, handle=None),))


def test_the_last_snapshot_outlives_the_controller_and_a_new_one_takes_over_once_it_polled():
    async def main():
        old_cache, new_cache = CacheSummary(), CacheSummary()
        for h in (b"a" * 8, b"b" * 8, b"c" * 8):
            old_cache.add(h)
        new_cache.add(b"a" * 8)  # the new controller's mirror: versions counted afresh
        old = FakeController(fleet(7, READY), old_cache)
        new = FakeController(fleet(0, STARTING), new_cache)
        controllers = [old]

        async def resolve():
            return controllers[-1]

        client = RayFleetClient(resolve, "replica", RequestMetrics())
        await client._refresh()
        assert client.snapshot().version == 7
        assert len(client.snapshot().caches["worker-0"].keys) == 3

        old.dead = True
        try:
            await client._refresh()
        except ActorDiedError:
            pass
        else:
            raise AssertionError("a dead controller's error reaches the refresh loop")
        assert client.snapshot().version == 7 and client.snapshot().ready()  # still routing

        controllers.append(new)
        await client._refresh()  # the new controller has not polled yet: keep ours
        assert client.snapshot().version == 7 and client.snapshot().ready()

        new.current = fleet(1, READY)
        await client._refresh()
        assert client.snapshot().version == 1
        assert new.asked_versions == [{"worker-0": -1}]  # whole summaries, not old versions
        assert client.snapshot().caches["worker-0"].keys == new_cache.keys
    asyncio.run(main())


def test_a_worker_that_left_the_fleet_leaves_the_routers_cache_index():
    """A drained worker leaves the controller's snapshot and its cache mirror; the router drops
    its copy of that cache too (an autoscaled fleet drains a worker at every scale-in: kept,
    every router would hold every departed worker's keys for ever), and a worker that comes
    back under the same id is synced whole."""
    async def main():
        caches = {"worker-0": CacheSummary(), "worker-1": CacheSummary()}
        caches["worker-0"].add(b"a" * 8)
        for h in (b"b" * 8, b"c" * 8):
            caches["worker-1"].add(h)
        both = FleetSnapshot(1, (WorkerView("worker-0", READY, handle=None),
                                 WorkerView("worker-1", READY, handle=None)))
        ctl = FakeController(both, CacheSummary())
        ctl.cache_deltas = Method(lambda versions: {
            wid: c.delta_since(versions.get(wid, -1), depths=False) for wid, c in caches.items()
            if c.version != versions.get(wid, -1)})

        async def resolve():
            return ctl

        client = RayFleetClient(resolve, "replica", RequestMetrics())
        await client._refresh()
        assert sorted(client.snapshot().caches) == ["worker-0", "worker-1"]

        del caches["worker-1"]  # drained: out of the snapshot and of the controller's mirrors
        ctl.current = FleetSnapshot(2, (WorkerView("worker-0", READY, handle=None),))
        await client._refresh()
        assert sorted(client.snapshot().caches) == ["worker-0"]
        index = client._cache_index
        assert sorted(index.holders) == [int.from_bytes(b"a" * 8, "little")]

        caches["worker-1"] = CacheSummary()  # back under the same id, a new cache
        caches["worker-1"].add(b"d" * 8)
        ctl.current = both
        await client._refresh()
        assert client.snapshot().caches["worker-1"].keys == {int.from_bytes(b"d" * 8, "little")}
    asyncio.run(main())


class EndlessOutputs:
    """A worker handle's `outputs` stream that stays open and quiet."""

    def remote(self, router_id):
        async def stream():
            await asyncio.Event().wait()
            yield
        return stream()


def test_a_worker_that_left_the_fleet_leaves_the_routers_links(monkeypatch):
    """Its stream is closed and its link forgotten: kept, every router would hold a link (and
    the actor handle in it) for each worker an autoscaled fleet ever drained."""
    closed = []
    monkeypatch.setattr("raypaged.serve.worker_link.ray.cancel", closed.append)

    async def main():
        handle = SimpleNamespace(outputs=EndlessOutputs())
        views = [WorkerView(f"worker-{i}", READY, handle=handle) for i in (0, 1)]
        ctl = FakeController(FleetSnapshot(1, tuple(views)), CacheSummary())

        async def resolve():
            return ctl

        client = RayFleetClient(resolve, "replica", RequestMetrics())
        await client._refresh()
        kept, left = (client.link(v) for v in views)
        await asyncio.sleep(0)  # the links' streams open
        ctl.current = FleetSnapshot(2, (views[0],))  # worker-1 drained away
        await client._refresh()
        assert client._links == {"worker-0": kept}
        await asyncio.sleep(0)
        assert left._pump.done() and closed == [left._gen]
        assert client.link(views[0]) is kept
        await client.stop()
    asyncio.run(main())
