"""Served goodput under overload: the scheduling rules at 1.5x and 3x the server's saturation.

Launches `raypaged serve` (one worker, a small KV budget so that memory, not compute, limits
the running set) once per rule set, and on each:
  1. saturation: the workload closed-loop at --concurrency (each client sends its next request
     when the last ends): the request rate the server sustains, and the goodput there;
  2. each --loads factor: the same number of requests, Poisson at factor x that rate.

Goodput = output tokens per second of the requests that finish within the SLO (TTFT <=
--ttft-slo-s and TPOT <= --tpot-slo-ms). Requests the edge refuses (503 + Retry-After, the
worker's queue of requests waiting for KV space is full: --max-queued-requests) are counted
as refused, not failed; failed = any other error. Preemptions and recomputed tokens come from
/metrics (docs/scheduling.md).

    python benchmarks/serve_overload.py [--modes new,first_rules,new_reserve_0.5] [--loads 1.5,3]
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from benchmarks.report import plot_path, pyplot, table, write  # noqa: E402
from benchmarks.serve_bench import one_request, run_load  # noqa: E402
from benchmarks.serve_datasets import make_dataset  # noqa: E402
from benchmarks.serve_process import launch, stop  # noqa: E402

MODES = {"new": [], "first_rules": ["--admission-policy", "fits", "--preemption-policy", "newest"],
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


def goodput_row(results, duration: float, ns) -> dict:
    ok = [r for r in results if r.ok]
    refused = [r for r in results if not r.ok and r.error.startswith("503")]
    failed = [r for r in results if not r.ok and not r.error.startswith("503")]

    def in_slo(r) -> bool:
        tpot = (r.e2e - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
        return r.ttft <= ns.ttft_slo_s and tpot * 1000 <= ns.tpot_slo_ms

    good = [r for r in ok if in_slo(r)]
    ttfts = sorted(r.ttft for r in ok) or [0.0]
    return {"requests": len(results), "finished": len(ok), "in_slo": len(good),
            "refused": len(refused), "failed": len(failed), "duration_s": duration,
            "request_throughput": len(ok) / duration,
            "output_throughput": sum(r.output_tokens for r in ok) / duration,
            "goodput": sum(r.output_tokens for r in good) / duration,
            "p50_ttft_s": ttfts[len(ttfts) // 2], "p90_ttft_s": ttfts[int(0.9 * len(ttfts))],
            "errors": sorted({r.error[:120] for r in failed})[:3]}


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
                results.append(await one_request(client, url, model, prompt, out))

        start = time.perf_counter()
        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
        return results, time.perf_counter() - start


def bench_mode(mode: str, reqs, ns) -> list[dict]:
    flags = ["--workers", "1", "--max-model-len", str(ns.max_model_len), "--kv-context-len",
             str(ns.kv_tokens), "--max-queued-requests", str(ns.max_queued_requests),
             "--max-num-seqs", str(ns.max_num_seqs), *MODES[mode]]
    log = Path(tempfile.gettempdir()) / f"serve_overload_{mode}.log"
    print(f"-- {mode}: launching raypaged serve {' '.join(flags)}", flush=True)
    proc, url = launch(flags, log)
    rows = []
    try:
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        before = engine_counters(url)
        results, duration = asyncio.run(closed_loop(url, model, reqs, ns.concurrency))
        rows.append({"mode": mode, "load": "saturation", "offered_rate": None,
                     **goodput_row(results, duration, ns)})
        saturation = rows[-1]["request_throughput"]
        for load in [float(f) for f in ns.loads.split(",") if f]:
            time.sleep(1.5)  # one controller poll: the counters catch up
            rows[-1].update(delta(engine_counters(url), before))
            before = engine_counters(url)
            results, duration = asyncio.run(run_load(url, model, reqs, None, load * saturation,
                                                     ns.seed))
            rows.append({"mode": mode, "load": f"{load:g}x", "offered_rate": load * saturation,
                         **goodput_row(results, duration, ns)})
            print(table(rows[-1:], COLUMNS), flush=True)
        time.sleep(1.5)
        rows[-1].update(delta(engine_counters(url), before))
    finally:
        stop(proc)
    for r in rows:
        r["goodput_vs_saturation"] = r["goodput"] / rows[0]["goodput"] if rows[0]["goodput"] else 0.0
    return rows


def delta(after: dict, before: dict) -> dict:
    out = {k: after[k] - before[k] for k in COUNTERS}
    out["recompute_pct"] = (100 * out["recomputed_tokens"] / out["computed_tokens"]
                            if out["computed_tokens"] else 0.0)
    return out


COLUMNS = ["mode", "load", "offered_rate", "requests", "finished", "in_slo", "refused", "failed",
           "request_throughput", "output_throughput", "goodput", "goodput_vs_saturation",
           "p50_ttft_s", "p90_ttft_s", "num_preemptions", "recompute_pct"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", default=",".join(MODES), help=f"of {', '.join(MODES)}")
    p.add_argument("--loads", default="1.5,3", help="offered load, as factors of saturation")
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
    reqs = make_dataset(ns)
    rows = []
    for mode in [m for m in ns.modes.split(",") if m]:
        rows += bench_mode(mode, reqs, ns)
    print()
    print(table(rows, COLUMNS))
    checks = {}
    for r in rows:
        if r["load"] != "saturation":
            key = f"{r['mode']} at {r['load']}: goodput >= 0.9x saturation's, 0 failed"
            checks[key] = r["goodput_vs_saturation"] >= 0.9 and r["failed"] == 0
            print(f"target: {key}: {r['goodput_vs_saturation']:.2f}x, {r['failed']} failed "
                  f"({'met' if checks[key] else 'MISSED'})")
    path = write(ns.name, {"workload": vars(ns), "rows": rows, "targets": checks})
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for mode in dict.fromkeys(r["mode"] for r in rows):
            mine = [r for r in rows if r["mode"] == mode]
            ax.plot([r["load"] for r in mine], [r["goodput"] for r in mine], marker="o", label=mode)
        ax.set_ylabel("goodput (output tokens/s in SLO)")
        ax.set_xlabel("offered load")
        ax.legend()
        fig.tight_layout()
        fig.savefig(plot_path(ns.name), dpi=80)
    print(f"wrote {path} and {plot_path(ns.name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
