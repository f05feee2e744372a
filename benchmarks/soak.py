"""Soak: does a `raypaged serve` fleet's memory stay flat under steady load, and come back idle?

Launches `raypaged serve` (by default the issue's setup: 2 workers, 1 CPU each, 256 MiB KV,
max_model_len 2048), sends a steady Poisson stream of mixed requests for --minutes, then idles
for --idle-seconds. Requests: prompt 16-400 tokens (token ids), 4-64 output tokens, half
streamed, one in five with n = 2 or 3, one in ten of the streamed ones disconnected by the client
after a few chunks. Every --sample-every seconds: RSS of each worker (pids from /fleet) and of
the router replica (its Ray process), KV usage, running and waiting per worker.

Targets (issue 18), after --warmup-minutes: worker RSS at the end within 10% of RSS at the end
of warm-up, no monotonic growth over the last half, 0 failed requests; after the idle period,
running = waiting = 0 and 0 KV blocks used.

    python benchmarks/soak.py [--minutes 15] [--rate 0.7] [--serve-flags "--onednn-cache-capacity 1024"]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from benchmarks.memory_probe import rss_bytes  # noqa: E402
from benchmarks.report import plot_path, pyplot, table, write  # noqa: E402
from benchmarks.serve_datasets import VOCAB  # noqa: E402
from benchmarks.serve_process import descendants, launch, stop  # noqa: E402

MAX_IN_FLIGHT = 64  # a bound on the client's own tasks if the server falls behind


# -- the load ----------------------------------------------------------------------------------
def request_body(rng: random.Random, model: str) -> tuple[dict, int | None]:
    """One request's body, and after how many chunks the client hangs up (None: never)."""
    body = {"model": model, "prompt": [rng.randrange(*VOCAB) for _ in range(rng.randint(16, 400))],
            "max_tokens": rng.randint(4, 64), "temperature": rng.choice((0.0, 0.8)),
            "seed": rng.randrange(10_000), "stream": rng.random() < 0.5}
    if rng.random() < 0.2:
        body["n"] = rng.choice((2, 3))
    hang_up = rng.randint(1, 4) if body["stream"] and rng.random() < 0.1 else None
    return body, hang_up


async def one_request(client: httpx.AsyncClient, url: str, body: dict, hang_up: int | None,
                      counts: dict) -> None:
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                counts["failed"] += 1
                counts["errors"].add(f"{r.status_code} {(await r.aread())[:160]!r}")
                return
            chunks = 0
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"error"' in line[:20]:
                    counts["failed"] += 1
                    counts["errors"].add(line[:200])
                    return
                chunks += line.startswith("data: ")
                if hang_up is not None and chunks >= hang_up:
                    counts["disconnected"] += 1
                    return  # leaving the block closes the connection mid-stream
        counts["ok"] += 1
    except httpx.HTTPError as exc:
        counts["failed"] += 1
        counts["errors"].add(repr(exc)[:200])


async def load(url: str, model: str, seconds: float, rate: float, seed: int, counts: dict) -> None:
    rng = random.Random(seed)
    sem = asyncio.Semaphore(MAX_IN_FLIGHT)
    limits = httpx.Limits(max_connections=MAX_IN_FLIGHT, max_keepalive_connections=MAX_IN_FLIGHT)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def run(body, hang_up):
            async with sem:
                await one_request(client, url, body, hang_up, counts)

        tasks, end = [], time.monotonic() + seconds
        while time.monotonic() < end:
            tasks.append(asyncio.create_task(run(*request_body(rng, model))))
            counts["sent"] += 1
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)


# -- what is sampled ---------------------------------------------------------------------------
def router_pids(serve_pid: int) -> list[int]:
    """The router replicas: Ray processes under our `raypaged serve` titled ServeReplica...Router."""
    pids = []
    for pid in descendants(serve_pid):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "ServeReplica" in cmd and "OpenAIRouter" in cmd:
            pids.append(pid)
    return pids


def tcmalloc_loaded(pid: int) -> bool | None:
    try:
        return "libtcmalloc" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return None


