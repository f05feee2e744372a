"""The Worker's step loop with the real Engine's output stage (detokenization on its own thread):
streams carry the same tokens and text as the in-line engine, stop strings end requests and
never reach the stream, and aborts still end every sample."""
from __future__ import annotations

import asyncio
import threading

from fake_engine import EOS, ByteTokenizer, FakeEngine, LetterRunner
from raypaged.core.engine_core import EngineCore
from raypaged.core.sampling_params import SamplingParams
from raypaged.core.scheduler import Scheduler
from raypaged.engine import Engine
from local_link import abort, generate
from raypaged.serve.worker import Worker

PROMPT = list(b"a prompt of a few blocks, long enough to fill two of them")


def real_engine(output_thread: bool, step_delay_s: float = 0.0) -> Engine:
    plan = FakeEngine().plan
    core = EngineCore(Scheduler(plan.num_blocks, plan.block_size, plan.max_model_len),
                      LetterRunner(step_delay_s))
    return Engine(core, ByteTokenizer(), plan, "letters", (EOS,), output_thread=output_thread)


async def collect(worker, rid, params):
    outs = []
    async for batch in generate(worker, rid, PROMPT, params):
        outs += batch
    return outs


def by_sample(outs):
    res = {}
    for o in outs:
        text, toks, fin = res.get(o.index, ("", (), None))
        res[o.index] = (text + o.new_text, toks + o.new_token_ids,
                        (o.finish_reason, o.stop_reason) if o.finished else fin)
    return res


def serve(output_thread: bool, params_by_id: dict[str, SamplingParams]):
    async def main():
        w = Worker(real_engine(output_thread), "w")
        try:
            got = await asyncio.gather(*(collect(w, rid, p) for rid, p in params_by_id.items()))
            assert w.stats().engine.memory.blocks_used == 0
            return got
        finally:
            w.shutdown()
    return asyncio.run(asyncio.wait_for(main(), 30))


def test_streams_through_the_stage_match_the_in_line_engine():
    params = {f"r{i}": SamplingParams(n=1 + i % 2, max_tokens=20, temperature=0, seed=i,
                                      stop=[stop] if stop else None)
              for i, stop in enumerate(["q", "", "mn", "zz", "e"])}
    staged = serve(True, params)
    inline = serve(False, params)
    assert [by_sample(o) for o in staged] == [by_sample(o) for o in inline]
    stopped = [s for outs in staged for s in by_sample(outs).values() if s[2][0] == "stop"]
    assert stopped, "no stop string ended a request: the test proves nothing"
    for outs, p in zip(staged, params.values()):
        for text, _, _ in by_sample(outs).values():
            assert not any(s in text for s in p.stop)


class HeldRunner(LetterRunner):
    """Each step after the first waits for `go`: the test knows the request is mid-stream
    (however slowly CI runs), and nothing finishes it before the abort is queued."""

    def __init__(self):
        super().__init__()
        self.steps = threading.Event()
        self.go = threading.Event()

    def execute(self, batch):
        if self.steps.is_set():
            self.go.wait(timeout=30)
        self.steps.set()
        return super().execute(batch)


def test_an_engine_with_output_thread_uses_its_stage_in_the_worker():
    async def main():
        plan = FakeEngine().plan
        runner = HeldRunner()
        core = EngineCore(Scheduler(plan.num_blocks, plan.block_size, plan.max_model_len), runner)
        engine = Engine(core, ByteTokenizer(), plan, "letters", (EOS,), output_thread=True)
        w = Worker(engine, "w")
        task = asyncio.create_task(collect(w, "r", SamplingParams(n=2, max_tokens=150,
                                                                   ignore_eos=True)))
        while not runner.steps.is_set():  # the first step ran; the second waits for `go`
            await asyncio.sleep(0.002)
        assert engine.stage is not None
        abort(w, "r")  # in the step thread's inbox before the step it waits on
        runner.go.set()
        outs = await task
        assert sorted(o.index for o in outs if o.finish_reason == "abort") == [0, 1]
        w.shutdown()
        assert engine.stage is None
    asyncio.run(asyncio.wait_for(main(), 30))
