"""Online serving benchmark, shaped like `vllm bench serve`.

Against a running server:
    python benchmarks/serve_bench.py --url http://127.0.0.1:8000 --dataset random \\
        --num-prompts 100 --request-rate 4

Comparison (the default): launches `raypaged serve` itself, one configuration after another, on
the seeded shared-prefix workload at a fixed offered load (Poisson, 1 request/s: latency is
compared at equal load, not at saturation), and prints one table:
    hash         --workers 2 --routing hash
    cache_aware  --workers 2 --routing cache_aware
    round_robin  --workers 2 --routing round_robin
    single       --workers 1 with the fleet's whole KV budget (the hit-rate yardstick)
    python benchmarks/serve_bench.py [--modes hash,cache_aware,round_robin,single]
                                     [--sweep-prefix-blocks 1,2,4,8]

Datasets: benchmarks/serve_datasets.py (seeded, token ids; outputs use ignore_eos).

Per request: TTFT (send -> first token chunk), ITL (gaps between chunks), TPOT ((e2e - TTFT) /
(output tokens - 1)), E2E; each request's send time, TTFT, e2e, cached tokens and worker are kept
in the JSON (`per_request`). Per run: mean/p50/p90/p99 of each, request and output-token
throughput, the fleet prefix-cache hit rate (prefix_cache_hits / prefix_cache_queries over the
run, from /metrics) and requests per worker (from the x-raypaged-worker header).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from benchmarks.report import plot_path, pyplot, table, write  # noqa: E402
from benchmarks.serve_datasets import DATASETS, make_dataset  # noqa: E402
from benchmarks.serve_process import launch, stop  # noqa: E402



# -- one request -----------------------------------------------------------------------------
@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    cached_tokens: int = 0  # usage.prompt_tokens_details: the prefix cache's hit for it
    sent: float = 0.0       # seconds from the run's start to the send
    worker: str = ""
    error: str = ""
    retry_after: float | None = None  # a refusal's Retry-After header, seconds


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: list[int],
                      output_len: int) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "ignore_eos": True,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    res, last = Result(ok=False), None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                retry_after = r.headers.get("retry-after")
                return Result(ok=False, error=f"{r.status_code} {(await r.aread())[:200]!r}",
                              retry_after=float(retry_after) if retry_after else None)
            res.worker = r.headers.get("x-raypaged-worker", "")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return Result(ok=False, error=event["error"]["message"])
                now = time.perf_counter()
                if event.get("choices"):
                    if last is None:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                if usage := event.get("usage"):
                    res.output_tokens = usage["completion_tokens"]
                    res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get(
                        "cached_tokens", 0)
    except httpx.HTTPError as exc:
        return Result(ok=False, error=repr(exc))
    res.e2e = time.perf_counter() - start
    res.ok = True
    return res


async def run_load(url: str, model: str, reqs, max_concurrency: int | None,
                   request_rate: float, seed: int) -> tuple[list[Result], float]:
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
    sem = asyncio.Semaphore(max_concurrency or len(reqs))
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await one_request(client, url, model, [7] * 8, 2)  # warm-up

        async def limited(prompt, out, after):
            if after is not None:  # the next turn of a conversation waits for the last one
                await tasks[after]
            async with sem:
                sent = time.perf_counter() - start
                res = await one_request(client, url, model, prompt, out)
                res.sent = sent
                return res

        start = time.perf_counter()
        tasks = []
        for prompt, out, after in reqs:
            tasks.append(asyncio.create_task(limited(prompt, out, after)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))  # Poisson arrivals
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


# -- metrics ---------------------------------------------------------------------------------
def prefix_counters(url: str) -> tuple[float, float]:
    r = httpx.get(f"{url}/metrics", timeout=30)
    r.raise_for_status()
    text = r.text
    totals = {"raypaged:prefix_cache_hits": 0.0, "raypaged:prefix_cache_queries": 0.0}
    for fam in text_string_to_metric_families(text):
        if fam.name in totals:
            totals[fam.name] += sum(s.value for s in fam.samples if s.name.endswith("_total"))
    return totals["raypaged:prefix_cache_hits"], totals["raypaged:prefix_cache_queries"]


def summarize(results: list[Result], duration: float, hits: float, queries: float) -> dict:
    ok = [r for r in results if r.ok]
    out = {"requests": len(results), "failed": len(results) - len(ok), "duration_s": duration,
           "request_throughput": len(ok) / duration,
           "output_throughput": sum(r.output_tokens for r in ok) / duration,
           "prefix_hit_rate": hits / queries if queries else 0.0}
    series = {"ttft": [r.ttft for r in ok], "e2e": [r.e2e for r in ok],
              "itl": [x for r in ok for x in r.itl],
              "tpot": [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]}
    for name, xs in series.items():
        xs = sorted(xs) or [0.0]
        out[f"mean_{name}_ms"] = 1000 * statistics.fmean(xs)
        for p in (50, 90, 99):
            out[f"p{p}_{name}_ms"] = 1000 * xs[min(len(xs) - 1, int(p / 100 * len(xs)))]
    per_worker: dict[str, int] = {}
    for r in ok:
        for w in r.worker.split(","):
            per_worker[w] = per_worker.get(w, 0) + 1
    out["requests_per_worker"] = dict(sorted(per_worker.items()))
    mean = statistics.fmean(per_worker.values()) if per_worker else 0
    out["max_worker_share_over_mean"] = max(per_worker.values()) / mean if mean else 0.0
    out["errors"] = sorted({r.error for r in results if not r.ok})[:5]
    # in the dataset's order: [sent s, TTFT s, e2e s, cached prompt tokens, worker] (None
    # for a failed one), so a replay can be set beside the run request by request
    out["per_request"] = [[round(r.sent, 4), round(r.ttft, 4), round(r.e2e, 4), r.cached_tokens,
                           r.worker] if r.ok else None for r in results]
    return out


async def running_balance(url: str, stop: asyncio.Event, every_s: float = 0.25) -> list[float]:
    """Sample /fleet while the load runs: per snapshot with at least one running request per
    worker, the busiest worker's running requests over the mean across workers."""
    ratios = []
    async with httpx.AsyncClient(timeout=30) as client:
        while not stop.is_set():
            try:
                workers = (await client.get(f"{url}/fleet")).json()["workers"]
            except (httpx.HTTPError, ValueError, KeyError):
                workers = []
            running = [w.get("num_running", 0) for w in workers if w.get("state") == "ready"]
            # fewer running requests than workers leave someone idle whatever the router does
            if len(running) > 1 and sum(running) >= len(running):
                ratios.append(max(running) / statistics.fmean(running))
            try:
                await asyncio.wait_for(stop.wait(), every_s)
            except asyncio.TimeoutError:
                pass
    return ratios


