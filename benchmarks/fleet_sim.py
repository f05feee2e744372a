"""Routing at fleet scale, simulated: raypaged's own scheduler, block pool and router on the
Mooncake conversation trace, with a GPU cost model (benchmarks/sim; docs/fleet_sim.md).

For one fleet size: the saturation throughput is measured first (round robin, every request of
the window offered at t = 0: the rate at which the first 90% of them finish, so the tail of the
longest few does not hide a big fleet's capacity), then each policy runs the trace's arrivals scaled to each offered
load (a fraction of that saturation), and the oracle (one worker with the fleet's whole KV
cache) gives the hit-rate ceiling at each load. Ratios are to round robin in the same table.

    python benchmarks/fleet_sim.py [--workers 16] [--requests 2000] [--loads 0.5,0.8,0.95]
                                   [--policies round_robin,least_loaded,hash,cache_aware]
                                   [--snapshot-interval 0.75] [--route-cache-sample N]
                                   [--route-cache-slack TOKENS] [--route-recompute-weight W]
                                   [--jobs 2] [--name fleet_sim]
"""
from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import plot_path, pyplot, table, write  # noqa: E402
from benchmarks.sim.cost_model import H100_LLAMA3_8B  # noqa: E402
from benchmarks.sim.experiment import ORACLE, simulate  # noqa: E402
from benchmarks.sim.policies import DEFAULT_POLICY, POLICIES  # noqa: E402
from benchmarks.sim.trace import find_trace, load_mooncake, time_scaled  # noqa: E402
from benchmarks.sim.worker import EngineShape  # noqa: E402

BLOCK = 16
COST = H100_LLAMA3_8B
ENGINE = EngineShape(num_blocks=COST.kv_blocks(BLOCK), block_size=BLOCK)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--requests", type=int, default=2000,
                   help="the trace's first N requests (a contiguous window of its arrivals)")
    p.add_argument("--loads", default="0.5,0.8,0.95", help="fractions of measured saturation")
    p.add_argument("--policies", default="round_robin,least_loaded,hash,cache_aware")
    p.add_argument("--snapshot-interval", type=float, default=0.75,
                   help="seconds between the router's snapshots (serving: poll 0.5 + refresh 0.25)")
    p.add_argument("--route-load-factor", type=float, default=None,
                   help="the serving Router's load bound (default: serving's, 1.25)")
    p.add_argument("--route-cache-sample", type=int, default=None,
                   help="routers see the cache keys of every N-th block of a prompt and of its "
                        "blocks 1, 2, 4, 8, ... (default: serving's, 16)")
    p.add_argument("--route-cache-slack", type=int, default=None,
                   help="cache_aware's slack in tokens (default: serving's, 2048)")
    p.add_argument("--route-recompute-weight", type=float, default=None,
                   help="cache_aware's weight of recomputed prompt tokens (default: serving's)")
    p.add_argument("--jobs", type=int, default=2, help="simulations run at once (processes)")
    p.add_argument("--name", default=None, help="results name (default fleet_sim_<workers>)")
    ns = p.parse_args(argv)
    ns.loads = [float(x) for x in ns.loads.split(",")]
    ns.policies = ns.policies.split(",")
    unknown = set(ns.policies) - set(POLICIES)
    if unknown:
        p.error(f"unknown policies {sorted(unknown)}; choices: {', '.join(POLICIES)}")
    if "round_robin" not in ns.policies:
        p.error("--policies must include round_robin: every ratio is to it")
    ns.name = ns.name or f"fleet_sim_{ns.workers}"
    return ns


def _window(n: int):
    path = find_trace(ROOT)
    if path is None:
        sys.exit("the Mooncake trace is not in shared/traces/ inside or beside the checkout: "
                 "see docs/fleet_sim.md for where to get it")
    return load_mooncake(path, limit=n)


def _run(task: tuple) -> dict:
    n, workers, policy, speedup, interval, options = task
    requests = _window(n)
    if speedup is None:  # saturation: everything offered at once
        requests = time_scaled(requests, float("inf"))
    else:
        requests = time_scaled(requests, speedup)
    t0 = time.perf_counter()
    out = simulate(requests, workers, ENGINE, COST, policy, interval, **options)
    return {"policy": policy, **out, "wall_s": time.perf_counter() - t0}


