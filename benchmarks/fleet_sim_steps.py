"""Does the simulator's CPU cost model hold for the steps a loaded fleet runs? The real engine's
steps, in process, against the model's prediction of each.

The default model (SmolLM2-135M, 1 torch thread = one serving worker's CPU) runs a scenario a
loaded worker sees: k requests of 432 prompt tokens decoding (k = 1, 4, 8) when a prompt of P
tokens arrives (P = 32, 128, 432), so pure decode steps, pure prefills and mixed steps (decodes
+ a prefill chunk) all occur. Each step's runner.execute is timed (thread CPU time and wall
time) with the step's shape, and compared with the forward model of fleet_sim_calibrate.py
(CPU_SMOLLM2_135M) plus the probe's per-attended-pair term (--probe): serving's per-step and
per-request terms are outside the runner and not part of this check.

    python benchmarks/fleet_sim_steps.py [--repeats 3] [--probe benchmarks/results/fleet_sim_probe.json]
        [--name fleet_sim_steps]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import table, write  # noqa: E402
from raypaged.config import EngineArgs  # noqa: E402
from raypaged.core.sampling_params import SamplingParams  # noqa: E402
from raypaged.engine import Engine  # noqa: E402
from benchmarks.sim.calibration import probe_terms  # noqa: E402
from benchmarks.sim.cost_model import CPU_SMOLLM2_135M, step_shape  # noqa: E402

KINDS = ("decode", "prefill", "mixed")


def kind(s) -> str:
    if s.new_tokens == s.sequences:
        return "decode"
    return "prefill" if s.sequences == 1 else "mixed"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--probe", default=str(ROOT / "benchmarks/results/fleet_sim_probe.json"))
    p.add_argument("--name", default="fleet_sim_steps")
    ns = p.parse_args(argv)
    load_before = os.getloadavg()
    model = probe_terms(CPU_SMOLLM2_135M, json.loads(Path(ns.probe).read_text()))
    engine = Engine.from_args(EngineArgs(num_threads=1, max_model_len=1024, kv_context_len=8192))
    runner, steps = engine.core.runner, []
    execute = runner.execute

    def timed(batch):
        c0, w0 = time.thread_time(), time.perf_counter()
        out = execute(batch)
        steps.append((step_shape(batch), time.thread_time() - c0, time.perf_counter() - w0))
        return out
    runner.execute = timed
    rng, ids = random.Random(0), iter(range(1 << 30))

    def add(n: int, out: int) -> None:
        engine.add_request(f"r{next(ids)}", [rng.randrange(100, 10_000) for _ in range(n)],
                           SamplingParams(max_tokens=out, ignore_eos=True, temperature=0))

    def drain() -> None:
        while engine.has_unfinished():
            engine.step()
    add(32, 2)
    drain()  # warm-up: the first forward builds what later ones reuse
    steps.clear()
    for k in (1, 4, 8):
        for prompt in (32, 128, 432):
            for _ in range(ns.repeats):
                for _ in range(k):
                    add(432, 40)
                for _ in range(k + 3):
                    engine.step()      # their prefills are done: they decode
                add(prompt, 2)         # the next step mixes it in
                drain()
    rows = []
    for name in KINDS:
        mine = [(s, cpu, wall) for s, cpu, wall in steps if kind(s) == name]
        if not mine:
            continue
        # the forward model: no serving terms (they are outside the runner)
        pred = [model.seconds(s) - model.per_step_serving for s, _, _ in mine]
        rows.append({"step": name, "steps": len(mine),
                     "mean_new_tokens": statistics.fmean(s.new_tokens for s, _, _ in mine),
                     "mean_sequences": statistics.fmean(s.sequences for s, _, _ in mine),
                     "median_cpu_ms": 1000 * statistics.median(c for _, c, _ in mine),
                     "median_model_ms": 1000 * statistics.median(pred),
                     "median_cpu_over_model": statistics.median(
                         c / q for (_, c, _), q in zip(mine, pred)),
                     "median_wall_over_model": statistics.median(
                         w / q for (_, _, w), q in zip(mine, pred))})
    print(table(rows, list(rows[0])))
    out = write(ns.name, {"workload": {"repeats": ns.repeats, "probe": Path(ns.probe).name},
                          "load_average": {"before": load_before, "after": os.getloadavg()},
                          "rows": rows})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