async def run_sampled(url: str, model: str, reqs, ns):
    stop = asyncio.Event()
    sampler = asyncio.create_task(running_balance(url, stop))
    try:
        results, duration = await run_load(url, model, reqs, ns.max_concurrency,
                                           ns.request_rate, ns.seed)
    finally:
        stop.set()
    return results, duration, await sampler


def bench_url(url: str, reqs, ns) -> dict:
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    hits0, queries0 = prefix_counters(url)
    results, duration, balance = asyncio.run(run_sampled(url, model, reqs, ns))
    time.sleep(1.5)  # one controller poll + one router refresh: the counters catch up
    hits1, queries1 = prefix_counters(url)
    out = summarize(results, duration, hits1 - hits0, queries1 - queries0)
    balance.sort()
    out["p95_running_max_over_mean"] = (balance[min(len(balance) - 1, int(0.95 * len(balance)))]
                                        if balance else 0.0)
    return out


def mode_flags(mode: str, ns, prefix_blocks: int) -> list[str]:
    """`mode` is a routing policy, optionally with its own load factor: `cache_aware:2` runs
    --routing cache_aware --route-load-factor 2 (else --route-load-factor's value)."""
    mode, _, factor = mode.partition(":")
    common = ["--max-model-len", str(ns.max_model_len),
              "--route-prefix-blocks", str(prefix_blocks),
              "--route-load-factor", factor or str(ns.route_load_factor)]
    if mode == "hash_sweep":
        mode = "hash"
    if mode == "single":  # one worker with the fleet's whole budget and CPUs
        return ["--workers", "1", "--kv-context-len", str(2 * ns.kv_tokens), *common]
    return ["--workers", "2", "--routing", mode, "--kv-context-len", str(ns.kv_tokens), *common]


