"""The worker's liveness answer tells a hung engine step from a busy or idle engine."""
from __future__ import annotations

import asyncio
import threading
import time

from fake_engine import FakeEngine
from raypaged.core.sampling_params import SamplingParams
from local_link import abort, generate
from raypaged.serve.worker import Worker


class HangingEngine(FakeEngine):
    """Its step blocks until released, as a hung kernel would."""

    def __post_init__(self):
        super().__post_init__()
        self.release = threading.Event()

    def step(self):
        self.release.wait()
        return super().step()


def test_health_reports_how_long_a_step_has_hung_and_zero_when_idle_or_progressing():
    async def main():
        engine = HangingEngine()
        w = Worker(engine, "w")
        assert w.health().stalled_s == 0.0 and w.health().incarnation == w.incarnation
        gen = generate(w, "r", list(b"hello there"), SamplingParams(max_tokens=3))
        first = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0.05)
        w.health()  # the probe sees the engine busy with these stats...
        await asyncio.sleep(0.3)
        assert 0.25 <= w.health().stalled_s < 1.0  # ...and still the same ones: hung
        engine.release.set()
        await first
        async for _ in gen:
            pass
        assert w.health().stalled_s == 0.0  # idle again
        w.shutdown()
    asyncio.run(asyncio.wait_for(main(), 30))


def test_abort_queues_the_abort_and_frees_the_request():
    async def main():
        w = Worker(FakeEngine(step_delay_s=0.01), "w")
        gen = generate(w, "r", list(b"hello there"), SamplingParams(max_tokens=200))
        await gen.__anext__()
        abort(w, "r")
        outs = [o async for batch in gen for o in batch]
        assert outs[-1].finish_reason == "abort" and len(outs) < 200
        deadline = time.monotonic() + 2
        while w.stats().engine.memory.blocks_used and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert w.stats().engine.memory.blocks_used == 0
        w.shutdown()
    asyncio.run(asyncio.wait_for(main(), 30))
