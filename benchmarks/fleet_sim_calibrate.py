"""The simulator's CPU calibration and its check against a real 2-worker `raypaged serve` run.

1. Fit: a LinearCost (benchmarks/sim/cost_model.py) fitted to the real engine's measured steps on
   this machine, benchmarks/results/forward_step.json (`default` variant: SmolLM2-135M, the
   engine's CPU defaults, 1 thread = one serving worker's CPU; decode of 1/4/16/64 sequences
   and a prefill, at one context length, so the per-KV-token term is not fitted).
2. The serving path, measured (benchmarks/fleet_sim_probe.py, `--probe`: one request at a
   time on an idle real `raypaged serve --workers 2`): per step, what a served step costs
   beyond the forward (scheduling, sampling, streaming through Ray and HTTP); per attended
   pair, what a served prefill costs beyond the forward fit's per-token term; per request,
   the path outside any step (HTTP, routing, the submit, the first SSE frame). Solved from
   the probe's TTFTs and TPOTs (calibration.probe_terms); and, from its loaded phase, the
   serving path's CPU per output token on the machine's shared cores, which at load takes a
   share of the steps' (LinearCost.stretch). Nothing is fitted to the runs checked below.
   With `--fit-on mode:load` the per-step term is instead fitted so that the simulated mean
   time per output token equals the real fleet's in that ONE run (the earlier method), the
   probe's other terms kept.
3. Check: the simulator, with that model, at 2 workers, replays the workload of a real routing
   benchmark (`--real`, a serve_bench.py JSON: its seeded prefix_repetition dataset, its Poisson
   arrivals, its engine settings) for every routing mode and load measured there, and prints
   simulated vs measured mean TTFT and e2e (target: within +-25%), with the forward-only
   model's errors beside them. With several `--real` runs (the real fleet's means move by more
   than 25% between runs of 96 requests), each is replayed and the means are compared.

    python benchmarks/fleet_sim_calibrate.py
        [--real benchmarks/results/serve_bench_calibration_quiet.json [MORE.json ...]]
        [--probe benchmarks/results/fleet_sim_probe.json] [--route-cache-sample 1]
        [--fit-on round_robin:0.5] [--name fleet_sim_calibration]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import plot_path, pyplot, table, write  # noqa: E402
from benchmarks.serve_datasets import make_dataset  # noqa: E402
from benchmarks.sim.calibration import (fit_linear, fit_serving_overhead,  # noqa: E402
                                      forward_step_points, loaded_step_residual, probe_terms)
from benchmarks.sim.cost_model import CPU_SMOLLM2_135M  # noqa: E402
from benchmarks.sim.experiment import build_fleet, summarize  # noqa: E402
from benchmarks.sim.trace import from_prompts  # noqa: E402
from benchmarks.sim.worker import EngineShape  # noqa: E402
from raypaged.serve.autoscaler import worker_id_of  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
TOLERANCE = 0.25
# The real 2-worker fleet's worker names: the rendezvous order that places cold prefixes hashes
# them, so a replay named otherwise splits the prefixes differently from the run it replays.
REAL_WORKER_IDS = [worker_id_of(0), worker_id_of(1)]


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


def real_runs(real: dict) -> list[dict]:
    return [run for run in real["runs"] if run["dataset"] == "prefix_repetition"
            and run["mode"] in ("hash", "cache_aware", "round_robin")]


def replay(real: dict, run: dict, cost, cache_sample: int | None = None) -> dict:
    """The simulator on the real run's requests, arrivals and engine settings, 2 workers."""
    w = real["workload"]
    engine = EngineShape(num_blocks=w["kv_tokens"] // 16, block_size=16,
                         max_model_len=w["max_model_len"], max_num_seqs=256,
                         max_num_batched_tokens=2048)
    items = make_dataset(argparse.Namespace(**{**w, "dataset": "prefix_repetition"}))
    reqs = from_prompts(items, arrivals(len(items), run["request_rate"], w["seed"]))
    # the real run's routing settings (serve_bench passes them; route_cache_sample is the
    # server's default of its day, which the JSON does not record: --route-cache-sample)
    sample = {} if cache_sample is None else {"route_cache_sample": cache_sample}
    fleet = build_fleet(2, engine, cost, run["mode"], seed=w["seed"], worker_ids=REAL_WORKER_IDS,
                        route_prefix_blocks=w["route_prefix_blocks"],
                        route_load_factor=w["route_load_factor"], **sample)
    sim = fleet.run(reqs)
    out = summarize(sim, 2)
    if run.get("per_request"):  # serve_bench keeps each request's worker since 2026-11-30
        pairs = [(theirs[4], mine.worker) for theirs, mine in zip(run["per_request"], sim.records)
                 if theirs is not None]
        out["same_worker"] = sum(a == b for a, b in pairs) / len(pairs)
    return out


