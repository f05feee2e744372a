"""Suspected poison requests shared between router replicas through the controller: a request
one replica refused is refused by the others within a metrics push, for as long as the first
remembers it (no Ray: the plain Controller and RayFleetClient against it)."""
from __future__ import annotations

import asyncio

from raypaged.serve.controller import Controller
from raypaged.serve.metrics import RequestMetrics
from raypaged.serve.poison import PoisonMemory
from raypaged.serve.ray_fleet import RayFleetClient

KEY, OTHER = b"k" * 16, b"o" * 16


def test_a_memory_learns_what_another_shared_with_the_time_it_had_left():
    a, b = PoisonMemory(remember_s=600), PoisonMemory(remember_s=600)
    a.remember(KEY, "two workers died", now=0.0)
    assert a.shared(now=100.0) == [(KEY, "two workers died", 500.0)]
    b.learn(a.shared(now=100.0), now=1000.0)       # b's clock is its own: 500 s from now
    assert b.refused(KEY, now=1499.0) == "two workers died"
    assert b.refused(KEY, now=1501.0) is None
    assert a.shared(now=700.0) == []                # expired entries are not shared


def test_learning_keeps_the_later_deadline_and_expiry_order():
    m = PoisonMemory(remember_s=600)
    m.remember(KEY, "mine", now=0.0)                # until 600
    m.learn([(OTHER, "theirs", 100.0), (KEY, "theirs", 50.0)], now=0.0)
    assert m.refused(OTHER, now=99.0) == "theirs"
    assert m.refused(OTHER, now=101.0) is None      # expired first although learned last
    assert m.refused(KEY, now=599.0) == "mine"      # the later of its two deadlines
    assert m.refused(KEY, now=601.0) is None


class Remote:
    """`actor.method.remote(...)` for a plain object's async method."""

    def __init__(self, target):
        self.target = target

    def __getattr__(self, name):
        method = getattr(self.target, name)

        class Method:
            @staticmethod
            def remote(*args):
                return method(*args)
        return Method


def test_a_request_one_replica_refused_is_refused_by_another_after_their_pushes():
    async def main():
        controller = Remote(Controller([], probe=None, poll_interval_s=60))

        async def resolve():
            return controller

        replicas = []
        for name in ("replica-a", "replica-b"):
            client = RayFleetClient(resolve, name, RequestMetrics())
            client._controller = controller
            client.poison = PoisonMemory()
            replicas.append(client)
        a, b = replicas
        a.poison.remember(KEY, "two workers died serving it")
        await b._push()
        assert b.poison.refused(KEY) is None        # a has not pushed yet
        await a._push()
        await b._push()
        assert b.poison.refused(KEY) == "two workers died serving it"
        assert a.poison.refused(KEY) == "two workers died serving it"
        controller.target._poller.cancel()
    asyncio.run(main())