def main(argv=None) -> int:
    ns = parse_args(argv)
    window = _window(ns.requests)
    span = max(r.arrival_s for r in window)
    trace_rate = len(window) / span
    with multiprocessing.get_context("spawn").Pool(ns.jobs) as pool:
        options = {k: v for k, v in (("route_load_factor", ns.route_load_factor),
                                     ("route_cache_sample", ns.route_cache_sample),
                                     ("route_cache_slack", ns.route_cache_slack),
                                     ("route_recompute_weight", ns.route_recompute_weight))
                   if v is not None}
        sat = pool.apply(_run, ((ns.requests, ns.workers, "round_robin", None,
                                 ns.snapshot_interval, options),))
        saturation = sat["throughput_first_90pct"]
        print(f"saturation (round robin, all {ns.requests} requests at t=0, first 90% done): "
              f"{saturation:.2f} req/s; the trace window offers {trace_rate:.2f} req/s")
        tasks, keys = [], []
        for load in ns.loads:
            speedup = load * saturation / trace_rate
            for policy in [*ns.policies, ORACLE]:
                tasks.append((ns.requests, ns.workers, policy, speedup, ns.snapshot_interval,
                              options))
                keys.append((load, speedup))
        results = pool.map(_run, tasks, chunksize=1)
    rows = []
    for (load, speedup), res in zip(keys, results):
        rows.append({"load": load, "offered_req_s": load * saturation, "speedup": speedup, **res})
    for row in rows:
        rr = next(r for r in rows if r["load"] == row["load"] and r["policy"] == "round_robin")
        orc = next(r for r in rows if r["load"] == row["load"] and r["policy"] == ORACLE)
        row["ttft_x_rr"] = rr["mean_ttft_s"] / row["mean_ttft_s"]
        row["p99_ttft_x_rr"] = rr["p99_ttft_s"] / row["p99_ttft_s"]
        row["e2e_x_rr"] = rr["mean_e2e_s"] / row["mean_e2e_s"]
        row["throughput_x_rr"] = row["request_throughput"] / rr["request_throughput"]
        row["hit_x_oracle"] = row["hit_rate"] / orc["hit_rate"] if orc["hit_rate"] else None
    cols = ["load", "policy", "mean_ttft_s", "p99_ttft_s", "mean_e2e_s", "request_throughput",
            "hit_rate", "ttft_x_rr", "p99_ttft_x_rr", "throughput_x_rr", "hit_x_oracle",
            "preemptions", "max_worker_share_over_mean", "decision_p99_us",
            "snapshot_bytes_per_s"]
    print(table(rows, cols))
    verdicts = {policy: targets(rows, policy) for policy in dict.fromkeys([DEFAULT_POLICY, "cache_aware"])
                if policy in ns.policies}
    for policy, marks in verdicts.items():
        print(f"targets for {policy}{' (the serving default)' if policy == DEFAULT_POLICY else ''}:")
        for k, v in marks.items():
            print(f"  {k}: {v}")
    payload = {
        "workload": {"trace": "mooncake_conversation_trace.jsonl", "requests": ns.requests,
                     "trace_window_s": span, "trace_rate_req_s": trace_rate,
                     "workers": ns.workers, "loads": ns.loads,
                     "snapshot_interval_s": ns.snapshot_interval,
                     "route_load_factor": ns.route_load_factor,
                     "route_cache_sample": ns.route_cache_sample,
                     "route_cache_slack": ns.route_cache_slack,
                     "route_recompute_weight": ns.route_recompute_weight},
        "cost_model": COST.name, "engine": vars(ENGINE) if hasattr(ENGINE, "__dict__") else
        {f: getattr(ENGINE, f) for f in ENGINE.__dataclass_fields__},
        "default_policy": DEFAULT_POLICY, "saturation": sat, "saturation_req_s": saturation,
        "rows": rows, "targets": verdicts}
    print(f"wrote {write(ns.name, payload)}")
    plot(rows, ns)
    return 0


def targets(rows: list[dict], policy: str) -> dict:
    """The issue's targets (set for the default policy) for one policy, each met or missed."""
    out = {}
    mark = lambda ok: "met" if ok else "missed"  # noqa: E731
    mine = [r for r in rows if r["policy"] == policy]
    at = {r["load"]: r for r in mine}
    if 0.8 in at:
        r = at[0.8]
        out["mean TTFT >= 3x round robin at 0.8"] = f"{mark(r['ttft_x_rr'] >= 3)} ({r['ttft_x_rr']:.2f}x)"
        out["p99 TTFT >= 2x round robin at 0.8"] = f"{mark(r['p99_ttft_x_rr'] >= 2)} ({r['p99_ttft_x_rr']:.2f}x)"
    worse = []
    for r in mine:
        for base in ("round_robin", "least_loaded"):
            if base == policy:
                continue
            b = next((x for x in rows if x["load"] == r["load"] and x["policy"] == base), None)
            if b and (r["mean_ttft_s"] > b["mean_ttft_s"] or r["p99_ttft_s"] > b["p99_ttft_s"]):
                worse.append(f"{base} at {r['load']}")
    out["never worse than round robin / least loaded (mean and p99 TTFT)"] = (
        mark(not worse) + (f" (worse than {', '.join(worse)})" if worse else ""))
    tp = min(r["throughput_x_rr"] for r in mine)
    out["throughput >= 1.0x round robin"] = f"{mark(tp >= 1.0)} (min {tp:.3f}x)"
    hit = min(r["hit_x_oracle"] or 0 for r in mine)
    out["hit rate >= 0.9x oracle"] = f"{mark(hit >= 0.9)} (min {hit:.2f}x)"
    return out


def plot(rows: list[dict], ns) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for policy in [*ns.policies, ORACLE]:
        mine = [r for r in rows if r["policy"] == policy]
        style = ":" if policy == ORACLE else "-"
        for ax, key in zip(axes, ("mean_ttft_s", "p99_ttft_s", "hit_rate")):
            ax.plot([r["load"] for r in mine], [r[key] for r in mine], style, marker="o",
                    label=policy)
    for ax, title in zip(axes, ("mean TTFT (s)", "p99 TTFT (s)", "prefix hit rate")):
        ax.set_xlabel("offered load (fraction of saturation)")
        ax.set_title(title)
    axes[0].set_yscale("log")
    axes[1].set_yscale("log")
    axes[2].legend()
    fig.suptitle(f"{ns.workers} simulated workers, {COST.name}, Mooncake trace "
                 f"({ns.requests} requests); oracle latency is not a fleet's")
    fig.tight_layout()
    fig.savefig(plot_path(ns.name), dpi=90)
    print(f"wrote {plot_path(ns.name)}")


if __name__ == "__main__":
    sys.exit(main())
