"""The step thread carries its name into the kernel: benchmarks/serve_cpu.py (and top -H,
py-spy) tell the model's CPU from the worker's event loops and Ray's threads by it."""
import asyncio
import sys

import pytest

from raypaged.serve.engine_loop import STEP_THREAD_NAME, EngineLoop


class IdleEngine:
    output_thread = False
    stage = None

    def stats(self):
        return object()

    def has_unfinished(self):
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and prctl: Linux")
def test_the_step_thread_is_named_rp_step_in_the_kernel():
    async def main():
        loop = EngineLoop(IdleEngine(), asyncio.get_running_loop(), lambda outs: None,
                          lambda exc: None)
        try:
            assert await loop.call(lambda engine: 42) == 42  # the step thread has run
            with open(f"/proc/self/task/{loop._thread.native_id}/comm") as f:
                return f.read().strip()
        finally:
            loop.stop()
    assert asyncio.run(main()) == STEP_THREAD_NAME.decode() == "rp-step"
