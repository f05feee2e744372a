"""The routing policies on the real 2-worker CPU fleet's shape, predicted by the calibrated
simulator, on serve_bench's datasets (the ones the routing default was and was not tuned on).

The fleet of `serve_bench.py`'s comparison (2 workers, --kv-context-len 4096, --max-model-len
1024, its seeded datasets and Poisson arrivals) in the simulator with the CPU cost model of
fleet_sim_calibrate.py: the forward-step fit plus the serving path measured by
fleet_sim_probe.py (nothing fitted to a routing run). Per dataset: round robin's saturation
(every request at t = 0: the rate at which the first 90% finish), then each policy at each
load on the same arrivals, with mean TTFT and e2e as ratios to round robin (above 1: better).
A prediction, within the calibration's error (docs/fleet_sim.md), not a measurement: the real
fleet is `serve_bench.py --dataset D --loads 0.5,0.8`.

    python benchmarks/fleet_sim_cpu_fleet.py [--datasets prefix_repetition,system_prompt,zipf,multi_turn]
        [--policies round_robin,hash,cache_aware] [--loads 0.5,0.8] [--num-prompts 192]
        [--seeds 0,1,2] [--probe benchmarks/results/fleet_sim_probe.json] [--name fleet_sim_cpu_fleet]

A policy is `name[:load factor[:cache sample[:slack[:recompute weight]]]]`, as in
fleet_sim_datasets.py.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.fleet_sim_calibrate import REAL_WORKER_IDS, arrivals, fit  # noqa: E402
from benchmarks.report import table, write  # noqa: E402
from benchmarks.serve_bench import parse_args as serve_bench_args  # noqa: E402
from benchmarks.serve_datasets import make_dataset  # noqa: E402
from benchmarks.sim.calibration import probe_terms  # noqa: E402
from benchmarks.sim.experiment import simulate  # noqa: E402
from benchmarks.sim.policies import policy_spec  # noqa: E402
from benchmarks.sim.trace import from_prompts  # noqa: E402
from benchmarks.sim.worker import EngineShape  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--datasets", default="prefix_repetition,system_prompt,zipf,multi_turn")
    p.add_argument("--policies", default="round_robin,hash,cache_aware")
    p.add_argument("--loads", default="0.5,0.8")
    p.add_argument("--num-prompts", type=int, default=192)
    p.add_argument("--seeds", default="0,1,2", help="datasets and arrivals; ratios are averaged")
    p.add_argument("--probe", default=str(RESULTS / "fleet_sim_probe.json"))
    p.add_argument("--forward-step", default=str(RESULTS / "forward_step.json"))
    p.add_argument("--name", default="fleet_sim_cpu_fleet")
    ns = p.parse_args(argv)
    cost = probe_terms(fit(Path(ns.forward_step)), json.loads(Path(ns.probe).read_text()))
    bench = serve_bench_args([])  # serve_bench's defaults: the same workload shapes
    engine = EngineShape(num_blocks=bench.kv_tokens // 16, block_size=16,
                         max_model_len=bench.max_model_len, max_num_seqs=256,
                         max_num_batched_tokens=2048)
    policies = [x for x in ns.policies.split(",") if x]
    specs = {pol: policy_spec(pol) for pol in policies}  # name, its routing settings
    rows = []
    for dataset in [d for d in ns.datasets.split(",") if d]:
        for seed in [int(s) for s in ns.seeds.split(",") if s]:
            items = make_dataset(argparse.Namespace(**{**vars(bench), "dataset": dataset,
                                                       "num_prompts": ns.num_prompts,
                                                       "seed": seed}))
            sat = simulate(from_prompts(items, [0.0] * len(items)), 2, engine, cost,
                           "round_robin", seed=seed,
                           worker_ids=REAL_WORKER_IDS)["throughput_first_90pct"]
            for load in [float(x) for x in ns.loads.split(",") if x]:
                reqs = from_prompts(items, arrivals(len(items), load * sat, seed))
                runs = {pol: simulate(reqs, 2, engine, cost, name, seed=seed,
                                      worker_ids=REAL_WORKER_IDS,
                                      **{"route_prefix_blocks": bench.route_prefix_blocks,
                                         "route_load_factor": bench.route_load_factor,
                                         **options})
                        for pol, (name, options) in specs.items()}
                rr = runs["round_robin"]
                for pol, out in runs.items():
                    rows.append({"dataset": dataset, "seed": seed, "load": load, "policy": pol,
                                 "saturation_req_s": sat,
                                 "mean_ttft_ms": 1000 * out["mean_ttft_s"],
                                 "mean_e2e_ms": 1000 * out["mean_e2e_s"],
                                 "hit_rate": out["hit_rate"],
                                 "ttft_x_rr": rr["mean_ttft_s"] / out["mean_ttft_s"],
                                 "e2e_x_rr": rr["mean_e2e_s"] / out["mean_e2e_s"]})
    summary = []
    for key in dict.fromkeys((r["dataset"], r["load"], r["policy"]) for r in rows):
        mine = [r for r in rows if (r["dataset"], r["load"], r["policy"]) == key]
        summary.append({"dataset": key[0], "load": key[1], "policy": key[2],
                        **{k: statistics.fmean(r[k] for r in mine)
                           for k in ("mean_ttft_ms", "mean_e2e_ms", "hit_rate", "ttft_x_rr",
                                     "e2e_x_rr")},
                        "min_ttft_x_rr": min(r["ttft_x_rr"] for r in mine),
                        "min_e2e_x_rr": min(r["e2e_x_rr"] for r in mine)})
    print(table(summary, list(summary[0])))
    out = write(ns.name, {"workload": {**{k: v for k, v in vars(ns).items() if k != "name"},
                                       "cost": {k: getattr(cost, k) for k in (
                                           "per_step", "per_token", "per_seq",
                                           "per_step_serving", "per_pair", "path_s")}},
                          "summary": summary, "rows": rows})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
