"""What routing costs a router at 8, 64 and 1,000 workers: the serving Router's decision time per
request and the snapshot traffic it receives, from the real code (raypaged/serve/routing.py).

Decision: Router.rank() over W workers whose cache views each hold the blocks of a few Mooncake
prompts (every worker holds the trace's shared first block, as a real fleet's would), timed per
request on Mooncake prompts, in its two halves: `hashing` (Router.prompt_keys: the prompt's
block hashes, O(prompt tokens) whatever the fleet, and which a router needs whatever it decides)
and `choice` (Router.choose: what grows with the fleet); `whole_hashing` is prompt_keys without
the fleet (every block hashed, the rule before hashing stopped where no view reaches), timed
on the same requests in the same run. Times are the
thread's CPU time (time.thread_time), so a machine shared with other jobs does not add its
waits for a core to the percentiles.
Worker admission (`worker_hash_*`, once per prompt): the hashing a worker's admission does
(Request.update_block_hashes) on its own (`whole`) and given the router's hashes
(PromptKeys.hashes, which serving sends with the request: `after_router`): what the worker's
step thread no longer spends.
Snapshot traffic: the pickled bytes per worker per second measured by the simulator
(benchmarks/fleet_sim.py's JSON at --sim-json: its cache_aware row at load 0.8), times W: what
one router receives. `--sample N=JSON` adds cache_aware rows with route_cache_sample N: the
views hold only the sampled keys (as the controller mirrors them), the router walks only the
prompt's sampled keys, and the traffic comes from that JSON (a fleet_sim run with
--route-cache-sample N).
Fleet view traffic (`fleet_view_*`): what the serving protocol sends one router for the
fleet's states and stats (Controller.snapshot, the real class over W workers with busy stats;
handles stand-ins of a Ray handle's pickled size): `whole` every 0.25 s refresh, as before
snapshot(known), and `since`, as now (fleet_view_bytes_per_s).

    python benchmarks/router_cost.py [--workers 8,64,1000] [--requests 300] [--repeats 5]
                                     [--sim-json benchmarks/results/fleet_sim_16_depth_sample16.json]
                                     [--sample 1=benchmarks/results/fleet_sim_16_depth_sample1.json]
                                     [--name router_cost]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import pickle
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import plot_path, pyplot, table, write  # noqa: E402
from raypaged.config import KVPlan  # noqa: E402
from raypaged.core.cache_index import CacheIndex  # noqa: E402
from raypaged.core.contracts import EngineStats, MemoryStats  # noqa: E402
from raypaged.core.block_hash import hash_block_tokens  # noqa: E402
from raypaged.core.cache_summary import SummaryDelta, block_key, sampled  # noqa: E402
from raypaged.core.request import Request  # noqa: E402
from raypaged.core.sampling_params import SamplingParams  # noqa: E402
from raypaged.serve.config import POLL_INTERVAL_S, ServeOptions  # noqa: E402
from raypaged.serve.controller import Controller  # noqa: E402
from raypaged.serve.messages import WorkerStats  # noqa: E402
from raypaged.serve.fleet_loads import FleetLoads, WorkerLoad  # noqa: E402
from benchmarks.sim.policies import ROUTER_POLICIES, RouterPolicy  # noqa: E402
from benchmarks.sim.trace import find_trace, load_mooncake  # noqa: E402

BLOCK = 16
TARGET_DECISION_P99_US, TARGET_SNAPSHOT_BYTES_S = 100.0, 1e6


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def fleet_views(prompts: list[list[int]], workers: int, per_worker: int, rng,
                every: int = 1) -> FleetLoads:
    # each prompt's cacheable blocks' keys: full blocks, never the last token
    keys = [[block_key(h) for h in hash_block_tokens(p, BLOCK, None, (len(p) - 1) // BLOCK)]
            for p in prompts]
    loads, index = {}, CacheIndex()  # the views a router's fleet client keeps (ray_fleet.py)
    for i in range(workers):
        held = {}  # key -> depth (its block's index in the prompt)
        for k in rng.sample(range(len(keys)), per_worker):
            held.update((key, depth) for depth, key in enumerate(keys[k]))
        view = index.view(f"w{i:04d}")
        view.apply(sampled(SummaryDelta(1, tuple(held), full=True,
                                        depths=tuple(held.values())), every))
        loads[f"w{i:04d}"] = WorkerLoad(rng.randrange(0, 16), rng.randrange(0, 50_000), view)
    # as the Dispatcher keeps them: arrays built once per snapshot, not per request
    return FleetLoads.of(loads)


def time_decisions(policy: str, prompts, loads, every: int = 1, repeats: int = 5) -> dict:
    """Router.rank() = choose(prompt_keys()): the two halves timed apart on each request; every
    prompt `repeats` times, so a p99 is over 99 in 100 decisions, not 3 unlucky ones in 300."""
    router = RouterPolicy(policy, BLOCK, route_cache_sample=every).router
    total, hashing, choice, whole, total_whole = [], [], [], [], []
    queued = loads.queued.copy()  # a cache_aware choice charges its worker: each from the same
    for p in prompts * repeats:
        t0 = time.thread_time()
        keys = router.prompt_keys(p, None, loads)  # as Router.rank does: as deep as views reach
        t1 = time.thread_time()
        router.choose(keys, loads)
        t2 = time.thread_time()
        router.prompt_keys(p, None)                # the whole prompt hashed (the rule before)
        t3 = time.thread_time()
        loads.queued[:] = queued
        total.append(t2 - t0)
        hashing.append(t1 - t0)
        choice.append(t2 - t1)
        whole.append(t3 - t2)
        total_whole.append(t3 - t2 + t2 - t1)
    us = lambda xs, q: pct(xs, q) * 1e6  # noqa: E731
    return {"decision_p50_us": us(total, 0.5), "decision_p99_us": us(total, 0.99),
            "hashing_p50_us": us(hashing, 0.5), "hashing_p99_us": us(hashing, 0.99),
            "choice_p50_us": us(choice, 0.5), "choice_p99_us": us(choice, 0.99),
            "whole_hashing_p50_us": us(whole, 0.5), "whole_hashing_p99_us": us(whole, 0.99),
            "decision_whole_p50_us": us(total_whole, 0.5),
            "decision_whole_p99_us": us(total_whole, 0.99)}


def time_worker_hashing(policy: str, prompts, loads, every: int = 1) -> dict:
    """A worker's admission hashing per prompt, alone and after the router's hashes."""
    router = RouterPolicy(policy, BLOCK, route_cache_sample=every).router
    whole, rest, given = [], [], []
    params = SamplingParams(max_tokens=1)
    for p in prompts:
        keys = router.prompt_keys(p, None, loads)
        alone, helped = Request("a", p, params, 1), Request("b", p, params, 1,
                                                            block_hashes=keys.hashes)
        t0 = time.thread_time()
        alone.update_block_hashes(BLOCK)
        t1 = time.thread_time()
        helped.update_block_hashes(BLOCK)
        t2 = time.thread_time()
        assert helped.block_hashes == alone.block_hashes  # the router's are the worker's own
        whole.append(t1 - t0)
        rest.append(t2 - t1)
        given.append(len(keys.hashes) / max(1, len(alone.block_hashes)))
    us = lambda xs, q: pct(xs, q) * 1e6  # noqa: E731
    return {"worker_hash_whole_p50_us": us(whole, 0.5), "worker_hash_whole_p99_us": us(whole, 0.99),
            "worker_hash_after_router_p50_us": us(rest, 0.5),
            "worker_hash_after_router_p99_us": us(rest, 0.99),
            "worker_hash_saved": 1 - sum(rest) / sum(whole),
            "blocks_from_router_mean": statistics.fmean(given)}


# What one Ray actor handle pickles to (measured: a Ray 2.x handle, any number of methods),
# the size of the stand-in below; a benchmark without Ray cannot make real ones.
ACTOR_HANDLE_BYTES = 377


class HandleStandIn:
    def __init__(self, worker_id: str) -> None:
        self.blob = worker_id.encode().ljust(ACTOR_HANDLE_BYTES - 70, b".")


def fleet_view_bytes_per_s(workers: int, rng, refresh_s: float = 0.25,
                           poll_s: float = POLL_INTERVAL_S) -> dict:
    """Bytes per second one router receives for the fleet view (Controller.snapshot: every
    worker's state and stats; the cache deltas come apart, see snapshot_bytes_per_s), from the
    real Controller over W workers answering distinct busy stats: `whole`, the view with
    every handle at every refresh (the protocol before snapshot(known)); `since`, what
    snapshot(known) sends: nothing when the router holds the latest version, the views without
    the handles it holds when a poll made a new one (one per poll)."""
    plan = KVPlan(53_900_000_000, 131_072, block_size=16, num_blocks=25_720,
                  max_model_len=131_072)  # the simulator's H100 worker (docs/fleet_sim.md)
    answers = {}
    for i in range(workers):
        r = lambda n: rng.randrange(n)  # noqa: E731 - busy, distinct counters
        memory = MemoryStats(25_720, 16, r(25_720), r(25_720), r(25_720), r(10**7), r(10**7),
                             r(10**6), r(10**3))
        busy = EngineStats(memory, r(256), r(64), r(100), r(10**5), r(10**6),
                           num_queued_tokens=r(10**5), num_prefill_tokens=r(10**9))
        answers[f"w{i:04d}"] = WorkerStats(
            f"w{i:04d}", f"{rng.getrandbits(64):016x}", r(1 << 22), "meta-llama/Llama-3.1-8B",
            131_072, 16, plan, busy, num_active=r(300), eager_steps=r(10**6))

    handles = {w: HandleStandIn(w) for w in answers}
    answer_of = {handle: answers[w] for w, handle in handles.items()}

    async def probe(handle, since):
        return answer_of[handle]

    async def measure():
        controller = Controller(list(handles.items()), probe)
        controller._ensure_polling = lambda: None  # polled here, once
        await controller.poll_once()
        whole = await controller.snapshot()
        since = await controller.snapshot((whole.epoch, whole.version - 1))
        held = await controller.snapshot((whole.epoch, whole.version))
        return len(pickle.dumps(whole)), len(pickle.dumps(since)), len(pickle.dumps(held))

    whole, since, held = asyncio.run(measure())
    refreshes, polls = 1 / refresh_s, 1 / poll_s
    return {"fleet_view_whole_bytes_per_s": whole * refreshes,
            "fleet_view_since_bytes_per_s": since * polls + held * (refreshes - polls)}


def bytes_per_worker_s(path: str) -> float | None:
    """cache_aware at load 0.8 (else the default policy's row) of a fleet_sim JSON, per worker."""
    file = Path(path) if Path(path).is_absolute() else ROOT / path
    if not file.is_file():
        return None
    sim = json.loads(file.read_text())
    for policy in ("cache_aware", sim["default_policy"]):
        at = [r for r in sim["rows"] if r["policy"] == policy and r["load"] == 0.8]
        if at:
            return at[0]["snapshot_bytes_per_s"] / sim["workload"]["workers"]
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", default="8,64,1000")
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--prompts-per-worker", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5, help="decisions per prompt")
    p.add_argument("--sim-json", default="benchmarks/results/fleet_sim_16_depth_sample16.json",
                   help="traffic of the default route_cache_sample")
    p.add_argument("--sample", action="append", default=[], metavar="N=JSON",
                   help="also cache_aware with route_cache_sample N, traffic from JSON")
    p.add_argument("--name", default="router_cost", help="results file name")
    ns = p.parse_args(argv)
    load_before = os.getloadavg()
    path = find_trace(ROOT)
    if path is None:
        sys.exit("the Mooncake trace is not in shared/traces/ inside or beside the checkout")
    prompts = [r.prompt() for r in load_mooncake(path, limit=ns.requests)]
    default_sample = ServeOptions().route_cache_sample
    variants = [(policy, default_sample, ns.sim_json) for policy in ROUTER_POLICIES]
    for item in ns.sample:
        every, _, sim_json = item.partition("=")
        variants.append(("cache_aware", int(every), sim_json))
    per_worker = {sim_json: bytes_per_worker_s(sim_json) for _, _, sim_json in variants}
    rows = []
    for w in [int(x) for x in ns.workers.split(",")]:
        view = fleet_view_bytes_per_s(w, random.Random(w))
        for every in sorted({e for _, e, _ in variants}):
            loads = fleet_views(prompts, w, ns.prompts_per_worker, random.Random(w), every)
            for policy, e, sim_json in variants:
                if e != every:
                    continue
                row = {"workers": w, "policy": policy, "cache_sample": every, **view,
                       **time_decisions(policy, prompts, loads, every, ns.repeats)}
                if policy != "round_robin":
                    row.update(time_worker_hashing(policy, prompts, loads, every))
                if per_worker[sim_json] is not None:
                    row["snapshot_bytes_per_s"] = per_worker[sim_json] * w
                    row["snapshot_target"] = ("met" if row["snapshot_bytes_per_s"]
                                              <= TARGET_SNAPSHOT_BYTES_S else "missed")
                row["decision_target"] = ("met" if row["decision_p99_us"]
                                          <= TARGET_DECISION_P99_US else "missed")
                row["choice_target"] = ("met" if row["choice_p99_us"]
                                        <= TARGET_DECISION_P99_US else "missed")
                rows.append(row)
            del loads
    cols = ["workers", "policy", "cache_sample", "decision_p50_us", "decision_p99_us",
            "hashing_p99_us", "choice_p50_us", "choice_p99_us", "whole_hashing_p50_us",
            "whole_hashing_p99_us", "decision_whole_p99_us", "snapshot_bytes_per_s",
            "fleet_view_whole_bytes_per_s", "fleet_view_since_bytes_per_s",
            "decision_target", "choice_target", "snapshot_target", "worker_hash_whole_p50_us",
            "worker_hash_after_router_p50_us", "worker_hash_saved"]
    print(table(rows, cols))
    mean_tokens = statistics.fmean(len(x) for x in prompts)
    print(f"prompts: {len(prompts)} Mooncake prompts, mean {mean_tokens:,.0f} tokens; "
          f"snapshot bytes per worker per second: {per_worker}")
    load_after = os.getloadavg()
    out = write(ns.name, {"workload": {"requests": len(prompts), "repeats": ns.repeats,
                                             "mean_prompt_tokens": mean_tokens,
                                             "prompts_per_worker": ns.prompts_per_worker,
                                             "snapshot_bytes_per_worker_s": per_worker,
                                             "targets": {"decision_p99_us": TARGET_DECISION_P99_US,
                                                         "snapshot_bytes_per_s": TARGET_SNAPSHOT_BYTES_S}},
                                "load_average": {"before": load_before, "after": load_after},
                                "rows": rows})
    print(f"wrote {out}")
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(7, 4))
        for policy, every, _ in variants:
            mine = [r for r in rows if r["policy"] == policy and r["cache_sample"] == every]
            name = policy if every == 1 else f"{policy}, sample {every}"
            ax.plot([r["workers"] for r in mine], [r["decision_p99_us"] for r in mine], marker="o",
                    label=f"{name} (with hashing)")
            ax.plot([r["workers"] for r in mine], [r["choice_p99_us"] for r in mine], ":",
                    marker="x", label=f"{name} (choice only)")
        ax.axhline(TARGET_DECISION_P99_US, color="gray", linestyle="--", label="target p99")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("workers")
        ax.set_ylabel("decision p99 (us)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(plot_path(ns.name), dpi=90)
    return 0


if __name__ == "__main__":
    sys.exit(main())
