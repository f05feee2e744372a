"""What a real 2-worker fleet spends on one request when nothing else runs: the simulator's
serving-path terms, measured (not fitted to the runs the calibration is checked on).

Launches `raypaged serve --workers 2` (serve_bench's engine settings: --kv-context-len 4096,
--max-model-len 1024) and sends one request at a time, each a fresh seeded prompt (no prefix
hit) of P tokens for P in --lengths, --repeats times, with --output-len tokens (ignore_eos),
--gap-s apart so every request finds both workers idle. Per request it records the client's
TTFT (send -> first token chunk) and TPOT ((e2e - TTFT) / (output tokens - 1)).

On an idle worker a request's first token takes one prefill step and each later token one
decode step of one sequence, so against the forward-step fit (fleet_sim_calibrate.py):

    TTFT(P) = path + step(P new tokens, 1 sequence)        path: HTTP, routing, the submit,
    TPOT    = step(1 new token, 1 sequence) + serving        the first SSE frame (per request)

fleet_sim_calibrate.py --probe reads this file and takes `serving` (per step) and `path` (per
request) from it; the table printed here is the raw measurement and a least-squares line
TTFT = a + b x P over the lengths.

Then, loaded (--loaded-s seconds, --loaded-clients clients each sending the same kind of
requests back to back): the CPU the machine spends per output token outside the workers' step
threads (threads named rp-step, engine_loop.py), i.e. the serving path (HAProxy, the router
replica, each worker's event loop and Ray's threads, the controller, Ray's daemons) and the
client. On an idle fleet it runs on a free core; once every core runs a step it takes its
share from the steps: the simulator's `serving_cpu_per_token` on `cores` (cost_model.py).
Then the same with --light-clients clients (a sequence or two a step): set beside the loaded
phase's several a step, it tells the serving path's CPU per step from its CPU per token
(`serving_cpu_per_step`, calibration.serving_cpu_terms).

    python benchmarks/fleet_sim_probe.py [--lengths 16,64,128,256,432] [--repeats 6]
        [--output-len 16] [--gap-s 0.4] [--loaded-s 20] [--loaded-clients 8]
        [--light-clients 2] [--name fleet_sim_probe]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from benchmarks.report import table, write  # noqa: E402
from benchmarks.serve_bench import one_request  # noqa: E402
from benchmarks.serve_cpu import HZ, thread_cpu  # noqa: E402
from benchmarks.serve_datasets import tokens  # noqa: E402
from benchmarks.serve_process import launch, stop  # noqa: E402


def probe_requests(lengths: list[int], repeats: int, seed: int) -> list[list[int]]:
    """Fresh prompts, lengths interleaved (a slow minute of the machine hits every length)."""
    rng = random.Random(seed)
    return [tokens(rng, p) for _ in range(repeats) for p in lengths]


async def run(url: str, prompts: list[list[int]], output_len: int, gap_s: float) -> list[dict]:
    async with httpx.AsyncClient(timeout=120) as client:
        model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
        # one warm-up request per worker: the first forward of a process builds its kernels
        for _ in range(2):
            await one_request(client, url, model, tokens(random.Random(-1), 32), 2)
        rows = []
        for prompt in prompts:
            await asyncio.sleep(gap_s)
            r = await one_request(client, url, model, prompt, output_len)
            if not r.ok:
                raise SystemExit(f"probe request failed: {r.error}")
            rows.append({"prompt_tokens": len(prompt), "ttft_ms": 1000 * r.ttft,
                         "e2e_ms": 1000 * r.e2e, "output_tokens": r.output_tokens,
                         "tpot_ms": 1000 * (r.e2e - r.ttft) / max(1, r.output_tokens - 1),
                         "worker": r.worker})
        return rows


def machine_busy_s() -> float:
    """CPU seconds the machine has spent busy, over every core (/proc/stat: all but idle and
    iowait)."""
    with open("/proc/stat") as f:
        jiffies = [int(x) for x in f.readline().split()[1:9]]
    return (sum(jiffies) - jiffies[3] - jiffies[4]) / HZ


def step_threads_s() -> float:
    """CPU seconds of every thread on the machine named rp-step (the workers' step threads and
    the OpenMP threads they start, which inherit the name)."""
    total = 0.0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        total += sum(cpu for name, cpu in thread_cpu(int(pid)).values() if name == "rp-step")
    return total


async def engine_steps(client: httpx.AsyncClient, url: str) -> int:
    """Model steps run so far by every worker (`raypaged:engine_steps_total` on /metrics), read
    once the fleet is still: the controller's figures lag the workers by a poll."""
    await asyncio.sleep(2.0)
    text = (await client.get(f"{url}/metrics")).text
    return round(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                     if line.startswith("raypaged:engine_steps_total{")))


