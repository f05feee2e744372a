"""Autoscaling at fleet scale, simulated (benchmarks/sim/autoscaled.py): the serving autoscaler's
policy on the Mooncake conversation trace's real arrivals, GPU cost model (H100 x Llama-3.1-8B,
docs/fleet_sim.md), against a fixed fleet sized for the peak.

The peak-sized fleet is the smallest fixed N whose share of requests with TTFT <= --ttft-target-s
is at least --fixed-share (it "meets the target"). The autoscaled fleet runs between
--min-workers and that N, new workers serving --cold-start-s after their spawn. Reported:
worker-hours of each (the autoscaled fleet's count every worker from spawn to leaving), the
share of requests within the target, TTFT percentiles, and the scale decisions. Targets
(issue 27): >= 30% fewer worker-hours, >= 95% of requests within the target.

    python benchmarks/autoscale_sim.py [--requests 3000] [--ttft-target-s 5] [--sizes 3,4,5,6]
"""
from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.fleet_sim import COST, ENGINE  # noqa: E402
from benchmarks.report import plot_path, pyplot, table, write  # noqa: E402
from raypaged.core.autoscale_policy import ScalePolicy  # noqa: E402
from raypaged.serve.config import ServeOptions  # noqa: E402
from benchmarks.sim.autoscaled import AutoscaledFleet  # noqa: E402
from benchmarks.sim.policies import DEFAULT_POLICY, make_policy  # noqa: E402
from benchmarks.sim.trace import find_trace, load_mooncake  # noqa: E402
from benchmarks.sim.worker import SimWorker  # noqa: E402


def parse_args(argv=None):
    d = ServeOptions()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=3000, help="the trace's first N requests")
    p.add_argument("--ttft-target-s", type=float, default=5.0)
    p.add_argument("--fixed-share", type=float, default=0.95)
    p.add_argument("--sizes", default="4,5,6", help="fixed fleet sizes to try, ascending")
    p.add_argument("--min-workers", type=int, default=1)
    p.add_argument("--cold-start-s", type=float, default=60.0)
    p.add_argument("--scale-target-wait-s", type=float, default=d.scale_target_wait_s)
    p.add_argument("--scale-in-load", type=float, default=d.scale_in_load)
    p.add_argument("--scale-window-s", type=float, default=d.scale_window_s)
    p.add_argument("--scale-out-cooldown-s", type=float, default=d.scale_out_cooldown_s)
    p.add_argument("--scale-in-cooldown-s", type=float, default=d.scale_in_cooldown_s)
    p.add_argument("--routing", default=DEFAULT_POLICY)
    p.add_argument("--jobs", type=int, default=2)
    return p.parse_args(argv)


def _run(task: tuple) -> dict:
    label, low, high, ns = task
    path = find_trace(ROOT)
    if path is None:
        sys.exit("the Mooncake trace is not in shared/traces/: see docs/fleet_sim.md")
    requests = load_mooncake(path, limit=ns.requests)
    scale = ScalePolicy(low, high, ns.scale_target_wait_s, ns.scale_in_load, ns.scale_window_s,
                        ns.scale_out_cooldown_s, ns.scale_in_cooldown_s)
    fleet = AutoscaledFleet(lambda wid: SimWorker(wid, ENGINE, COST),
                            make_policy(ns.routing, ENGINE.block_size), scale, ns.cold_start_s,
                            initial=low)
    t0 = time.perf_counter()
    run = fleet.run(requests)
    ttft = sorted(run.ttft_s)
    pct = lambda q: ttft[min(len(ttft) - 1, int(q * len(ttft)))]  # noqa: E731
    return {"fleet": label, "min_workers": low, "max_workers": high,
            "requests": len(ttft), "sim_seconds": run.sim_seconds,
            "worker_hours": run.worker_seconds / 3600, "peak_workers": run.max_workers,
            "mean_workers": run.worker_seconds / run.sim_seconds,
            "within_target": sum(t <= ns.ttft_target_s for t in ttft) / len(ttft),
            "p50_ttft_s": pct(0.5), "p90_ttft_s": pct(0.9), "p99_ttft_s": pct(0.99),
            "decisions": len(run.decisions), "decision_log": run.decisions,
            "timeline": run.timeline[::10], "wall_s": time.perf_counter() - t0}


COLUMNS = ["fleet", "min_workers", "max_workers", "worker_hours", "mean_workers", "peak_workers",
           "within_target", "p50_ttft_s", "p90_ttft_s", "p99_ttft_s", "decisions", "wall_s"]


def main(argv=None) -> int:
    ns = parse_args(argv)
    sizes = [int(s) for s in ns.sizes.split(",")]
    with multiprocessing.Pool(ns.jobs) as pool:
        fixed = pool.map(_run, [(f"fixed {n}", n, n, ns) for n in sizes])
    print(table(fixed, COLUMNS), flush=True)
    meeting = [r for r in fixed if r["within_target"] >= ns.fixed_share]
    if not meeting:
        print(f"no fixed size in {sizes} has {ns.fixed_share:.0%} within {ns.ttft_target_s} s: "
              "try larger --sizes")
        write("autoscale_sim", {"args": vars(ns), "fixed": fixed, "peak": None})
        return 1
    peak = meeting[0]
    auto = _run(("autoscaled", ns.min_workers, peak["max_workers"], ns))
    rows = fixed + [auto]
    print(table(rows, COLUMNS))
    saving = 1 - auto["worker_hours"] / peak["worker_hours"]
    summary = {"peak_fleet": peak["fleet"], "worker_hours_saving": saving,
               "autoscaled_within_target": auto["within_target"],
               "peak_fleet_within_target": peak["within_target"],
               "met": {"30pct_fewer_worker_hours": saving >= 0.30,
                       "95pct_within_target": auto["within_target"] >= 0.95}}
    print(f"peak-sized fleet: {peak['fleet']}; autoscaled: {saving:+.1%} fewer worker-hours, "
          f"{auto['within_target']:.1%} of requests within {ns.ttft_target_s} s "
          f"(targets: >= 30% {'met' if summary['met']['30pct_fewer_worker_hours'] else 'MISSED'},"
          f" >= 95% {'met' if summary['met']['95pct_within_target'] else 'MISSED'})")
    path = write("autoscale_sim", {"args": vars(ns), "summary": summary, "rows": rows})
    print(f"wrote {path}")
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(10, 4))
        ax.step([t for t, _ in auto["timeline"]], [n for _, n in auto["timeline"]], where="post",
                label="autoscaled: workers allocated")
        ax.axhline(peak["max_workers"], color="red", ls="--", label=f"{peak['fleet']} (peak-sized)")
        ax.set_xlabel("simulated seconds")
        ax.set_ylabel("workers")
        ax.legend()
        ax.set_title(f"Mooncake trace, first {ns.requests} requests: {saving:+.1%} worker-hours, "
                     f"{auto['within_target']:.1%} within {ns.ttft_target_s:g} s TTFT")
        fig.tight_layout()
        fig.savefig(plot_path("autoscale_sim"), dpi=110)
        print(f"wrote {plot_path('autoscale_sim')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
