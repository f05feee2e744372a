"""What routing costs a router at 8, 64 and 1,000 workers: the serving Router's decision time per
request and the snapshot traffic it receives, from the real code (raypaged/serve/routing.py).

Decision: Router.rank() over W workers whose cache views each hold the blocks of a few Mooncake
prompts (every worker holds the trace's shared first block, as a real fleet's would), timed per
request on Mooncake prompts; the prompt's block hashing (which rank() does first, and which a
router needs whatever it decides) is timed apart, and `choice` is the rest. Times are the
thread's CPU time (time.thread_time), so a machine shared with other jobs does not add its
waits for a core to the percentiles.
Snapshot traffic: the pickled bytes per worker per second measured by the simulator
(benchmarks/fleet_sim.py's JSON at --sim-json), times W: what one router receives.

    python benchmarks/router_cost.py [--workers 8,64,1000] [--requests 300]
                                     [--sim-json benchmarks/results/fleet_sim_16.json]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import plot_path, pyplot, table, write  # noqa: E402
from raypaged.core.cache_summary import CacheView  # noqa: E402
from raypaged.serve.cost_routing import WorkerLoad, prompt_block_keys  # noqa: E402
from raypaged.serve.routing import routing_key  # noqa: E402
from raypaged.sim.policies import ROUTER_POLICIES, RouterPolicy  # noqa: E402
from raypaged.sim.trace import find_trace, load_mooncake  # noqa: E402

BLOCK = 16
TARGET_DECISION_P99_US, TARGET_SNAPSHOT_BYTES_S = 100.0, 1e6


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def fleet_views(prompts: list[list[int]], workers: int, per_worker: int, rng) -> dict:
    keys = [prompt_block_keys(p, BLOCK) for p in prompts]
    loads = {}
    for i in range(workers):
        view = CacheView()
        for k in rng.sample(range(len(keys)), per_worker):
            view.keys.update(keys[k])
        loads[f"w{i:04d}"] = WorkerLoad(rng.randrange(0, 16), rng.randrange(0, 50_000), view)
    return loads


def time_decisions(policy: str, prompts, loads) -> dict:
    router = RouterPolicy(policy, BLOCK)
    total, hashing = [], []
    for p in prompts:
        t0 = time.thread_time()
        router.choose(p, loads)
        t1 = time.thread_time()
        if policy == "cache_aware":
            prompt_block_keys(p, BLOCK)
        if policy != "round_robin":
            routing_key(p, BLOCK, router.router.config.route_prefix_blocks)
        t2 = time.thread_time()
        total.append(t1 - t0)
        hashing.append(t2 - t1)
    choice = [t - h for t, h in zip(total, hashing)]
    us = lambda xs, q: pct(xs, q) * 1e6  # noqa: E731
    return {"decision_p50_us": us(total, 0.5), "decision_p99_us": us(total, 0.99),
            "hashing_p50_us": us(hashing, 0.5), "hashing_p99_us": us(hashing, 0.99),
            "choice_p50_us": us(choice, 0.5), "choice_p99_us": us(choice, 0.99)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", default="8,64,1000")
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--prompts-per-worker", type=int, default=3)
    p.add_argument("--sim-json", default=str(ROOT / "benchmarks/results/fleet_sim_16.json"))
    ns = p.parse_args(argv)
    path = find_trace(ROOT)
    if path is None:
        sys.exit("the Mooncake trace is not in shared/traces/ inside or beside the checkout")
    prompts = [r.prompt() for r in load_mooncake(path, limit=ns.requests)]
    per_worker_bytes_s = None
    if Path(ns.sim_json).is_file():
        sim = json.loads(Path(ns.sim_json).read_text())
        at = [r for r in sim["rows"] if r["policy"] == sim["default_policy"] and r["load"] == 0.8]
        if at:
            per_worker_bytes_s = at[0]["snapshot_bytes_per_s"] / sim["workload"]["workers"]
    rng = random.Random(0)
    rows = []
    for w in [int(x) for x in ns.workers.split(",")]:
        loads = fleet_views(prompts, w, ns.prompts_per_worker, rng)
        for policy in ROUTER_POLICIES:
            row = {"workers": w, "policy": policy, **time_decisions(policy, prompts, loads)}
            if per_worker_bytes_s is not None:
                row["snapshot_bytes_per_s"] = per_worker_bytes_s * w
            row["decision_target"] = "met" if row["decision_p99_us"] <= TARGET_DECISION_P99_US else "missed"
            rows.append(row)
        del loads
    cols = ["workers", "policy", "decision_p50_us", "decision_p99_us", "hashing_p99_us",
            "choice_p50_us", "choice_p99_us", "snapshot_bytes_per_s", "decision_target"]
    print(table(rows, cols))
    mean_tokens = statistics.fmean(len(x) for x in prompts)
    print(f"prompts: {len(prompts)} Mooncake prompts, mean {mean_tokens:,.0f} tokens; "
          f"snapshot bytes per worker per second (from {ns.sim_json}): {per_worker_bytes_s}")
    out = write("router_cost", {"workload": {"requests": len(prompts), "mean_prompt_tokens": mean_tokens,
                                             "prompts_per_worker": ns.prompts_per_worker,
                                             "snapshot_bytes_per_worker_s": per_worker_bytes_s,
                                             "targets": {"decision_p99_us": TARGET_DECISION_P99_US,
                                                         "snapshot_bytes_per_s": TARGET_SNAPSHOT_BYTES_S}},
                                "rows": rows})
    print(f"wrote {out}")
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(7, 4))
        for policy in ROUTER_POLICIES:
            mine = [r for r in rows if r["policy"] == policy]
            ax.plot([r["workers"] for r in mine], [r["decision_p99_us"] for r in mine], marker="o",
                    label=f"{policy} (with hashing)")
            ax.plot([r["workers"] for r in mine], [r["choice_p99_us"] for r in mine], ":",
                    marker="x", label=f"{policy} (choice only)")
        ax.axhline(TARGET_DECISION_P99_US, color="gray", linestyle="--", label="target p99")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("workers")
        ax.set_ylabel("decision p99 (us)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(plot_path("router_cost"), dpi=90)
    return 0


if __name__ == "__main__":
    sys.exit(main())
