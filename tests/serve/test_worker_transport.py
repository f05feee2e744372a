"""The worker's one transport without Ray: one message per step carries every request of a
router, split by request id; refusals answer the submit; leaving a request, or the whole
stream, cancels on the engine; admission counts every accepted request until it ends."""
from __future__ import annotations

import asyncio

from fake_engine import FakeEngine
from local_link import generate
from raypaged.core.sampling_params import SamplingParams
from raypaged.serve.messages import Rejected
from raypaged.serve.worker import Worker

PROMPT = list(b"a prompt of a few blocks, long enough to fill two of them")


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


async def read_until_done(stream, request_ids: set[str]) -> list[dict]:
    messages, open_ = [], set(request_ids)
    async for message in stream:
        messages.append(message)
        open_ -= {rid for rid, outs in message.items() if any(o.finished for o in outs)}
        if not open_:
            return messages
    raise AssertionError("the stream ended early")


async def tokens_of(worker, rid, params) -> list[int]:
    return [t async for outs in generate(worker, rid, PROMPT, params)
            for out in outs for t in out.new_token_ids]


def test_one_message_carries_every_requests_tokens_of_a_step_and_the_tokens_are_exact():
    async def main():
        w = Worker(FakeEngine(step_delay_s=0.01), "w")
        a = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0)
        b = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.9, seed=3)
        stream = w.outputs("m")
        assert await w.submit("m", "a", PROMPT, a) is None
        assert await w.submit("m", "b", PROMPT, b) is None
        messages = await read_until_done(stream, {"a", "b"})
        await stream.aclose()
        got = {"a": [], "b": []}
        for message in messages:
            for rid, outs in message.items():
                got[rid] += [t for out in outs for t in out.new_token_ids]
        # the same tokens as each request alone on a fresh worker
        ref = Worker(FakeEngine(), "ref")
        assert got == {"a": await tokens_of(ref, "a", a), "b": await tokens_of(ref, "b", b)}
        both = [m for m in messages if set(m) >= {"a", "b"}]
        assert len(both) >= 4  # 6 steps shared: per-request streams would give 0
        assert w.stats().num_active == 0
        w.shutdown()
        ref.shutdown()
    run(main())


def test_a_refused_request_is_the_submits_answer_and_never_counts():
    async def main():
        w = Worker(FakeEngine(max_model_len=64), "w")
        rejected = await w.submit("m", "r", PROMPT, SamplingParams(max_tokens=50))
        assert isinstance(rejected, Rejected) and not rejected.queue_full
        assert "64" in rejected.message
        assert w.stats().num_active == 0 and w.bound.count == 0
        w.shutdown()
    run(main())


def test_an_engine_error_in_add_request_reaches_the_router_and_leaves_nothing_counted():
    """Not a refusal (ValueError) but the engine's own failure: the submit raises (the router
    fails the request over), and the worker forgets it: it neither counts as active nor holds
    its blocks in the queue bound, and a later request is served."""
    async def main():
        engine = FakeEngine()
        w = Worker(engine, "w")
        real = engine.add_request

        def broken(*args, **kwargs):
            raise RuntimeError("boom")
        engine.add_request = broken
        try:
            await w.submit("m", "r", PROMPT, SamplingParams(max_tokens=5))
        except RuntimeError as exc:
            assert str(exc) == "boom"
        else:
            raise AssertionError("the engine's error reaches the caller")
        assert w.stats().num_active == 0 and w.bound.count == 0
        engine.add_request = real
        assert len(await tokens_of(w, "next", SamplingParams(max_tokens=3, ignore_eos=True))) == 3
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
        w.cancel("long")
        messages = await read_until_done(stream, {"short"})
        short = [t for m in messages for t in (t for o in m.get("short", ()) for t in o.new_token_ids)]
        assert len(short) >= 4  # the first message may have held its first token
        assert not any("long" in m for m in messages[1:])  # nothing after the cancel's step
        await wait_freed(w)
        assert w.stats().num_active == 0
        await stream.aclose()
        w.shutdown()
    run(main())


def test_closing_the_stream_aborts_every_request_on_it_and_refuses_late_submits():
    async def main():
        w = Worker(FakeEngine(step_delay_s=0.005), "w")
        stream = w.outputs("m")
        for rid in ("a", "b"):
            await w.submit("m", rid, PROMPT, SamplingParams(max_tokens=150, ignore_eos=True))
        await stream.__anext__()
        await stream.aclose()  # the router went away, or its stream broke
        await wait_freed(w)
        assert w.stats().num_active == 0
        late = await w.submit("m", "c", PROMPT, SamplingParams(max_tokens=5))
        assert isinstance(late, Rejected) and late.queue_full
        assert w.stats().num_active == 0
        w.shutdown()
    run(main())


def test_a_flood_of_submits_between_two_steps_counts_at_once():
    async def main():
        # 8 blocks; each request may grow to 7 (100 prompt + 10 output tokens): one fits
        w = Worker(FakeEngine(num_blocks=8, step_delay_s=0.02), "w", max_queued=3)
        params = SamplingParams(max_tokens=10, ignore_eos=True)
        answers = await asyncio.gather(*(w.submit("m", f"r{i}", [97] * 100, params)
                                         for i in range(10)))
        # 1 fits, 3 may wait: the rest are refused before any engine step could count them
        assert [a is None for a in answers] == [True] * 4 + [False] * 6
        assert all(a.queue_full and a.retry_after_s >= 1 for a in answers[4:])
        assert w.stats().num_active == 4
        stream = w.outputs("m")
        await read_until_done(stream, {f"r{i}" for i in range(4)})
        assert w.stats().num_active == 0 and w.bound.blocks == 0
        await stream.aclose()
        w.shutdown()
    run(main())


def test_closing_a_stream_with_thousands_of_queued_requests_cancels_them_all():
    async def main():
        w = Worker(FakeEngine(num_blocks=64, step_delay_s=0.001), "w", max_queued=100_000)
        params = SamplingParams(max_tokens=150, ignore_eos=True)
        n = 5000
        for i in range(n):
            assert await w.submit("m", f"r{i}", PROMPT, params) is None
        stream = w.outputs("m")
        await stream.__anext__()
        await stream.aclose()  # every request of the router cancelled
        await wait_freed(w)
        assert w.stats().engine.num_waiting == 0 and w.stats().num_active == 0
        w.shutdown()
    run(main())
