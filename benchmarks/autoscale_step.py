"""Autoscaling under a load step: `raypaged serve --min-workers 1 --max-workers 2` at ~0.3 of one
worker's saturation, then ~1.2, then ~0.3 again (Poisson arrivals, streaming requests).

Three servers, one after the other, on the same workload (random-token prompts):
  1. a fixed 1-worker fleet, closed loop at --concurrency: one worker's saturation (req/s)
  2. a fixed 2-worker fleet at the high load: the p90 TTFT the autoscaled fleet is held to
  3. the autoscaled fleet through low -> high -> low, /fleet polled every second

Reported against the targets (issue 27): the second worker serving within its cold start + 15 s
of the step up; p90 TTFT over the high phase's last minute within 1.5x the fixed 2-worker
fleet's; back to one worker within --scale-in-cooldown-s of the step down; no failed request.

    python benchmarks/autoscale_step.py [--low 0.3 --high 1.2 --low-s 60 --high-s 150 --tail-s 150]
"""
from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from benchmarks.report import plot_path, pyplot, table, write  # noqa: E402
from benchmarks.serve_bench import one_request  # noqa: E402
from benchmarks.serve_process import launch, stop  # noqa: E402

COMMON = ["--num-cpus", "2", "--cpus-per-worker", "1", "--max-model-len", "1024",
          "--kv-memory-mb", "96"]


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 20000) for _ in range(length)] for _ in range(n)]


async def closed_loop(url: str, model: str, ns, seconds: float) -> float:
    """Requests per second one fleet sustains with --concurrency clients, each sending its
    next request when the last ends."""
    done, stop_at, k = [], time.monotonic() + seconds, iter(range(1 << 30))
    pool = prompts(256, ns.prompt_len, ns.seed + 1)
    async with httpx.AsyncClient(timeout=600) as client:
        async def lane():
            while time.monotonic() < stop_at:
                done.append(await one_request(client, url, model, pool[next(k) % 256],
                                              ns.output_len))
        start = time.monotonic()
        await asyncio.gather(*(lane() for _ in range(ns.concurrency)))
        took = time.monotonic() - start
    ok = [r for r in done if r.ok]
    return len(ok) / took


async def phases(url: str, model: str, ns, plan: list[tuple[str, float, float]],
                 watch: bool) -> tuple[list[dict], list[dict]]:
    """Open-loop Poisson arrivals, phase by phase [(name, rate, seconds)]; with `watch`, /fleet
    every second. Returns (requests, fleet timeline), times in seconds from the start."""
    rng = random.Random(ns.seed)
    pool = prompts(512, ns.prompt_len, ns.seed)
    records, timeline, tasks = [], [], []
    t0 = time.monotonic()
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=2000)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def send(k: int, phase: str):
            arrival = time.monotonic() - t0
            r = await one_request(client, url, model, pool[k % len(pool)], ns.output_len)
            records.append({"arrival_s": arrival, "phase": phase, "ok": r.ok, "ttft_s": r.ttft,
                            "e2e_s": r.e2e, "worker": r.worker, "error": r.error})

        async def poll():
            while True:
                try:
                    s = (await client.get(f"{url}/fleet", timeout=5)).json().get("scaling", {})
                    timeline.append({"t": time.monotonic() - t0, **{
                        k: s.get(k) for k in ("desired", "serving", "starting", "draining",
                                              "predicted_wait_s")},
                        "cold_start_last_s": s.get("cold_starts", {}).get("last_s"),
                        "drains": s.get("drains"), "decisions": s.get("decisions")})
                except (httpx.HTTPError, ValueError):
                    pass
                await asyncio.sleep(1.0)

        poller = asyncio.create_task(poll()) if watch else None
        k = 0
        for name, rate, seconds in plan:
            end = time.monotonic() + seconds
            while True:
                await asyncio.sleep(rng.expovariate(rate))
                if time.monotonic() >= end:
                    break
                tasks.append(asyncio.create_task(send(k, name)))
                k += 1
        await asyncio.gather(*tasks)
        if poller is not None:
            poller.cancel()
    return records, timeline


