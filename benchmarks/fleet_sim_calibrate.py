"""The simulator's CPU calibration and its check against a real 2-worker `raypaged serve` run.

1. Fit: a LinearCost (raypaged/sim/cost_model.py) fitted to the real engine's measured steps on
   this machine, benchmarks/results/forward_step.json (`default` variant: SmolLM2-135M, the
   engine's CPU defaults, 1 thread = one serving worker's CPU; decode of 1/4/16/64 sequences
   and a prefill, at one context length, so the per-KV-token term is not fitted).
2. Check: the simulator, with that fit, at 2 workers, replays the workload of the real routing
   benchmark (benchmarks/results/serve_bench_routing.json: serve_bench.py's seeded
   prefix_repetition dataset, its Poisson arrivals, its engine settings) for every routing mode
   and load measured there, and prints simulated vs measured mean TTFT and e2e (target: within
   +-25%).

    python benchmarks/fleet_sim_calibrate.py
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import plot_path, pyplot, table, write  # noqa: E402
from benchmarks.serve_datasets import make_dataset  # noqa: E402
from raypaged.sim.calibration import fit_linear, forward_step_points  # noqa: E402
from raypaged.sim.cost_model import CPU_SMOLLM2_135M  # noqa: E402
from raypaged.sim.experiment import simulate  # noqa: E402
from raypaged.sim.trace import from_prompts  # noqa: E402
from raypaged.sim.worker import EngineShape  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
TOLERANCE = 0.25


def fit(path: Path):
    return fit_linear("CPU x SmolLM2-135M (fitted)",
                      forward_step_points(json.loads(path.read_text())),
                      terms=("per_step", "per_token", "per_seq"))


def arrivals(n: int, rate: float, seed: int) -> list[float]:
    """serve_bench.run_load's Poisson arrivals: request i leaves after i seeded gaps."""
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def check(real_path: Path, cost) -> list[dict]:
    real = json.loads(real_path.read_text())
    w = real["workload"]
    engine = EngineShape(num_blocks=w["kv_tokens"] // 16, block_size=16,
                         max_model_len=w["max_model_len"], max_num_seqs=256,
                         max_num_batched_tokens=2048)
    rows = []
    for run in real["runs"]:
        if run["dataset"] != "prefix_repetition" or run["mode"] not in ("hash", "cache_aware",
                                                                         "round_robin"):
            continue
        ns = argparse.Namespace(**{**w, "dataset": "prefix_repetition"})
        items = make_dataset(ns)
        reqs = from_prompts(items, arrivals(len(items), run["request_rate"], w["seed"]))
        sim = simulate(reqs, 2, engine, cost, run["mode"], seed=w["seed"])
        row = {"mode": run["mode"], "load": run["load"], "request_rate": run["request_rate"],
               "real_mean_ttft_ms": run["mean_ttft_ms"], "sim_mean_ttft_ms": 1000 * sim["mean_ttft_s"],
               "real_mean_e2e_ms": run["mean_e2e_ms"], "sim_mean_e2e_ms": 1000 * sim["mean_e2e_s"],
               "real_hit_rate": run["prefix_hit_rate"], "sim_hit_rate": sim["hit_rate"]}
        row["ttft_error"] = row["sim_mean_ttft_ms"] / row["real_mean_ttft_ms"] - 1
        row["e2e_error"] = row["sim_mean_e2e_ms"] / row["real_mean_e2e_ms"] - 1
        row["within_25pct"] = abs(row["ttft_error"]) <= TOLERANCE and abs(row["e2e_error"]) <= TOLERANCE
        rows.append(row)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--forward-step", default=str(RESULTS / "forward_step.json"))
    p.add_argument("--real", default=str(RESULTS / "serve_bench_routing.json"))
    ns = p.parse_args(argv)
    fitted = fit(Path(ns.forward_step))
    print(f"fitted from {ns.forward_step}: {fitted}")
    if fitted != CPU_SMOLLM2_135M:
        print(f"note: raypaged/sim/cost_model.py's CPU_SMOLLM2_135M is {CPU_SMOLLM2_135M}: "
              "paste the fit there to use it")
    rows = check(Path(ns.real), fitted)
    print(table(rows, ["mode", "load", "real_mean_ttft_ms", "sim_mean_ttft_ms", "ttft_error",
                       "real_mean_e2e_ms", "sim_mean_e2e_ms", "e2e_error", "real_hit_rate",
                       "sim_hit_rate", "within_25pct"]))
    met = all(r["within_25pct"] for r in rows)
    print(f"calibration within +-25% on mean TTFT and e2e in every run: {'met' if met else 'missed'}")
    real_time = json.loads(Path(ns.real).read_text())["time"]
    fs_time = json.loads(Path(ns.forward_step).read_text())["time"]
    out = write("fleet_sim_calibration", {
        "fit": {k: getattr(fitted, k) for k in ("per_step", "per_token", "per_seq", "per_kv")},
        "fit_source": {"file": "forward_step.json", "time": fs_time},
        "real_source": {"file": "serve_bench_routing.json", "time": real_time},
        "tolerance": TOLERANCE, "target": "met" if met else "missed", "rows": rows})
    print(f"wrote {out}")
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6, 4))
        for key, marker in (("ttft", "o"), ("e2e", "s")):
            ax.scatter([r[f"real_mean_{key}_ms"] for r in rows],
                       [r[f"sim_mean_{key}_ms"] for r in rows], marker=marker, label=f"mean {key}")
        hi = max(max(r["real_mean_e2e_ms"], r["sim_mean_e2e_ms"]) for r in rows) * 1.1
        ax.plot([0, hi], [0, hi], "k:", label="exact")
        ax.fill_between([0, hi], [0, hi * (1 - TOLERANCE)], [0, hi * (1 + TOLERANCE)], alpha=0.15,
                        label="+-25%")
        ax.set_xlabel("real 2-worker CPU fleet (ms)")
        ax.set_ylabel("simulated (ms)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(plot_path("fleet_sim_calibration"), dpi=90)
    return 0


if __name__ == "__main__":
    sys.exit(main())
