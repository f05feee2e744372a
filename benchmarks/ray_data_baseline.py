"""The same batch job written the way Ray Data users write it: the peer `raypaged batch` is measured
against in benchmarks/batch_throughput.py.

    ray.data.read_json(input.jsonl)                       plain rows {"custom_id", "prompt", ...}
      .map_batches(RaypagedPredictor, batch_size=B,       N actors, each holding the offline LLM
                   compute=ActorPoolStrategy(size=N))          (raypaged.engine.Engine.from_args, as the
                                                           batch job's engine actors are built)
      .write_json(output_dir)                             a folder of files, one per block

Each actor answers one batch of B rows with one `LLM.generate` call (continuous batching inside
the batch, none across batches): Ray Data LLM's default batch_size is 32; its vLLM stage also
keeps up to 8 batches in flight per engine (max_concurrent_batches), which a synchronous engine
cannot. Ray Data hands each batch to whichever actor is free, so rows that share a prefix land on
every engine.

Needs Ray Data (`pip install -e '.[bench]'`: pandas, pyarrow); nothing under raypaged/ imports it.
"""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path


class RaypagedPredictor:
    """One engine per actor; `__call__` answers a batch of rows (columns as numpy arrays)."""

    def __init__(self, engine: dict, threads: int):
        from raypaged import LLM

        self.llm = LLM(**engine, num_threads=threads)

    def __call__(self, batch: dict) -> dict:
        from raypaged import SamplingParams

        started = time.time()
        params = [SamplingParams(temperature=float(t), max_tokens=int(m), ignore_eos=bool(e))
                  for t, m, e in zip(batch["temperature"], batch["max_tokens"],
                                     batch["ignore_eos"])]
        outs = self.llm.generate([str(p) for p in batch["prompt"]], params, use_tqdm=False)
        return {"custom_id": batch["custom_id"],
                "text": [o.outputs[0].text for o in outs],
                "prompt_tokens": [len(o.prompt_token_ids) for o in outs],
                "completion_tokens": [len(o.outputs[0].token_ids) for o in outs],
                "cached_tokens": [o.num_cached_tokens for o in outs],
                # wall clock (one machine): when the first batch began, i.e. an engine was up
                "batch_started": [started] * len(outs),
                "engine": [os.getpid()] * len(outs)}


def write_plain_rows(bodies: list[dict], path: Path) -> None:
    """The input as Ray Data LLM users write it: one flat row per request."""
    path.write_text("".join(json.dumps({"custom_id": f"r{i}", **b}) + "\n"
                            for i, b in enumerate(bodies)))


def run_ray_data(bodies: list[dict], engine: dict, engines: int, cpus: int, batch_size: int,
                 tmp: Path, allocator_env: dict[str, str]) -> dict:
    """One run; returns the row for the benchmark's table (the same keys as `raypaged batch`'s).

    The reader and writer ask for no CPU: the engines hold every CPU of the benchmark's cluster,
    and a read task waiting for one would stall the pipeline (on a real cluster they would have
    CPUs of their own). The input is read as one block per batch: Ray Data gives a block to one
    actor, and a small file read as one block would leave every actor but one idle."""
    import ray.data
    from ray.data import ActorPoolStrategy, DataContext

    ctx = DataContext.get_current()
    ctx.enable_progress_bars = False
    # Every actor up before the first batch, as `raypaged batch` waits for every engine: else
    # the first actor's batches run alone while the others load, and count against Ray Data.
    ctx.wait_for_min_actors_s = 600
    inp, out = tmp / f"ray-data-in-{engines}.jsonl", tmp / f"ray-data-out-{engines}"
    write_plain_rows(bodies, inp)
    t0 = time.time()
    ds = ray.data.read_json(str(inp), num_cpus=0,
                            override_num_blocks=math.ceil(len(bodies) / batch_size))
    ds = ds.map_batches(RaypagedPredictor, fn_constructor_kwargs={"engine": engine,
                                                                  "threads": cpus},
                        compute=ActorPoolStrategy(size=engines), batch_size=batch_size,
                        num_cpus=cpus, runtime_env={"env_vars": allocator_env})
    ds.write_json(str(out), ray_remote_args={"num_cpus": 0})
    t_end = time.time()
    rows = [json.loads(line) for f in sorted(out.glob("*.json")) for line in f.open()]
    ids = [r["custom_id"] for r in rows]
    assert sorted(ids) == sorted(f"r{i}" for i in range(len(bodies))), "not exactly once"
    first = min(r["batch_started"] for r in rows)
    completion = sum(r["completion_tokens"] for r in rows)
    wall = t_end - first
    return {"run": f"Ray Data map_batches, {engines} engine{'s' * (engines > 1)}",
            "engines": engines, "grouping": f"batch {batch_size}", "seconds": wall,
            "output_tokens": completion, "tok_per_s": completion / wall,
            "prefix_hit_rate": sum(r["cached_tokens"] for r in rows)
            / sum(r["prompt_tokens"] for r in rows),
            "startup_s": first - t0, "output_files": len(list(out.glob("*.json"))),
            "engines_per_prefix": engines_per_prefix(bodies, rows)}


def engines_per_prefix(bodies: list[dict], rows: list[dict]) -> float:
    """Prefix locality: over the shared system prompts, the mean number of engines that answered
    a row behind that prompt (1.0: each prompt stayed on one engine)."""
    engine = {r["custom_id"]: r["engine"] for r in rows}
    seen: dict[str, set] = {}
    for i, b in enumerate(bodies):
        if b["prompt"].startswith("System "):
            seen.setdefault(b["prompt"].split(":")[0], set()).add(engine[f"r{i}"])
    return sum(map(len, seen.values())) / len(seen)