def p90(xs: list[float]) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    return xs[int(0.9 * (len(xs) - 1))] if xs else None


def serve(flags: list[str], name: str):
    log = Path(tempfile.gettempdir()) / f"autoscale_step_{name}.log"
    print(f"-- {name}: raypaged serve {' '.join(flags)}", flush=True)
    proc, url = launch(flags, log)
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    return proc, url, model


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--low", type=float, default=0.3, help="load before and after, x saturation")
    p.add_argument("--high", type=float, default=1.2, help="load of the step, x saturation")
    p.add_argument("--low-s", type=float, default=60.0)
    p.add_argument("--high-s", type=float, default=150.0)
    p.add_argument("--tail-s", type=float, default=150.0, help="the low phase after the step")
    p.add_argument("--prompt-len", type=int, default=192)
    p.add_argument("--output-len", type=int, default=24)
    p.add_argument("--concurrency", type=int, default=6, help="closed loop for saturation")
    p.add_argument("--saturation-s", type=float, default=45.0)
    p.add_argument("--saturation", type=float, help="req/s of one worker (skip measuring it)")
    p.add_argument("--scale-target-wait-s", type=float, default=2.0)
    p.add_argument("--scale-window-s", type=float, default=30.0)
    p.add_argument("--scale-in-cooldown-s", type=float, default=60.0)
    p.add_argument("--scale-out-cooldown-s", type=float, default=10.0)
    p.add_argument("--drain-timeout-s", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None) -> int:
    ns = parse_args(argv)
    saturation = ns.saturation
    if saturation is None:
        proc, url, model = serve(["--workers", "1", *COMMON], "fixed1")
        try:
            saturation = asyncio.run(closed_loop(url, model, ns, ns.saturation_s))
        finally:
            stop(proc)
    print(f"one worker's saturation: {saturation:.3f} req/s", flush=True)
    low, high = ns.low * saturation, ns.high * saturation

    proc, url, model = serve(["--workers", "2", *COMMON], "fixed2")
    try:
        fixed, _ = asyncio.run(phases(url, model, ns, [("high", high, ns.high_s)], watch=False))
    finally:
        stop(proc)
    last_min = lambda recs, end: [r for r in recs if r["phase"] == "high"  # noqa: E731
                                  and r["arrival_s"] >= end - 60 and r["ok"]]
    fixed_p90 = p90([r["ttft_s"] for r in last_min(fixed, ns.high_s)])

    scaling = ["--min-workers", "1", "--max-workers", "2",
               "--scale-target-wait-s", str(ns.scale_target_wait_s),
               "--scale-window-s", str(ns.scale_window_s),
               "--scale-in-cooldown-s", str(ns.scale_in_cooldown_s),
               "--scale-out-cooldown-s", str(ns.scale_out_cooldown_s),
               "--drain-timeout-s", str(ns.drain_timeout_s)]
    proc, url, model = serve([*scaling, *COMMON], "autoscaled")
    try:
        plan = [("low", low, ns.low_s), ("high", high, ns.high_s), ("tail", low, ns.tail_s)]
        records, timeline = asyncio.run(phases(url, model, ns, plan, watch=True))
    finally:
        stop(proc)

    up_at, down_at = ns.low_s, ns.low_s + ns.high_s
    two = next((p["t"] for p in timeline if p["t"] >= up_at and p["serving"] == 2), None)
    # back to one: the first poll after the last one with more than one worker allocated
    many = [i for i, p in enumerate(timeline)
            if (p["serving"] or 0) + (p["starting"] or 0) + (p["draining"] or 0) > 1]
    one = (timeline[many[-1] + 1]["t"] if many and many[-1] + 1 < len(timeline) else None)
    cold = next((p["cold_start_last_s"] for p in reversed(timeline)
                 if p["cold_start_last_s"] is not None), None)
    auto_p90 = p90([r["ttft_s"] for r in last_min(records, up_at + ns.high_s)
                    if r["arrival_s"] < down_at])
    failed = [r for r in records + fixed if not r["ok"]]
    last = timeline[-1] if timeline else {}
    summary = {
        "saturation_req_s": saturation, "low_req_s": low, "high_req_s": high,
        "requests": len(records), "fixed2_requests": len(fixed), "failed": len(failed),
        "failed_errors": sorted({r["error"][:160] for r in failed})[:5],
        "second_worker_serving_after_step_s": None if two is None else two - up_at,
        "cold_start_s": cold,
        "target_second_worker_s": None if cold is None else cold + 15,
        "p90_ttft_last_min_high_s": auto_p90, "fixed2_p90_ttft_last_min_high_s": fixed_p90,
        "p90_ttft_ratio": auto_p90 / fixed_p90 if auto_p90 and fixed_p90 else None,
        "back_to_one_after_step_down_s": None if one is None else one - down_at,
        "scale_in_cooldown_s": ns.scale_in_cooldown_s,
        "decisions": last.get("decisions"), "drains": last.get("drains"),
    }
    summary["met"] = {
        "second_worker_within_cold_start_plus_15s": bool(
            two is not None and cold is not None and two - up_at <= cold + 15),
        "p90_ttft_within_1.5x_fixed2": bool(summary["p90_ttft_ratio"] is not None
                                            and summary["p90_ttft_ratio"] <= 1.5),
        "back_to_one_within_cooldown": bool(one is not None
                                            and one - down_at <= ns.scale_in_cooldown_s),
        "no_failed_request": not failed}
    rows = [{"figure": k, "value": v} for k, v in summary.items()
            if k not in ("decisions", "drains", "failed_errors", "met")]
    rows += [{"figure": f"target: {k}", "value": "met" if v else "MISSED"}
             for k, v in summary["met"].items()]
    print(table(rows, ["figure", "value"]))
    path = write("autoscale_step", {"args": vars(ns), "summary": summary, "timeline": timeline,
                                    "requests": records, "fixed2_requests": fixed}, indent=None)
    print(f"wrote {path}")
    plot(records, timeline, summary, ns)
    return 0


