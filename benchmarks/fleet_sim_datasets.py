"""The routing default on workloads it was not tuned on: the fleet simulator (benchmarks/sim) on
serve_bench's synthetic datasets instead of the Mooncake trace the load factor was chosen on.

For each dataset (benchmarks/serve_datasets.py, seeded): round robin's saturation (every
request offered at t = 0: the rate at which the first 90% finish), then Poisson arrivals at
`--load` of it, and each policy on the same arrivals. A policy is `name`, or
`name:factor:sample:slack:weight` (the serving Router's --route-load-factor,
--route-cache-sample, --route-cache-slack and --route-recompute-weight; an empty or missing
field: serving's default). GPU profile, 16 workers.

    python benchmarks/fleet_sim_datasets.py [--datasets zipf,system_prompt,multi_turn,prefix_repetition]
        [--policies round_robin,least_loaded,hash,cache_aware,cache_aware:2] [--load 0.8]
        [--workers 16] [--num-prompts 2000] [--jobs 2] [--name fleet_sim_datasets]
"""
from __future__ import annotations

import argparse
import multiprocessing
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import plot_path, pyplot, table, write  # noqa: E402
from benchmarks.serve_datasets import make_dataset  # noqa: E402
from benchmarks.sim.cost_model import H100_LLAMA3_8B  # noqa: E402
from benchmarks.sim.experiment import simulate  # noqa: E402
from benchmarks.sim.policies import policy_spec  # noqa: E402
from benchmarks.sim.trace import from_prompts  # noqa: E402
from benchmarks.sim.worker import EngineShape  # noqa: E402

BLOCK = 16
COST = H100_LLAMA3_8B
ENGINE = EngineShape(num_blocks=COST.kv_blocks(BLOCK), block_size=BLOCK)
# serve_bench's datasets scaled to a GPU fleet: 64 prefixes of 2,048 tokens, 256-token
# suffixes, 128 output tokens (the shape of docs/fleet_sim.md's zipf / system_prompt rows).
SHAPE = dict(prefix_len=2048, num_prefixes=64, suffix_len=256, common_prefix_len=32,
             output_len=128, turns=4, input_len=(64, 512), seed=0)


def _requests(dataset: str, n: int, rate: float | None, seed: int):
    items = make_dataset(argparse.Namespace(dataset=dataset, num_prompts=n, **SHAPE))
    if rate is None:
        return from_prompts(items, [0.0] * len(items))
    rng, t, arrivals = random.Random(seed), 0.0, []
    for _ in items:
        t += rng.expovariate(rate)
        arrivals.append(t)
    return from_prompts(items, arrivals)


def _run(task: tuple) -> dict:
    dataset, n, workers, policy, rate = task
    name, options = policy_spec(policy)
    t0 = time.perf_counter()
    out = simulate(_requests(dataset, n, rate, 1), workers, ENGINE, COST, name, **options)
    return {"dataset": dataset, "policy": policy, **out, "wall_s": time.perf_counter() - t0}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--datasets", default="zipf,system_prompt,multi_turn,prefix_repetition")
    p.add_argument("--policies", default="round_robin,least_loaded,hash,cache_aware,"
                                         "cache_aware:2")
    p.add_argument("--load", type=float, default=0.8, help="fraction of round robin's saturation")
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--num-prompts", type=int, default=2000)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--name", default="fleet_sim_datasets")
    ns = p.parse_args(argv)
    datasets, policies = ns.datasets.split(","), ns.policies.split(",")
    if "round_robin" not in policies:
        p.error("--policies must include round_robin: every ratio is to it")
    rows = []
    with multiprocessing.get_context("spawn").Pool(ns.jobs) as pool:
        sats = pool.map(_run, [(d, ns.num_prompts, ns.workers, "round_robin", None)
                               for d in datasets], chunksize=1)
        rates = {s["dataset"]: ns.load * s["throughput_first_90pct"] for s in sats}
        for d in datasets:
            print(f"{d}: saturation {rates[d] / ns.load:.1f} req/s, offered {rates[d]:.1f}")
        tasks = [(d, ns.num_prompts, ns.workers, pol, rates[d]) for d in datasets
                 for pol in policies]
        rows = pool.map(_run, tasks, chunksize=1)
    for row in rows:
        rr = next(r for r in rows if r["dataset"] == row["dataset"]
                  and r["policy"] == "round_robin")
        row["offered_req_s"] = rates[row["dataset"]]
        row["ttft_x_rr"] = rr["mean_ttft_s"] / row["mean_ttft_s"]
        row["p99_ttft_x_rr"] = rr["p99_ttft_s"] / row["p99_ttft_s"]
        row["e2e_x_rr"] = rr["mean_e2e_s"] / row["mean_e2e_s"]
        row["throughput_x_rr"] = row["request_throughput"] / rr["request_throughput"]
    cols = ["dataset", "policy", "mean_ttft_s", "p99_ttft_s", "mean_e2e_s",
            "request_throughput", "hit_rate", "ttft_x_rr", "p99_ttft_x_rr", "e2e_x_rr",
            "throughput_x_rr", "preemptions", "max_worker_share_over_mean"]
    print(table(rows, cols))
    payload = {"workload": {"datasets": datasets, "shape": SHAPE, "load": ns.load,
                            "workers": ns.workers, "num_prompts": ns.num_prompts,
                            "arrivals": "Poisson, seed 1"},
               "cost_model": COST.name, "saturation": sats, "rows": rows}
    print(f"wrote {write(ns.name, payload)}")
    plot(rows, datasets, policies, ns)
    return 0


def plot(rows, datasets, policies, ns) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    width = 0.8 / len(policies)
    for i, policy in enumerate(policies):
        mine = {r["dataset"]: r for r in rows if r["policy"] == policy}
        xs = [k + i * width for k in range(len(datasets))]
        for ax, key in zip(axes, ("ttft_x_rr", "p99_ttft_x_rr", "hit_rate")):
            ax.bar(xs, [mine[d][key] for d in datasets], width, label=policy)
    for ax, title in zip(axes, ("mean TTFT, round robin / policy", "p99 TTFT, round robin / "
                                "policy", "prefix hit rate")):
        ax.set_xticks([k + 0.4 - width / 2 for k in range(len(datasets))], datasets,
                      fontsize=8)
        ax.set_title(title)
    axes[0].axhline(1.0, color="gray", linestyle="--")
    axes[1].axhline(1.0, color="gray", linestyle="--")
    axes[2].legend(fontsize=7)
    fig.suptitle(f"{ns.workers} simulated workers, {COST.name}, load {ns.load} of round "
                 "robin's saturation: workloads the default was not tuned on")
    fig.tight_layout()
    fig.savefig(plot_path(ns.name), dpi=90)
    print(f"wrote {plot_path(ns.name)}")


if __name__ == "__main__":
    sys.exit(main())
