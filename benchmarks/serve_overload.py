"""Served goodput under overload: the scheduling rules at 1.5x and 3x the server's saturation.

Launches `raypaged serve` (one worker, a small KV budget so that memory, not compute, limits
the running set) once per rule set and round (rounds interleave the rule sets: on a shared
machine each round's rule sets see the same neighbours), and on each:
  1. saturation: the workload closed-loop at --concurrency (each client sends its next request
     when the last ends): the request rate the server sustains, and the goodput there;
  2. each --loads factor, for each --clients kind: the same requests, Poisson at factor x that
     rate. `retry` clients honour a refusal's Retry-After (wait what the server said, send
     again), so every request is served in the end and each load serves the same work as
     saturation; `shed` clients take a refusal as final.

Goodput = output tokens per second of the requests that finish within the SLO (TTFT <=
--ttft-slo-s and TPOT <= --tpot-slo-ms; TTFT of the attempt the server accepted: the wait
before it, told by Retry-After, is reported apart as `p90_wait_s`, first send -> first token).
Refusals (503 + Retry-After: the worker's queue of requests waiting for KV space is full,
--max-queued-requests; 429 + Retry-After: this benchmark's one address at the server's
--max-requests-per-client) are counted, never as failures; failed = any other error. A `shed` load
serves fewer requests than saturation, so the drain at its end (the last requests decoding in
a shrinking batch) weighs more in its goodput. Preemptions and recomputed tokens come from
/metrics (docs/scheduling.md).

    python benchmarks/serve_overload.py [--modes new,first_rules,new_reserve_0.5]
        [--loads 1.5,3] [--clients retry,shed] [--rounds 2]
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from benchmarks.report import plot_path, pyplot, table, write  # noqa: E402
from benchmarks.serve_bench import Result, one_request  # noqa: E402
from benchmarks.serve_datasets import make_dataset  # noqa: E402
from benchmarks.serve_process import launch, stop  # noqa: E402

# "ttft_shed": the router refuses a request predicted over --ttft-slo-s (docs/limits.md); "SLO"
# stands for this benchmark's own --ttft-slo-s, so shedding aims at the goodput it measures
MODES = {"new": [], "ttft_shed": ["--ttft-slo-s", "SLO"],
         "first_rules": ["--admission-policy", "fits", "--preemption-policy", "newest"],
         "new_reserve_0.5": ["--decode-reserve", "0.5"]}
COUNTERS = ("num_preemptions", "recomputed_tokens", "computed_tokens")


def engine_counters(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    out = dict.fromkeys(COUNTERS, 0.0)
    for fam in text_string_to_metric_families(text):
        name = fam.name.removeprefix("raypaged:")
        if name in out:
            out[name] += sum(s.value for s in fam.samples if s.name.endswith("_total"))
    return out


# statuses that refuse a request before any work, with a Retry-After (never a failure)
REFUSALS = ("503", "429")

def goodput_row(served: list[tuple[Result, int, float]], duration: float, ns) -> dict:
    """`served`: (the last attempt's result, attempts, seconds from the first send to it)."""
    results = [r for r, _, _ in served]
    ok = [r for r in results if r.ok]
    refused = [r for r in results if not r.ok and r.error.startswith(REFUSALS)]
    failed = [r for r in results if not r.ok and not r.error.startswith(REFUSALS)]

    def in_slo(r) -> bool:
        tpot = (r.e2e - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
        return r.ttft <= ns.ttft_slo_s and tpot * 1000 <= ns.tpot_slo_ms

    good = [r for r in ok if in_slo(r)]
    ttfts = sorted(r.ttft for r in ok) or [0.0]
    waits = sorted(backoff + r.ttft for r, _, backoff in served if r.ok) or [0.0]
    return {"requests": len(results), "finished": len(ok), "in_slo": len(good),
            "refused": len(refused), "refusals": sum(a - 1 for _, a, _ in served) + len(refused),
            "failed": len(failed), "duration_s": duration,
            "request_throughput": len(ok) / duration,
            "output_throughput": sum(r.output_tokens for r in ok) / duration,
            "goodput": sum(r.output_tokens for r in good) / duration,
            "p50_ttft_s": ttfts[len(ttfts) // 2], "p90_ttft_s": ttfts[int(0.9 * len(ttfts))],
            "p99_ttft_s": ttfts[min(int(0.99 * len(ttfts)), len(ttfts) - 1)],
            "p90_wait_s": waits[int(0.9 * len(waits))],
            "errors": sorted({r.error[:120] for r in failed})[:3]}


async def request(client, url, model, prompt, out, retry: bool) -> tuple[Result, int, float]:
    """One request; a `retry` client answered 503 or 429 + Retry-After waits that long and sends
    again."""
    first, attempts = time.perf_counter(), 0
    while True:
        attempts += 1
        sent = time.perf_counter()
        res = await one_request(client, url, model, prompt, out)
        if res.ok or not retry or not res.error.startswith(REFUSALS) or res.retry_after is None:
            return res, attempts, sent - first
        await asyncio.sleep(res.retry_after)


async def open_loop(url: str, model: str, reqs, rate: float, seed: int, retry: bool):
    """Poisson arrivals at `rate` requests/s."""
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await one_request(client, url, model, [7] * 8, 2)  # warm-up
        start, tasks = time.perf_counter(), []
        for prompt, out, _ in reqs:
            tasks.append(asyncio.create_task(request(client, url, model, prompt, out, retry)))
            await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


async def closed_loop(url: str, model: str, reqs, concurrency: int):
    """Each of `concurrency` clients sends its next request when its last one ends."""
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
    todo = list(reqs)
    results = []
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await one_request(client, url, model, [7] * 8, 2)  # warm-up

        async def client_loop():
            while todo:
                prompt, out, _ = todo.pop(0)
                results.append(await request(client, url, model, prompt, out, retry=True))

        start = time.perf_counter()
        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
        return results, time.perf_counter() - start


def bench_mode(mode: str, round_: int, reqs, ns) -> list[dict]:
    flags = ["--workers", "1", "--max-model-len", str(ns.max_model_len), "--kv-context-len",
             str(ns.kv_tokens), "--max-queued-requests", str(ns.max_queued_requests),
             "--max-num-seqs", str(ns.max_num_seqs),
             *(str(ns.ttft_slo_s) if f == "SLO" else f for f in MODES[mode])]
    log = Path(tempfile.gettempdir()) / f"serve_overload_{mode}.log"
    print(f"-- round {round_}, {mode}: launching raypaged serve {' '.join(flags)}", flush=True)
    proc, url = launch(flags, log)
    rows = []
    try:
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        before = engine_counters(url)
        base = reqs[:ns.num_prompts]
        results, duration = asyncio.run(closed_loop(url, model, base, ns.concurrency))
        rows.append({"round": round_, "mode": mode, "load": "saturation", "client": "closed",
                     "offered_rate": None, **goodput_row(results, duration, ns)})
        saturation = rows[-1]["request_throughput"]
        for client in [c for c in ns.clients.split(",") if c]:
            for load in [float(f) for f in ns.loads.split(",") if f]:
                time.sleep(1.5)  # one controller poll: the counters catch up
                rows[-1].update(delta(engine_counters(url), before))
                print(table(rows[-1:], COLUMNS), flush=True)
                before = engine_counters(url)
                # --scale-phases: offered for as long as saturation ran (load x its requests),
                # so a shed phase serves about as many requests and its ramp-up and drain weigh
                # as much as saturation's
                phase = reqs[:round(ns.num_prompts * load)] if ns.scale_phases else base
                results, duration = asyncio.run(open_loop(
                    url, model, phase, load * saturation, ns.seed, retry=client == "retry"))
                rows.append({"round": round_, "mode": mode, "load": f"{load:g}x",
                             "client": client, "offered_rate": load * saturation,
                             **goodput_row(results, duration, ns)})
        time.sleep(1.5)
        rows[-1].update(delta(engine_counters(url), before))
        print(table(rows[-1:], COLUMNS), flush=True)
    finally:
        stop(proc)
    for r in rows:
        r["goodput_vs_saturation"] = r["goodput"] / max(rows[0]["goodput"], 1e-9)
    return rows


def delta(after: dict, before: dict) -> dict:
    out = {k: after[k] - before[k] for k in COUNTERS}
    out["recompute_pct"] = (100 * out["recomputed_tokens"] / out["computed_tokens"]
                            if out["computed_tokens"] else 0.0)
    return out


COLUMNS = ["round", "mode", "load", "client", "offered_rate", "finished", "in_slo", "refused",
           "refusals", "failed", "output_throughput", "goodput", "goodput_vs_saturation",
           "p50_ttft_s", "p90_ttft_s", "p99_ttft_s", "p90_wait_s", "num_preemptions",
           "recompute_pct"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", default="new,first_rules,new_reserve_0.5",
                   help=f"of {', '.join(MODES)}")
    p.add_argument("--loads", default="1.5,3", help="offered load, as factors of saturation")
    p.add_argument("--clients", default="retry,shed",
                   help="retry: honour Retry-After and send again; shed: a refusal is final")
    p.add_argument("--rounds", type=int, default=1, help="rounds, each of every mode in turn")
    p.add_argument("--scale-phases", action="store_true",
                   help="a load phase offers load x --num-prompts requests (as long as saturation "
                   "ran) instead of --num-prompts")
    p.add_argument("--num-prompts", type=int, default=48, help="requests per load")
    p.add_argument("--concurrency", type=int, default=8,
                   help="saturation: closed-loop clients (more than the KV budget runs at once, "
                   "fewer than that plus --max-queued-requests: none refused)")
    p.add_argument("--input-len", type=int, nargs=2, default=(64, 384))
    p.add_argument("--output-len", type=int, default=96)
    p.add_argument("--kv-tokens", type=int, default=2048, help="the worker's KV budget (tokens)")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-queued-requests", type=int, default=4)
    p.add_argument("--ttft-slo-s", type=float, default=10.0)
    p.add_argument("--tpot-slo-ms", type=float, default=1000.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default="serve_overload")
    ns = p.parse_args(argv)
    ns.dataset = "random"
    return ns


def main(argv=None) -> int:
    ns = parse_args(argv)
    loads = [float(f) for f in ns.loads.split(",") if f]
    reqs = make_dataset(argparse.Namespace(**{**vars(ns), "num_prompts": max(
        [ns.num_prompts] + [round(ns.num_prompts * x) for x in loads if ns.scale_phases])}))
    modes = [m for m in ns.modes.split(",") if m]
    rows = []
    for round_ in range(ns.rounds):  # interleaved: every mode once per round
        for mode in modes:
            rows += bench_mode(mode, round_, reqs, ns)
    print()
    print(table(rows, COLUMNS))
    checks = {}
    for key in dict.fromkeys((r["mode"], r["load"], r["client"]) for r in rows
                             if r["load"] != "saturation"):
        mine = [r for r in rows if (r["mode"], r["load"], r["client"]) == key]
        ratios = [r["goodput_vs_saturation"] for r in mine]
        failed = sum(r["failed"] for r in mine)
        met = sum(x >= 0.9 for x in ratios)
        name = f"{key[0]} at {key[1]} ({key[2]} clients): goodput >= 0.9x saturation's, 0 failed"
        checks[name] = {"ratios": ratios, "median": statistics.median(ratios), "failed": failed,
                        "rounds_met": met, "met": met == len(ratios) and failed == 0}
        verdict = "met" if checks[name]["met"] else f"MISSED in {len(ratios) - met} of {len(mine)}"
        print(f"target: {name}: {', '.join(f'{x:.2f}x' for x in ratios)} "
              f"(median {statistics.median(ratios):.2f}x), {failed} failed ({verdict})")
    path = write(ns.name, {"workload": vars(ns), "rows": rows, "targets": checks})
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(7, 3.8))
        for mode in modes:
            for client in [c for c in ns.clients.split(",") if c]:
                mine = [r for r in rows if r["mode"] == mode and r["client"] in ("closed", client)]
                loads = list(dict.fromkeys(r["load"] for r in mine))
                ax.plot(loads, [statistics.median(r["goodput"] for r in mine if r["load"] == x)
                                for x in loads], marker="o", label=f"{mode}, {client}")
        ax.set_ylabel("goodput (output tokens/s in SLO),\nmedian of rounds")
        ax.set_xlabel("offered load")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(plot_path(ns.name), dpi=80)
    print(f"wrote {path} and {plot_path(ns.name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