def plot(records, timeline, summary, ns) -> None:
    plt = pyplot()
    if plt is None or not timeline:
        return
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    t = [p["t"] for p in timeline]
    ax1.step(t, [p["desired"] for p in timeline], where="post", label="desired")
    ax1.step(t, [p["serving"] for p in timeline], where="post", label="serving")
    ax1.set_ylabel("workers")
    ax1.set_ylim(0, 2.5)
    for x in (ns.low_s, ns.low_s + ns.high_s):
        ax1.axvline(x, color="grey", ls=":")
        ax2.axvline(x, color="grey", ls=":")
    ax1.legend()
    ok = [r for r in records if r["ok"]]
    ax2.scatter([r["arrival_s"] for r in ok], [r["ttft_s"] for r in ok], s=4, label="TTFT")
    if summary["fixed2_p90_ttft_last_min_high_s"]:
        ax2.axhline(summary["fixed2_p90_ttft_last_min_high_s"], color="red", ls="--",
                    label="fixed 2-worker p90 (last min of high)")
    ax2.set_ylabel("TTFT (s)")
    ax2.set_xlabel("seconds")
    ax2.legend()
    fig.suptitle(f"load {ns.low:g} -> {ns.high:g} -> {ns.low:g} x one worker's saturation "
                 f"({summary['saturation_req_s']:.2f} req/s)")
    fig.tight_layout()
    fig.savefig(plot_path("autoscale_step"), dpi=110)
    print(f"wrote {plot_path('autoscale_step')}")


if __name__ == "__main__":
    sys.exit(main())