def sample(url: str, serve_pid: int, t0: float, phase: str) -> dict:
    fleet = httpx.get(f"{url}/fleet", timeout=30).json()
    row = {"t_s": round(time.monotonic() - t0, 1), "phase": phase, "workers": {}}
    for w in fleet["workers"]:
        if "pid" not in w:
            continue
        try:
            rss = rss_bytes(w["pid"]) / 2**20
        except (OSError, RuntimeError):
            rss = None  # a worker on another node, or gone
        row["workers"][w["worker_id"]] = {
            "rss_mib": rss, "tcmalloc": tcmalloc_loaded(w["pid"]), "kv_cache_usage": w["kv_cache_usage"],
            "blocks_used": w["memory"]["blocks_used"], "running": w["num_running"],
            "waiting": w["num_waiting"], "restarts": w["restarts"]}
    row["router_rss_mib"] = sum(rss_bytes(p) for p in router_pids(serve_pid)) / 2**20
    return row


async def sampler(url: str, serve_pid: int, t0: float, every: float, phase: list, rows: list,
                  done: asyncio.Event) -> None:
    while True:
        rows.append(await asyncio.to_thread(sample, url, serve_pid, t0, phase[0]))
        print(json.dumps(rows[-1]), flush=True)
        try:
            await asyncio.wait_for(done.wait(), every)
            return
        except asyncio.TimeoutError:
            pass


async def soak(url: str, serve_pid: int, ns) -> tuple[dict, list[dict]]:
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    counts = {"sent": 0, "ok": 0, "failed": 0, "disconnected": 0, "errors": set()}
    rows: list[dict] = []
    phase, done, t0 = ["load"], asyncio.Event(), time.monotonic()
    sampling = asyncio.create_task(sampler(url, serve_pid, t0, ns.sample_every, phase, rows, done))
    await load(url, model, ns.minutes * 60, ns.rate, ns.seed, counts)
    rows.append(await asyncio.to_thread(sample, url, serve_pid, t0, "end of load"))
    phase[0] = "idle"
    await asyncio.sleep(ns.idle_seconds)
    done.set()
    await sampling
    rows.append(await asyncio.to_thread(sample, url, serve_pid, t0, "after idle"))
    counts["errors"] = sorted(counts["errors"])[:5]
    return counts, rows


