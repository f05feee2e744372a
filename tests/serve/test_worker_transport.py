"""The worker's multiplexed output stream (output_mux.py) without Ray: one message carries every
request's outputs of a step; leaving a request, or the whole stream, aborts on the engine."""
from __future__ import annotations

import asyncio

from fake_engine import FakeEngine
from raypaged.core.sampling_params import SamplingParams
from raypaged.serve.output_mux import END
from raypaged.serve.worker import Rejected, Worker

PROMPT = list(b"a prompt of a few blocks, long enough to fill two of them")


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


async def read_until_done(stream, request_ids: set[str]) -> list[list]:
    messages, open_ = [], set(request_ids)
    async for items in stream:
        messages.append(items)
        open_ -= {rid for rid, item in items if item == END}
        if not open_:
            return messages
    raise AssertionError("the stream ended early")


async def tokens_of(worker_generate, rid, params) -> list[int]:
    return [t async for batch in worker_generate(rid, PROMPT, params)
            for out in batch for t in out.new_token_ids]


def test_one_message_carries_every_requests_tokens_of_a_step_and_the_tokens_are_exact():
    async def main():
        w = Worker(FakeEngine(step_delay_s=0.01), "w")
        a = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0)
        b = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.9, seed=3)
        stream = w.outputs("m")
        await w.submit("m", "a", PROMPT, a)
        await w.submit("m", "b", PROMPT, b)
        messages = await read_until_done(stream, {"a", "b"})
        await stream.aclose()
        got = {"a": [], "b": []}
        for items in messages:
            for rid, item in items:
                if item != END:
                    got[rid] += [t for out in item for t in out.new_token_ids]
        # the same tokens as each request's own stream on a fresh worker
        ref = Worker(FakeEngine(), "ref")
        assert got == {"a": await tokens_of(ref.generate, "a", a),
                       "b": await tokens_of(ref.generate, "b", b)}
        both = [m for m in messages if {rid for rid, _ in m} >= {"a", "b"}]
        assert len(both) >= 4  # 6 steps shared: per-request streams would give 0
        assert w.stats().num_active == 0
        w.shutdown()
        ref.shutdown()
    run(main())


def test_a_refused_request_comes_through_as_rejected_then_end():
    async def main():
        w = Worker(FakeEngine(max_model_len=64), "w")
        stream = w.outputs("m")
        await w.submit("m", "r", PROMPT, SamplingParams(max_tokens=50))
        items = [i for m in await read_until_done(stream, {"r"}) for i in m]
        assert [rid for rid, _ in items] == ["r", "r"]
        assert isinstance(items[0][1], Rejected) and "64" in items[0][1].message
        assert items[1][1] == END
        await stream.aclose()
        w.shutdown()
    run(main())


async def wait_freed(w: Worker) -> None:
    for _ in range(200):
        stats = w.stats()
        if stats.engine.memory.blocks_used == 0 and stats.engine.num_running == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"blocks still held: {w.stats().engine}")


def test_cancelling_one_request_aborts_it_and_the_others_go_on():
    async def main():
        w = Worker(FakeEngine(step_delay_s=0.005), "w")
        stream = w.outputs("m")
        await w.submit("m", "long", PROMPT, SamplingParams(max_tokens=150, ignore_eos=True))
        await w.submit("m", "short", PROMPT, SamplingParams(max_tokens=5, ignore_eos=True))
        await stream.__anext__()
        await w.cancel("m", "long")
        messages = await read_until_done(stream, {"short"})
        short = [t for m in messages for rid, item in m if rid == "short" and item != END
                 for out in item for t in out.new_token_ids]
        assert len(short) >= 4  # the first message may have held its first token
        await wait_freed(w)
        assert w.stats().num_active == 0
        await stream.aclose()
        w.shutdown()
    run(main())


def test_closing_the_stream_aborts_every_request_on_it():
    async def main():
        w = Worker(FakeEngine(step_delay_s=0.005), "w")
        stream = w.outputs("m")
        for rid in ("a", "b"):
            await w.submit("m", rid, PROMPT, SamplingParams(max_tokens=150, ignore_eos=True))
        await stream.__anext__()
        await stream.aclose()  # the router went away
        await wait_freed(w)
        assert w.stats().num_active == 0
        w.shutdown()
    run(main())
