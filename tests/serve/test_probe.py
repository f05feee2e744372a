"""The controller's probe of one worker: liveness first, and a hung engine step is unresponsive."""
from __future__ import annotations

import asyncio

import pytest

from raypaged.serve.actors import probe_worker
from raypaged.serve.config import STEP_STALL_S
from raypaged.serve.controller import WorkerDown
from raypaged.serve.fleet import UNRESPONSIVE
from raypaged.serve.messages import Health


class Method:
    def __init__(self, value):
        self.value, self.calls = value, 0

    def remote(self, *args):
        self.calls += 1
        self.args = args

        async def answer():
            return self.value
        return answer()


class Handle:
    def __init__(self, stalled_s: float):
        self.health = Method(Health("inc-1", stalled_s))
        self.stats = Method("the stats")


def test_a_progressing_worker_answers_with_its_stats():
    handle = Handle(stalled_s=STEP_STALL_S - 1)
    assert asyncio.run(probe_worker(handle, 41)) == "the stats"
    assert (handle.health.calls, handle.stats.calls) == (1, 1)
    assert handle.stats.args == (41,)  # the cache version the controller has


def test_a_worker_whose_engine_step_hangs_is_unresponsive_and_says_why():
    handle = Handle(stalled_s=STEP_STALL_S + 5)
    with pytest.raises(WorkerDown) as down:
        asyncio.run(probe_worker(handle, -1))
    assert down.value.state == UNRESPONSIVE
    assert f"no engine step has finished for {STEP_STALL_S + 5:.0f} s" == down.value.cause
    assert handle.stats.calls == 0
