"""One simulated run, summed up: a fleet of N workers under a policy, or the oracle.

The oracle is one worker holding the whole fleet's KV cache (N x blocks, N x seats and token
budget, steps N x faster): no prefix is ever split across workers, so its hit rate is the
ceiling any router can reach on the fleet. Its latencies are not a fleet's and are not compared.
"""
from __future__ import annotations

import dataclasses
import statistics
from typing import Sequence

from raypaged.serve.config import ServeOptions
from benchmarks.sim.fleet import Fleet, FleetRun
from benchmarks.sim.policies import make_policy
from benchmarks.sim.trace import SimRequest
from benchmarks.sim.worker import EngineShape, SimWorker

ORACLE = "oracle"


def build_fleet(num_workers: int, engine: EngineShape, cost, policy: str,
                snapshot_interval_s: float = 0.75, seed: int = 0,
                worker_ids: Sequence[str] | None = None, **router_options) -> Fleet:
    """router_options: the serving Router's settings (ServeOptions), e.g. route_load_factor.
    worker_ids: the workers' names (default w0000, w0001, ...). Routing's rendezvous order hashes
    them, so which worker a cold prefix goes to depends on them: a replay of a real fleet's run
    names its workers as that fleet did."""
    if policy == ORACLE:
        big = dataclasses.replace(
            engine, num_blocks=engine.num_blocks * num_workers,
            max_num_seqs=engine.max_num_seqs * num_workers,
            max_num_batched_tokens=engine.max_num_batched_tokens * num_workers)
        workers = [SimWorker("oracle", big, cost, speedup=num_workers)]
        return Fleet(workers, make_policy("round_robin", engine.block_size), snapshot_interval_s)
    ids = worker_ids or [f"w{i:04d}" for i in range(num_workers)]
    workers = [SimWorker(ids[i], engine, cost) for i in range(num_workers)]
    sample = router_options.get("route_cache_sample", ServeOptions().route_cache_sample)
    return Fleet(workers, make_policy(policy, engine.block_size, seed, **router_options),
                 snapshot_interval_s, sample)


def simulate(requests: Sequence[SimRequest], num_workers: int, engine: EngineShape, cost,
             policy: str, snapshot_interval_s: float = 0.75, seed: int = 0,
             worker_ids: Sequence[str] | None = None, **router_options) -> dict:
    fleet = build_fleet(num_workers, engine, cost, policy, snapshot_interval_s, seed,
                        worker_ids, **router_options)
    return summarize(fleet.run(requests), num_workers)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summarize(run: FleetRun, num_workers: int) -> dict:
    recs = run.records
    ttft = [r.first_token_s - r.arrival_s for r in recs]
    # per output token after the first, as serve_bench measures it on a real fleet
    tpot = [(r.finish_s - r.first_token_s) / (r.output_len - 1) for r in recs if r.output_len > 1]
    e2e = [r.finish_s - r.arrival_s for r in recs]
    prompt = sum(r.prompt_tokens for r in recs)
    # A burst's makespan ends in the tail of its longest requests, which a bigger fleet cannot
    # shorten: the rate at which the first 90% finish measures capacity without that tail.
    finish = sorted(r.finish_s for r in recs)
    ninety = int(0.9 * len(recs))
    start = min(r.arrival_s for r in recs)
    per_worker = {}
    for r in recs:
        per_worker[r.worker] = per_worker.get(r.worker, 0) + 1
    return {
        "requests": len(recs),
        "sim_seconds": run.sim_seconds,
        "request_throughput": len(recs) / run.sim_seconds,
        "throughput_first_90pct": ninety / (finish[ninety - 1] - start) if ninety else 0.0,
        "output_throughput": sum(r.output_len for r in recs) / run.sim_seconds,
        "mean_ttft_s": statistics.fmean(ttft), "p50_ttft_s": _pct(ttft, 0.5),
        "p99_ttft_s": _pct(ttft, 0.99),
        "mean_e2e_s": statistics.fmean(e2e), "p99_e2e_s": _pct(e2e, 0.99),
        "mean_tpot_s": statistics.fmean(tpot) if tpot else 0.0,
        "hit_rate": sum(r.cached_tokens for r in recs) / prompt,
        "preemptions": run.preemptions, "evictions": run.evictions,
        "max_worker_share_over_mean": max(per_worker.values()) * num_workers / len(recs),
        "decision_p50_us": _pct(run.decision_s, 0.5) * 1e6,
        "decision_p99_us": _pct(run.decision_s, 0.99) * 1e6,
        "snapshot_bytes_per_s": run.snapshot_bytes / run.sim_seconds,
        "mean_busy": statistics.fmean(run.busy_s.values()) / run.sim_seconds,
    }