async def loaded(url: str, lengths: list[int], output_len: int, clients: int, seconds: float,
                 seed: int) -> dict:
    """`clients` clients sending fresh prompts back to back for `seconds`: the CPU per output
    token outside the step threads; and the step threads' own CPU with what they computed
    (steps, prompts), which fleet_sim_calibrate.py sets against the forward-step fit."""
    rng = random.Random(seed + 1)
    tokens_out, stop_at = [0], time.monotonic() + seconds
    prompts: list[int] = []

    async def client_loop(client: httpx.AsyncClient, model: str) -> None:
        while time.monotonic() < stop_at:
            prompt = tokens(rng, rng.choice(lengths))
            r = await one_request(client, url, model, prompt, output_len)
            if not r.ok:
                raise SystemExit(f"loaded request failed: {r.error}")
            tokens_out[0] += r.output_tokens
            prompts.append(len(prompt))
    async with httpx.AsyncClient(timeout=120) as client:
        model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
        steps = await engine_steps(client, url)
        busy, step, t = machine_busy_s(), step_threads_s(), time.monotonic()
        await asyncio.gather(*(client_loop(client, model) for _ in range(clients)))
        busy, step = machine_busy_s() - busy, step_threads_s() - step
        wall = time.monotonic() - t
        steps = await engine_steps(client, url) - steps
    return {"clients": clients, "seconds": wall, "output_tokens": tokens_out[0],
            "cores": os.cpu_count(), "machine_busy_s": busy, "step_threads_s": step,
            "serving_cpu_ms_per_token": 1000 * (busy - step) / tokens_out[0],
            "engine_steps": steps, "prompt_tokens": prompts}


def line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="16,64,128,256,432")
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--gap-s", type=float, default=0.4)
    p.add_argument("--kv-tokens", type=int, default=4096)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--loaded-s", type=float, default=20.0)
    p.add_argument("--loaded-clients", type=int, default=8)
    p.add_argument("--light-clients", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default="fleet_sim_probe")
    ns = p.parse_args(argv)
    lengths = [int(x) for x in ns.lengths.split(",") if x]
    load_before = os.getloadavg()
    log = Path(tempfile.gettempdir()) / f"{ns.name}.log"
    proc, url = launch(["--workers", "2", "--routing", "round_robin", "--kv-context-len",
                        str(ns.kv_tokens), "--max-model-len", str(ns.max_model_len)], log)
    try:
        t0 = time.perf_counter()
        rows = asyncio.run(run(url, probe_requests(lengths, ns.repeats, ns.seed),
                               ns.output_len, ns.gap_s))
        wall = time.perf_counter() - t0
        load = asyncio.run(loaded(url, lengths, ns.output_len, ns.loaded_clients, ns.loaded_s,
                                  ns.seed))
        # other prompts than the loaded phase's: none of them may hit the prefix cache
        light = asyncio.run(loaded(url, lengths, ns.output_len, ns.light_clients, ns.loaded_s,
                                   ns.seed + 1000))
    finally:
        stop(proc)
    by_len = []
    for n in lengths:
        mine = [r for r in rows if r["prompt_tokens"] == n]
        by_len.append({"prompt_tokens": n, "requests": len(mine),
                       "mean_ttft_ms": statistics.fmean(r["ttft_ms"] for r in mine),
                       "median_ttft_ms": statistics.median(r["ttft_ms"] for r in mine),
                       "mean_tpot_ms": statistics.fmean(r["tpot_ms"] for r in mine),
                       "median_tpot_ms": statistics.median(r["tpot_ms"] for r in mine)})
    a, b = line([r["prompt_tokens"] for r in rows], [r["ttft_ms"] for r in rows])
    print(table(by_len, list(by_len[0])))
    print(f"TTFT = {a:.1f} ms + {b:.3f} ms x prompt tokens (least squares over {len(rows)} "
          f"requests); mean TPOT {statistics.fmean(r['tpot_ms'] for r in rows):.1f} ms")
    for phase in (load, light):
        print(f"loaded ({phase['clients']} clients, {phase['seconds']:.0f} s, "
              f"{phase['output_tokens']} output tokens): {phase['serving_cpu_ms_per_token']:.2f} "
              f"ms of CPU per output token outside the step threads, on {phase['cores']} cores; "
              f"the step threads {phase['step_threads_s']:.2f} s over {phase['engine_steps']} "
              "steps")
    out = write(ns.name, {
        "workload": {k: v for k, v in vars(ns).items() if k != "name"},
        "load_average": {"before": load_before, "after": os.getloadavg()}, "wall_s": wall,
        "ttft_line_ms": {"intercept": a, "per_prompt_token": b},
        "mean_tpot_ms": statistics.fmean(r["tpot_ms"] for r in rows),
        "median_tpot_ms": statistics.median(r["tpot_ms"] for r in rows),
        "by_length": by_len, "requests": rows, "loaded": load, "loaded_light": light})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
