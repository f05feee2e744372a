"""Time of one engine step's core bookkeeping with 256 running decode requests (no model).

Measures EngineCore.step() (schedule + update of the real scheduler and KV cache manager) with a
runner that returns at once, plus EngineCore.stats(), which the serving worker calls after every
step. It does not cover what the runner, sampler and detokenizer cost on the host (input
tensors, sampling, text): those need a model and are measured by benchmarks/host_overhead.py.
Target: under 5 ms, so on a GPU the scheduler is never the bottleneck.

    python benchmarks/scheduler_overhead.py [--running 256] [--context 1024] [--steps 200]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.report import pyplot, plot_path, table, write  # noqa: E402
from raypaged.core.contracts import ScheduledBatch, StepResult  # noqa: E402
from raypaged.core.engine_core import EngineCore  # noqa: E402
from raypaged.core.sampling_params import SamplingParams  # noqa: E402
from raypaged.core.scheduler import Scheduler  # noqa: E402


class InstantRunner:
    def execute(self, batch: ScheduledBatch) -> StepResult:
        return StepResult({r.request_id: (r.start_position % 1000,) * r.num_samples
                           for r in batch.requests if r.num_samples})


def measure(running: int, context: int, steps: int, prefix: bool) -> dict:
    block = 16
    sched = Scheduler(num_blocks=running * (context + steps + block) // block + 16, block_size=block,
                      max_model_len=context + steps + 8, max_num_seqs=running,
                      max_num_batched_tokens=max(8192, running), enable_prefix_caching=prefix)
    engine = EngineCore(sched, InstantRunner())
    for i in range(running):
        engine.add_request(f"r{i}", [(i * 7 + j) % 30000 for j in range(context)],
                           SamplingParams(max_tokens=steps + 4, ignore_eos=True, temperature=0))
    while len(sched.running) < running or any(r.num_computed_tokens < r.num_prompt_tokens
                                               for r in sched.running):
        engine.step()  # prefill everyone first: the measured steps are pure decode
    times, stats_times = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        t1 = time.perf_counter()
        engine.stats()
        t2 = time.perf_counter()
        times.append((t2 - t0) * 1000)
        stats_times.append((t2 - t1) * 1000)
    times.sort()
    return {"running": running, "context": context, "prefix_caching": prefix,
            "mean_ms": statistics.fmean(times), "p50_ms": times[len(times) // 2],
            "p99_ms": times[int(len(times) * 0.99) - 1],
            "stats_mean_ms": statistics.fmean(stats_times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--running", type=int, default=256)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    rows = [measure(n, args.context, args.steps, prefix)
            for n in (32, 128, args.running) for prefix in (True, False)]
    print(table(rows, ["running", "context", "prefix_caching", "mean_ms", "p50_ms", "p99_ms",
                       "stats_mean_ms"]))
    main_row = next(r for r in rows if r["running"] == args.running and r["prefix_caching"])
    print(f"target: < 5 ms per step at {args.running} running: {main_row['mean_ms']:.2f} ms "
          f"({'met' if main_row['mean_ms'] < 5 else 'MISSED'})")
    print(f"wrote {write('scheduler_overhead', {'args': vars(args), 'rows': rows})}")
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for prefix in (True, False):
        pts = [r for r in rows if r["prefix_caching"] is prefix]
        ax.plot([r["running"] for r in pts], [r["mean_ms"] for r in pts], marker="o",
                label=f"prefix caching {'on' if prefix else 'off'}")
    ax.axhline(5, color="red", linestyle="--", label="target 5 ms")
    ax.set_xlabel("running decode requests")
    ax.set_ylabel("step + stats, ms")
    ax.legend()
    fig.tight_layout()
    fig.savefig(plot_path("scheduler_overhead"), dpi=80)
    print(f"wrote {plot_path('scheduler_overhead')}")


if __name__ == "__main__":
    main()
