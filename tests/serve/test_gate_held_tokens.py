"""The prompt tokens a router's gate holds back (fair admission) are counted while, and only
while, their prompts wait: the autoscaler adds them to the workers' queues (a flood held at the
routers is demand no worker's queue shows; serve/autoscaler.py)."""
from __future__ import annotations

import asyncio

from raypaged.config import KVPlan
from raypaged.core.contracts import EngineStats, MemoryStats
from raypaged.serve.client_gate import ClientGate
from raypaged.serve.fleet import READY, FleetSnapshot, WorkerView
from raypaged.serve.messages import WorkerStats
from raypaged.serve.metrics import RequestMetrics


def one_worker(num_blocks: int) -> FleetSnapshot:
    memory = MemoryStats(num_blocks, 16, 0, 0, num_blocks, 0, 0, 0, 0)
    engine = EngineStats(memory, 0, 0, 0, 0, 0)
    budget = KVPlan(1 << 20, 1024, block_size=16, num_blocks=num_blocks, max_model_len=1024)
    stats = WorkerStats("w0", "inc", 1, "m", 1024, 16, budget, engine, num_active=0)
    return FleetSnapshot(1, (WorkerView("w0", READY, handle=None, stats=stats),))


def test_a_waiting_prompt_is_held_until_it_goes_or_its_client_leaves():
    async def main():
        snap = one_worker(num_blocks=64)
        gate = ClientGate(0, True, lambda: snap, RequestMetrics())
        first = await gate.enter("a", 600, 40, 1)       # 40 blocks of the fleet's 64: goes
        assert first.admitted and gate.held_tokens == 0
        second = asyncio.create_task(gate.enter("b", 500, 40, 1))  # no room: waits
        third = asyncio.create_task(gate.enter("c", 300, 40, 1))
        await asyncio.sleep(0.01)
        assert not second.done() and not third.done()
        assert gate.held_tokens == 800
        third.cancel()                                   # its client left while waiting
        await asyncio.sleep(0.01)
        assert gate.held_tokens == 500
        gate.leave(first)                                # room again: the second goes
        ticket = await asyncio.wait_for(second, 1)
        assert ticket.admitted and gate.held_tokens == 0
    asyncio.run(main())