# -- main ------------------------------------------------------------------------------------
COLUMNS = ["dataset", "mode", "load", "prefix_blocks", "requests", "failed", "request_throughput",
           "output_throughput", "mean_ttft_ms", "p50_ttft_ms", "p90_ttft_ms", "p99_ttft_ms",
           "mean_tpot_ms", "mean_itl_ms", "p99_itl_ms", "mean_e2e_ms", "p99_e2e_ms",
           "prefix_hit_rate", "max_worker_share_over_mean", "p95_running_max_over_mean"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="benchmark this server instead of launching raypaged serve")
    p.add_argument("--modes", default="hash,cache_aware,round_robin,single")
    p.add_argument("--sweep-prefix-blocks", default="",
                   help="comma list: run the hash mode once per --route-prefix-blocks value")
    p.add_argument("--route-prefix-blocks", type=int, default=4)
    p.add_argument("--route-load-factor", type=float, default=1.25)
    p.add_argument("--dataset", default="prefix_repetition",
                   help=f"one or a comma list of {', '.join(DATASETS)}: each is run in turn, "
                        "with its own saturation when --loads is given")
    p.add_argument("--turns", type=int, default=4, help="multi_turn: turns per conversation")
    p.add_argument("--num-prompts", type=int, default=96)
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--request-rate", type=float, default=1.0,
                   help="Poisson arrivals per second (inf: all at once, up to max-concurrency)")
    p.add_argument("--loads", default="",
                   help="comma list of fractions of saturation (e.g. 0.5,0.8): first measure "
                        "the fleet's saturation (round robin, all at once), then run every mode "
                        "at each fraction of it instead of --request-rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--input-len", type=int, nargs=2, default=(64, 512), help="random dataset")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--num-prefixes", type=int, default=16)
    p.add_argument("--prefix-len", type=int, default=368)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--common-prefix-len", type=int, default=32)
    p.add_argument("--kv-tokens", type=int, default=4096,
                   help="KV cache per worker in tokens, when launching (the single worker gets "
                        "twice this): less than all the prefixes, so where they go matters")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--name", default="serve_bench", help="results file name")
    return p.parse_args(argv)


def main(argv=None) -> int:
    ns = parse_args(argv)
    datasets = [d for d in ns.dataset.split(",") if d]
    for name in datasets:
        if name not in DATASETS:
            raise SystemExit(f"unknown dataset {name!r}; choices: {', '.join(DATASETS)}")
    runs = []
    for dataset in datasets:
        runs += run_dataset(argparse.Namespace(**{**vars(ns), "dataset": dataset}))
    print()
    print(table(runs, COLUMNS))
    summary = {"checks": {}, "lines": []}
    for dataset, load in dict.fromkeys((r["dataset"], r.get("load")) for r in runs):
        part = targets([r for r in runs if r["dataset"] == dataset and r.get("load") == load])
        tag = (f"{dataset}, " if len(datasets) > 1 else "") + ("" if load is None
                                                                 else f"load {load}: ")
        summary["checks"].update({f"{tag}{k}": v for k, v in part["checks"].items()})
        summary["lines"] += [tag + line for line in part["lines"]]
    for line in summary["lines"]:
        print(line)
    workload = {k: v for k, v in vars(ns).items() if k not in ("url", "name")}
    workload["request_rate"] = str(ns.request_rate)
    path = write(ns.name, {"workload": workload, "runs": runs, "targets": summary["checks"]})
    plot(runs, plot_path(ns.name))
    print(f"wrote {path} and {plot_path(ns.name)}")
    return 0


def run_dataset(ns) -> list[dict]:
    """Every mode on one dataset, at --request-rate or at each of --loads."""
    reqs = make_dataset(ns)
    tag = {"dataset": ns.dataset}
    if ns.url:
        return [{"mode": "url", **tag, **bench_url(ns.url, reqs, ns)}]
    plan = [(m, ns.route_prefix_blocks) for m in ns.modes.split(",") if m]
    plan += [("hash_sweep", int(b)) for b in ns.sweep_prefix_blocks.split(",") if b]
    rates = [(None, ns.request_rate)]
    runs = []
    if ns.loads:
        saturated = launch_and_bench("round_robin", ns.route_prefix_blocks, reqs,
                                     argparse.Namespace(**{**vars(ns), "request_rate":
                                                           float("inf")}))
        saturation = saturated["request_throughput"]
        runs.append({"mode": "saturation", **tag, "load": 1.0, "request_rate": None,
                     **saturated})
        print(f"-- {ns.dataset}: saturation {saturation:.3f} requests/s", flush=True)
        rates = [(float(f), float(f) * saturation) for f in ns.loads.split(",")]
    for load, rate in rates:
        for mode, blocks in plan:
            run_ns = argparse.Namespace(**{**vars(ns), "request_rate": rate})
            runs.append({"mode": mode, **tag, "prefix_blocks": blocks, "load": load,
                         "request_rate": rate, **launch_and_bench(mode, blocks, reqs, run_ns)})
            print(table(runs[-1:], COLUMNS), flush=True)
    return runs