def check(real: dict, cost, cache_sample: int | None = None) -> list[dict]:
    rows = []
    for run in real_runs(real):
        sim = replay(real, run, cost, cache_sample)
        rows.append(_with_errors({
            "mode": run["mode"], "load": run["load"], "request_rate": run["request_rate"],
            "real_mean_ttft_ms": run["mean_ttft_ms"], "sim_mean_ttft_ms": 1000 * sim["mean_ttft_s"],
            "real_mean_e2e_ms": run["mean_e2e_ms"], "sim_mean_e2e_ms": 1000 * sim["mean_e2e_s"],
            "real_mean_tpot_ms": run["mean_tpot_ms"], "sim_mean_tpot_ms": 1000 * sim["mean_tpot_s"],
            "real_hit_rate": run["prefix_hit_rate"], "sim_hit_rate": sim["hit_rate"],
            "same_worker": sim.get("same_worker")}))
    return rows


def _with_errors(row: dict) -> dict:
    row["ttft_error"] = row["sim_mean_ttft_ms"] / row["real_mean_ttft_ms"] - 1
    row["e2e_error"] = row["sim_mean_e2e_ms"] / row["real_mean_e2e_ms"] - 1
    row["within_25pct"] = abs(row["ttft_error"]) <= TOLERANCE and abs(row["e2e_error"]) <= TOLERANCE
    return row


def averaged(per_file: list[list[dict]]) -> list[dict]:
    """Per mode and load, the mean of every real run's figures and of the simulator's replay of
    each (each real run has its own arrival rate, from its own saturation), errors of the
    means: one run of 96 requests moves by more than the tolerance between runs."""
    groups: dict[tuple, list[dict]] = {}
    for rows in per_file:
        for row in rows:
            groups.setdefault((row["mode"], row["load"]), []).append(row)
    out = []
    for (mode, load), rows in groups.items():
        row = {"mode": mode, "load": load, "runs": len(rows)}
        for key in rows[0]:
            if key.startswith(("real_", "sim_")) or key == "request_rate":
                row[key] = statistics.fmean(r[key] for r in rows)
        out.append(_with_errors(row))
    return out


