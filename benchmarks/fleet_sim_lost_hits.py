"""Where the routing default loses prefix hits, in the fleet simulator on the Mooncake trace.

At every routing decision the simulated workers' real block pools are asked how many leading
blocks of the prompt each one holds at that instant (its true hit, not the router's lagged,
sampled view). The fleet's best true hit is what a router with a perfect view could get; the
chosen worker's true hit is what the decision kept. Each lost token is put down to why the
best worker was passed over:

    over the bound   the best worker held cap = ceil(factor x (in flight + 1) / workers) or
                     more requests (cost_routing.py's concurrency cap)
    lagging view     the router's view of the best worker showed less than its true hit
    cost / slack     neither: its cost (uncached prefill + queued) was past the slack

One policy at one load (a fraction of round robin's measured saturation, as fleet_sim.py):

    python benchmarks/fleet_sim_lost_hits.py [--workers 16] [--load 0.8] [--requests 2000]
                                             [--name fleet_sim_lost_hits]
"""
from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.fleet_sim import BLOCK, COST, ENGINE, _run, _window  # noqa: E402
from benchmarks.report import plot_path, pyplot, table, write  # noqa: E402
from benchmarks.sim.experiment import build_fleet  # noqa: E402
from benchmarks.sim.policies import DEFAULT_POLICY  # noqa: E402
from benchmarks.sim.trace import time_scaled  # noqa: E402
from raypaged.core.request import Request  # noqa: E402
from raypaged.core.sampling_params import SamplingParams  # noqa: E402
from raypaged.serve.config import ServeOptions  # noqa: E402
from raypaged.serve.cost_routing import concurrency_cap, held_tokens  # noqa: E402

REASONS = ("over the bound", "lagging view", "cost / slack")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--load", type=float, default=0.8)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--name", default="fleet_sim_lost_hits")
    ns = p.parse_args(argv)
    window = _window(ns.requests)
    saturation = _run((ns.requests, ns.workers, "round_robin", None, 0.75, {}))
    rate = len(window) / max(r.arrival_s for r in window)
    speedup = ns.load * saturation["throughput_first_90pct"] / rate
    fleet = build_fleet(ns.workers, ENGINE, COST, DEFAULT_POLICY)
    factor = ServeOptions().route_load_factor
    lost, kept, best_sum = collections.Counter(), 0, 0
    choose = fleet.policy.choose

    def audited(tokens, loads):
        nonlocal kept, best_sum
        requests = loads.requests.copy()          # before the choice counts itself
        cap = concurrency_cap(loads, factor)
        keys = fleet.policy.router.prompt_keys(tokens, None, loads)  # what the router walks
        view = held_tokens(keys.block_keys, loads, keys.blocks_at, BLOCK)
        chosen = choose(tokens, loads)
        # each pool's hit as its engine's admission would take it now (one hashing for all)
        probe = Request("audit", tokens, SamplingParams(max_tokens=1), 1,
                        block_hashes=keys.hashes)
        true = {w: BLOCK * len(fleet.workers[w].scheduler.kv.find_cached_prefix(probe))
                for w in loads.worker_ids}
        best = max(true, key=true.get)
        kept += true[chosen]
        best_sum += true[best]
        if true[best] > true[chosen]:
            i = loads.at[best]
            reason = (REASONS[0] if requests[i] + 1 > cap else
                      REASONS[1] if view[i] < true[best] else REASONS[2])
            lost[reason] += true[best] - true[chosen]
        return chosen

    fleet.policy.choose = audited
    run = fleet.run(time_scaled(window, speedup))
    prompt = sum(r.prompt_tokens for r in run.records)
    rows = [{"what": "best true hit in the fleet", "share_of_prompt_tokens": best_sum / prompt},
            {"what": "true hit on the chosen worker", "share_of_prompt_tokens": kept / prompt},
            {"what": "hit the engine took (after the request's wait)",
             "share_of_prompt_tokens": sum(r.cached_tokens for r in run.records) / prompt}]
    rows += [{"what": f"lost: {k}", "share_of_prompt_tokens": lost[k] / prompt} for k in REASONS]
    print(f"{DEFAULT_POLICY}, {ns.workers} workers, load {ns.load} ({speedup:.3f}x the trace's "
          f"arrival rate), route_load_factor {factor}")
    print(table(rows, ["what", "share_of_prompt_tokens"]))
    print(f"wrote {write(ns.name, {'policy': DEFAULT_POLICY, 'workers': ns.workers, 'load': ns.load, 'requests': ns.requests, 'speedup': speedup, 'route_load_factor': factor, 'rows': rows})}")
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(9, 3.5))
        ax.barh([r["what"] for r in rows][::-1], [r["share_of_prompt_tokens"] for r in rows][::-1])
        ax.set_xlabel("share of all prompt tokens")
        ax.set_title(f"{DEFAULT_POLICY}: hits kept and lost, {ns.workers} simulated workers, "
                     f"Mooncake, load {ns.load}")
        fig.tight_layout()
        fig.savefig(plot_path(ns.name), dpi=90)
        print(f"wrote {plot_path(ns.name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