def launch_and_bench(mode: str, blocks: int, reqs, ns) -> dict:
    log = Path(tempfile.gettempdir()) / f"{ns.name}_{mode}_{blocks}.log"
    print(f"-- {mode} (route-prefix-blocks {blocks}, {ns.request_rate} req/s): launching "
          "raypaged serve", flush=True)
    proc, url = launch(mode_flags(mode, ns, blocks), log)
    try:
        return bench_url(url, reqs, ns)
    finally:
        stop(proc)


def targets(runs: list[dict]) -> dict:
    """The routing issue's targets, for every policy run beside round robin / one worker."""
    by = {r["mode"]: r for r in runs}
    checks, lines = {}, []

    def verdict(ok: bool) -> str:
        return "met" if ok else "MISSED"

    for policy in by:
        if policy.partition(":")[0] not in ("hash", "cache_aware"):
            continue
        mine = by[policy]
        if "single" in by and by["single"]["prefix_hit_rate"]:
            ratio = mine["prefix_hit_rate"] / by["single"]["prefix_hit_rate"]
            checks[f"{policy}_hit_rate_vs_single"] = ratio
            lines.append(f"hit rate, {policy} / single worker: {ratio:.2f} "
                         f"(target >= 0.95: {verdict(ratio >= 0.95)})")
        if "round_robin" in by and mine["mean_ttft_ms"] and mine["mean_e2e_ms"]:
            rr = by["round_robin"]
            for key, target in (("mean_ttft_ms", 2.0), ("mean_e2e_ms", 1.2), ("p99_ttft_ms", 1.0)):
                ratio = rr[key] / mine[key]
                checks[f"{policy}_{key}_round_robin_over"] = ratio
                lines.append(f"{key}, round robin / {policy}: {ratio:.2f}x "
                             f"(target >= {target}: {verdict(ratio >= target)})")
            ratio = mine["output_throughput"] / rr["output_throughput"]
            checks[f"{policy}_throughput_over_round_robin"] = ratio
            lines.append(f"output throughput, {policy} / round robin: {ratio:.2f}x "
                         f"(target >= 1.0: {verdict(ratio >= 0.995)})")
        balance = mine["p95_running_max_over_mean"]
        checks[f"{policy}_p95_running_max_over_mean"] = balance
        lines.append(f"running requests, busiest worker / mean, p95 of snapshots, {policy}: "
                     f"{balance:.2f} (target <= 1.5: {verdict(balance <= 1.5)}); requests per "
                     f"worker: {mine['requests_per_worker']}")
    return {"checks": checks, "lines": lines}


def plot(runs: list[dict], path: Path) -> None:
    """One row per (dataset, load), one panel per figure, one bar per mode."""
    plt = pyplot()
    if plt is None:
        return
    runs = [r for r in runs if r["mode"] != "saturation"]
    groups = list(dict.fromkeys((r["dataset"], r.get("load")) for r in runs))
    panels = [("mean_ttft_ms", "mean TTFT (ms)"), ("p99_ttft_ms", "p99 TTFT (ms)"),
              ("mean_e2e_ms", "mean e2e (ms)"), ("prefix_hit_rate", "prefix-cache hit rate"),
              ("output_throughput", "output tokens/s")]
    fig, axes = plt.subplots(len(groups), len(panels), figsize=(3.4 * len(panels),
                                                                2.6 * len(groups)),
                             squeeze=False)
    for row, (dataset, load) in enumerate(groups):
        mine = [r for r in runs if (r["dataset"], r.get("load")) == (dataset, load)]
        labels = [r["mode"] + (f" {r['prefix_blocks']}" if r["mode"] == "hash_sweep" else "")
                  for r in mine]
        for col, (key, title) in enumerate(panels):
            ax = axes[row][col]
            ax.bar(labels, [r[key] for r in mine], color="#4c72b0")
            ax.set_title(f"{dataset}" + (f", load {load}" if load else "") + f"\n{title}",
                         fontsize=8)
            ax.tick_params(axis="x", labelsize=7, rotation=30)
    fig.suptitle("raypaged serve: routing policies side by side (one run)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