def serving_fit(real_path: Path, real: dict, forward, fit_on: str,
                cache_sample: int | None = None):
    """The forward model plus the per-step serving overhead fitted on the one real run `fit_on`
    (mode:load) names."""
    mode, _, load = fit_on.partition(":")
    runs = [r for r in real_runs(real) if r["mode"] == mode and r["load"] == float(load)]
    if not runs:
        sys.exit(f"--fit-on {fit_on}: {real_path} has no prefix_repetition run of mode {mode} "
                 f"at load {load}")
    named = dataclasses.replace(forward, name=forward.name.replace("(fitted)", "(fitted, served)"),
                                per_step_serving=0.0)
    return fit_serving_overhead(
        named, lambda cost: replay(real, runs[0], cost, cache_sample)["mean_tpot_s"],
        runs[0]["mean_tpot_ms"] / 1000)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--forward-step", default=str(RESULTS / "forward_step.json"))
    p.add_argument("--real", nargs="+", default=[str(RESULTS / "serve_bench_calibration_quiet.json")],
                   help="serve_bench.py runs of the real fleet; with several, each is replayed and "
                        "the check compares their means")
    p.add_argument("--probe", default=str(RESULTS / "fleet_sim_probe.json"),
                   help="benchmarks/fleet_sim_probe.py's measurement of the serving path")
    p.add_argument("--fit-on", default="",
                   help="mode:load of one real run to fit the per-step serving overhead on "
                        "instead of taking it from the probe (default: not fitted)")
    p.add_argument("--route-cache-sample", type=int, default=None,
                   help="the real server's --route-cache-sample (default: today's default; "
                        "serve_bench_routing.json's run of 2026-11-22 had 1)")
    p.add_argument("--name", default="fleet_sim_calibration")
    ns = p.parse_args(argv)
    load_before = os.getloadavg()
    fitted = fit(Path(ns.forward_step))
    print(f"fitted from {ns.forward_step}: {fitted}")
    if fitted != CPU_SMOLLM2_135M:
        print(f"note: benchmarks/sim/cost_model.py's CPU_SMOLLM2_135M is {CPU_SMOLLM2_135M}: "
              "paste the fit there to use it")
    probe = json.loads(Path(ns.probe).read_text())
    reals = [json.loads(Path(f).read_text()) for f in ns.real]
    served = probe_terms(fitted, probe)
    served = dataclasses.replace(served, name=served.name.replace("(fitted)", "(fitted, probed)"))
    print(f"measured by the probe ({ns.probe}, load average {probe['load_average']}): "
          f"{1000 * served.per_step_serving:.2f} ms per step, "
          f"{1e6 * served.per_pair:.3f} us per attended pair, "
          f"{1000 * served.path_s:.1f} ms per request, "
          f"{1000 * served.per_seq_serving:.2f} ms per sequence of a step, "
          f"{1000 * served.serving_cpu_per_token:.2f} ms of CPU per output token and "
          f"{1000 * served.serving_cpu_per_step:.2f} ms per step on {served.cores} shared cores")
    residual = None
    if "engine_steps" in probe.get("loaded", {}):
        residual = loaded_step_residual(served, probe["loaded"])
        print(f"the probe's loaded phase: step threads {residual['step_threads_s']:.2f} s of CPU "
              f"over {residual['steps']} steps, {residual['predicted_s']:.2f} s predicted "
              f"without per_seq_serving: {1000 * residual['per_seq_s']:.2f} ms per sequence-step")
    if ns.fit_on:
        served = serving_fit(Path(ns.real[0]), reals[0], served, ns.fit_on,
                             ns.route_cache_sample)
        print(f"per-step serving overhead fitted on {ns.fit_on} instead: "
              f"{1000 * served.per_step_serving:.2f} ms per step")
    forward_rows = averaged([check(real, fitted, ns.route_cache_sample) for real in reals])
    per_run = [check(real, served, ns.route_cache_sample) for real in reals]
    rows = averaged(per_run)
    cols = ["mode", "load", "real_mean_ttft_ms", "sim_mean_ttft_ms", "ttft_error",
            "real_mean_e2e_ms", "sim_mean_e2e_ms", "e2e_error", "real_mean_tpot_ms",
            "sim_mean_tpot_ms", "real_hit_rate", "sim_hit_rate", "same_worker", "within_25pct"]
    print("forward only (no serving overhead):")
    print(table(forward_rows, cols))
    source = f"fitted on {ns.fit_on}" if ns.fit_on else "all measured by the probe"
    if len(per_run) > 1:
        for f, run_rows in zip(ns.real, per_run):
            print(f"with the serving path, against {Path(f).name} alone:")
            print(table(run_rows, cols))
    print(f"with the serving path ({source}; every other row is held out)"
          f"{f', means of {len(per_run)} real runs and their replays' if len(per_run) > 1 else ''}:")
    print(table(rows, cols))
    held_out = [r for r in rows if f"{r['mode']}:{r['load']}" != ns.fit_on]
    met = all(r["within_25pct"] for r in rows)
    print(f"calibration within +-25% on mean TTFT and e2e in every run: {'met' if met else 'missed'}"
          f" ({sum(r['within_25pct'] for r in held_out)} of {len(held_out)} held-out runs within)")
    within = {"ttft": sum(abs(r["ttft_error"]) <= TOLERANCE for r in rows),
              "e2e": sum(abs(r["e2e_error"]) <= TOLERANCE for r in rows)}
    print(f"mean TTFT within +-25% in {within['ttft']} of {len(rows)} runs, mean e2e in "
          f"{within['e2e']} of {len(rows)}")
    fs_time = json.loads(Path(ns.forward_step).read_text())["time"]
    out = write(ns.name, {
        "fit": {k: getattr(served, k) for k in ("per_step", "per_token", "per_seq", "per_kv",
                                                 "per_step_serving", "per_seq_serving",
                                                 "per_pair", "path_s",
                                                 "serving_cpu_per_token",
                                                 "serving_cpu_per_step", "cores")},
        "fit_source": {"file": Path(ns.forward_step).name, "time": fs_time},
        "probe_source": {"file": Path(ns.probe).name, "time": probe["time"],
                         "load_average": probe["load_average"]},
        "loaded_step_residual": residual,
        "serving_overhead_fit_on": ns.fit_on or None,
        "route_cache_sample": ns.route_cache_sample,
        "held_out_within_25pct": sum(r["within_25pct"] for r in held_out),
        "held_out_runs": len(held_out), "runs_within_25pct": within,
        "real_source": [{"file": Path(f).name, "time": real["time"],
                         "load_average": real.get("load_average")}
                        for f, real in zip(ns.real, reals)],
        "load_average_here": {"before": load_before, "after": os.getloadavg()},
        "tolerance": TOLERANCE, "target": "met" if met else "missed",
        "rows_forward_only": forward_rows, "rows": rows,
        "rows_per_real_run": per_run if len(per_run) > 1 else None})
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
        fig.savefig(plot_path(ns.name), dpi=90)
    return 0


if __name__ == "__main__":
    sys.exit(main())
