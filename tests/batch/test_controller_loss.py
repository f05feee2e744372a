"""A batch job on a real local Ray (fake engines at 20 ms a step) whose controller is SIGKILLed
mid-run: a new controller takes over the same engine processes, and a worker killed after that
is seen restarted and failed over; every row is answered exactly once, all 200."""
from __future__ import annotations

import asyncio
import json
import os
import signal

from batch_inputs import read_output, write_lines
from raypaged.batch import BatchOptions
from raypaged.batch.engines import fleet_args
from raypaged.batch.job import BatchJob
from raypaged.config import EngineArgs
from tests.serve.fake_engine import SLOW_FAKE_MODEL

N, TOKENS = 80, 16


def pid_of(handle) -> "asyncio.Future[int]":
    return handle.__ray_call__.remote(lambda self: os.getpid())


def test_a_job_whose_controller_is_sigkilled_answers_every_row_once(local_ray, tmp_path):
    import ray

    inp = write_lines(tmp_path / "in.jsonl", [json.dumps(
        {"custom_id": f"r{i}", "prompt": f"question {i}: ", "max_tokens": TOKENS,
         "temperature": 0, "ignore_eos": True}) for i in range(N)])
    outp = tmp_path / "out.jsonl"
    options = BatchOptions(workers=2, cpus_per_worker=1, max_inflight=2)
    args = fleet_args(EngineArgs(model=SLOW_FAKE_MODEL, max_model_len=256), options)
    job = BatchJob(inp, outp, options=options)
    seen = {}

    def written() -> int:
        return len(outp.read_text().splitlines()) if outp.exists() else 0

    async def chaos():
        while written() < 8:
            await asyncio.sleep(0.05)
        pool = job.pool
        worker_pids = [await pid_of(h) for _, h in pool.controllers.workers]
        killed = pool.controllers.handle
        os.kill(await pid_of(killed), signal.SIGKILL)
        seen["at_kill"] = written()
        while pool.controllers.handle is killed:  # the fleet client found it dead: a new one
            await asyncio.sleep(0.05)
        while True:  # the new controller polls the same processes
            snap = await pool.controllers.handle.snapshot.remote()
            if len(snap.ready()) == 2:
                break
            await asyncio.sleep(0.1)
        seen["same_pids"] = sorted(w.stats.pid for w in snap.workers) == sorted(worker_pids)
        # a worker crash now is seen only through the new controller (its new incarnation)
        busiest = max(snap.workers, key=lambda w: w.load)
        seen["at_worker_kill"] = written()
        ray.kill(busiest.handle, no_restart=False)
        while (await pool.controllers.handle.snapshot.remote()).worker(
                busiest.worker_id).restarts < 1:
            await asyncio.sleep(0.1)
        seen["worker_restarted_at"] = written()

    async def main():
        run = asyncio.create_task(job.run(args))
        await asyncio.wait_for(chaos(), 120)
        return await run

    summary = asyncio.run(main())
    print(seen)
    assert seen["at_kill"] <= seen["at_worker_kill"] <= seen["worker_restarted_at"] < N, seen
    assert seen["same_pids"]  # the job went on on the live engines: no restart, no model load
    lines = read_output(outp)
    assert sorted(o["custom_id"] for o in lines) == sorted(f"r{i}" for i in range(N))
    assert all(o["response"]["status_code"] == 200 for o in lines)
    assert all(o["response"]["body"]["usage"]["completion_tokens"] == TOKENS for o in lines)
    assert (summary.completed, summary.failed, summary.unanswered) == (N, 0, 0)