# -- the verdict -------------------------------------------------------------------------------
def summarize(counts: dict, rows: list[dict], warmup_s: float) -> tuple[list[dict], list[str]]:
    load_rows = [r for r in rows if r["phase"] in ("load", "end of load")]
    end = next(r for r in rows if r["phase"] == "end of load")
    idle = rows[-1]
    warm = next((r for r in load_rows if r["t_s"] >= warmup_s), load_rows[0])
    table_rows, lines = [], []
    for wid in sorted(end["workers"]):
        series = [r["workers"][wid]["rss_mib"] for r in load_rows if wid in r["workers"]]
        after_warm = [r["workers"][wid]["rss_mib"] for r in load_rows
                      if r["t_s"] >= warm["t_s"] and wid in r["workers"]]
        last_half = series[len(series) // 2:]
        w_end, w_warm = end["workers"][wid]["rss_mib"], warm["workers"][wid]["rss_mib"]
        growth = w_end / w_warm - 1
        monotonic = len(last_half) > 2 and all(b > a for a, b in zip(last_half, last_half[1:]))
        table_rows.append({"process": wid, "start_mib": series[0], "after_warmup_mib": w_warm,
                           "peak_mib": max(after_warm), "end_mib": w_end,
                           "after_idle_mib": idle["workers"][wid]["rss_mib"],
                           "end_vs_warmup": f"{growth:+.1%}",
                           "last_half_monotonic": monotonic})
        lines.append(f"{wid}: RSS end vs after warm-up {growth:+.1%} (target within ±10%: "
                     f"{'met' if abs(growth) <= 0.10 else 'MISSED'}); last half monotonic: "
                     f"{monotonic} ({'MISSED' if monotonic else 'met'})")
        s = idle["workers"][wid]
        clean = s["running"] == s["waiting"] == s["blocks_used"] == 0
        lines.append(f"{wid} after idle: running {s['running']}, waiting {s['waiting']}, "
                     f"KV blocks used {s['blocks_used']} ({'met' if clean else 'MISSED'})")
    router = [r["router_rss_mib"] for r in load_rows]
    table_rows.append({"process": "router", "start_mib": router[0],
                       "after_warmup_mib": warm["router_rss_mib"], "peak_mib": max(router),
                       "end_mib": end["router_rss_mib"], "after_idle_mib": idle["router_rss_mib"],
                       "end_vs_warmup": f"{end['router_rss_mib'] / warm['router_rss_mib'] - 1:+.1%}",
                       "last_half_monotonic": None})
    lines.insert(0, f"requests sent {counts['sent']}, completed {counts['ok']}, client "
                    f"disconnects {counts['disconnected']}, failed {counts['failed']} (target 0: "
                    f"{'met' if counts['failed'] == 0 else 'MISSED'})")
    return table_rows, lines


def plot(rows: list[dict], warmup_s: float, path: Path, title: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(8, 4.5))
    t = [r["t_s"] / 60 for r in rows]
    for wid in sorted(rows[-1]["workers"]):
        ax.plot(t, [r["workers"].get(wid, {}).get("rss_mib") for r in rows], marker=".", label=wid)
    ax.plot(t, [r["router_rss_mib"] for r in rows], marker=".", label="router")
    ax.axvspan(0, warmup_s / 60, color="0.9", label="warm-up")
    idle_from = next(r["t_s"] for r in rows if r["phase"] == "end of load") / 60
    ax.axvspan(idle_from, t[-1], color="#dde8f5", label="idle")
    ax.set_xlabel("minutes")
    ax.set_ylabel("RSS (MiB)")
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=15.0, help="of load (default: %(default)s)")
    p.add_argument("--warmup-minutes", type=float, default=3.0)
    p.add_argument("--idle-seconds", type=float, default=60.0)
    p.add_argument("--sample-every", type=float, default=30.0, help="seconds")
    p.add_argument("--rate", type=float, default=0.7, help="Poisson arrivals per second")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--serve-flags", default="--workers 2 --cpus-per-worker 1 --kv-memory-mb 256 "
                                            "--max-model-len 2048",
                   help="flags for raypaged serve (default: %(default)s)")
    p.add_argument("--extra-flags", default="", help="appended to --serve-flags, e.g. "
                                                     "'--onednn-cache-capacity 1024'")
    p.add_argument("--name", default="soak", help="results file name")
    ns = p.parse_args(argv)
    flags = shlex.split(ns.serve_flags) + shlex.split(ns.extra_flags)
    # Our own Ray session folder: a `raypaged serve` that starts a local cluster would otherwise
    # join one that another user on this machine started (and refuse, since it sets num_cpus).
    os.environ.setdefault("RAY_TMPDIR", tempfile.mkdtemp(prefix="raypaged-soak-ray-"))
    log = Path(tempfile.gettempdir()) / f"{ns.name}_serve.log"
    print(f"launching raypaged serve {' '.join(flags)} (log: {log})", flush=True)
    proc, url = launch(flags, log)
    try:
        counts, rows = asyncio.run(soak(url, proc.pid, ns))
    finally:
        stop(proc)
    table_rows, lines = summarize(counts, rows, ns.warmup_minutes * 60)
    print()
    print(table(table_rows, list(table_rows[0])))
    for line in lines:
        print(line)
    path = write(ns.name, {"args": vars(ns), "serve_flags": flags, "counts": counts,
                           "table": table_rows, "verdict": lines, "samples": rows})
    title = (f"raypaged serve {' '.join(flags)}\n{ns.minutes:g} min Poisson {ns.rate:g} req/s, "
             f"then {ns.idle_seconds:g} s idle")
    plot(rows, ns.warmup_minutes * 60, plot_path(ns.name), title)
    print(f"wrote {path} and {plot_path(ns.name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
