"""The Worker class without Ray: streams, n samples, cancellation, refusals, engine failures."""
from __future__ import annotations

import asyncio

import pytest

from fake_engine import FakeEngine
from raypaged.core.sampling_params import SamplingParams
from local_link import generate
from raypaged.serve.messages import Rejected, WorkerUnavailable
from raypaged.serve.worker import Worker

PROMPT = list(b"a prompt of a few blocks, long enough to fill two of them")


async def drain(worker, rid, params, prompt=PROMPT, salt=None):
    batches = []
    async for batch in generate(worker, rid, prompt, params, salt):
        batches.append(batch)
    return batches


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_stream_yields_every_token_then_finishes():
    async def main():
        w = Worker(FakeEngine(), "w")
        batches = await drain(w, "r", SamplingParams(max_tokens=5, temperature=0))
        outs = [o for b in batches for o in b]
        assert sum(len(o.new_token_ids) for o in outs) == 5
        assert outs[-1].finish_reason == "length"
        assert all(o.finish_reason is None for o in outs[:-1])
        assert w.stats().num_active == 0
        w.shutdown()
    run(main())


def test_n_samples_each_finish_and_the_stream_ends_after_the_last():
    async def main():
        w = Worker(FakeEngine(), "w")
        outs = [o for b in await drain(w, "r", SamplingParams(n=3, max_tokens=4, temperature=0.8,
                                                              seed=1)) for o in b]
        assert sorted(o.index for o in outs if o.finished) == [0, 1, 2]
        w.shutdown()
    run(main())


def test_cancelling_the_caller_aborts_the_request_and_frees_its_blocks():
    async def main():
        w = Worker(FakeEngine(step_delay_s=0.005), "w")
        task = asyncio.create_task(drain(w, "r", SamplingParams(max_tokens=150, ignore_eos=True)))
        for _ in range(200):
            if w.stats().engine.memory.blocks_used:
                break
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):
            stats = w.stats()
            if stats.engine.memory.blocks_used == 0 and stats.engine.num_running == 0:
                break
            await asyncio.sleep(0.01)
        assert stats.engine.memory.blocks_used == 0 and stats.num_active == 0
        w.shutdown()
    run(main())


def test_leaving_the_stream_early_aborts_too():
    async def main():
        w = Worker(FakeEngine(step_delay_s=0.005), "w")
        gen = generate(w, "r", PROMPT, SamplingParams(max_tokens=150, ignore_eos=True))
        await gen.__anext__()
        await gen.aclose()
        await asyncio.sleep(0.1)
        assert w.stats().engine.memory.blocks_used == 0 and w.stats().engine.num_running == 0
        w.shutdown()
    run(main())


def test_an_invalid_request_is_rejected_without_touching_the_engine():
    async def main():
        w = Worker(FakeEngine(max_model_len=64), "w")
        [[item]] = [await drain(w, "r", SamplingParams(max_tokens=50))]
        assert isinstance(item, Rejected) and not item.queue_full and "64" in item.message
        assert w.stats().engine.num_waiting == 0 and w.stats().num_active == 0
        w.shutdown()
    run(main())


def test_a_full_queue_refuses_with_queue_full():
    async def main():
        # 8 blocks of 16 tokens: "a" (100 + 10 tokens, 7 blocks) runs, "b" waits for its blocks
        w = Worker(FakeEngine(num_blocks=8, step_delay_s=0.02), "w", max_queued=1)
        long_prompt, slow = [97] * 100, SamplingParams(max_tokens=10, ignore_eos=True)
        first = asyncio.create_task(drain(w, "a", slow, prompt=long_prompt))
        second = asyncio.create_task(drain(w, "b", slow, prompt=long_prompt))
        while w.stats().engine.num_blocked < 1:
            await asyncio.sleep(0.005)
        [[item]] = [await drain(w, "c", slow, prompt=long_prompt)]
        assert isinstance(item, Rejected) and item.queue_full
        assert "1 requests waiting for KV cache space" in item.message
        # the two admitted ones finish; once nobody waits, the next is taken again
        assert (await first)[-1][-1].finish_reason == "length"
        assert (await second)[-1][-1].finish_reason == "length"
        assert not isinstance((await drain(w, "d", slow, prompt=long_prompt))[0], Rejected)
        w.shutdown()
    run(main())


def test_a_burst_the_kv_cache_can_hold_is_admitted_whole_whatever_the_queue_bound():
    async def main():
        # 50 requests x 4 blocks fit in 256 blocks; the step budget (2048 tokens) admits them
        # over two steps, so many wait for the budget, none for KV space
        w = Worker(FakeEngine(num_blocks=256), "w", max_queued=2)
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        results = await asyncio.gather(*(drain(w, f"r{i}", params) for i in range(50)))
        assert not any(isinstance(b, Rejected) for r in results for b in r)
        assert all(r[-1][-1].finish_reason == "length" for r in results)
        w.shutdown()
    run(main())


def test_a_duplicate_request_id_is_rejected():
    async def main():
        w = Worker(FakeEngine(step_delay_s=0.01), "w")
        first = asyncio.create_task(drain(w, "same", SamplingParams(max_tokens=50)))
        await asyncio.sleep(0.02)
        [[item]] = [await drain(w, "same", SamplingParams(max_tokens=5))]
        assert isinstance(item, Rejected) and "already in use" in item.message
        first.cancel()
        w.shutdown()
    run(main())


class ExplodingEngine(FakeEngine):
    def step(self):
        raise RuntimeError("kernel fault")


def test_an_engine_failure_fails_the_requests_and_the_worker_lives_on():
    async def main():
        w = Worker(ExplodingEngine(), "w")
        with pytest.raises(WorkerUnavailable, match="kernel fault"):
            await drain(w, "r", SamplingParams(max_tokens=5))
        for _ in range(100):
            if w.stats().engine.num_running == w.stats().engine.num_waiting == 0:
                break
            await asyncio.sleep(0.01)
        assert w.stats().engine.memory.blocks_used == 0
        w.shutdown()
    run(main())
