"""Well-formed requests that ask too much, against a real HTTP router: refused how fast, and
does the router stay responsive?

A router process (the real HTTP app and frontend under uvicorn, default limits from
ServeOptions, fake engines behind it: the router's own costs are what is measured) is probed by
this process over TCP:

  each over-limit request (the kinds that hurt before the limits: 20,000 prompts, a million
  stop_token_ids, 50,000 stop strings, a 1 MB stop string, ...) - its status and seconds;
  8 parallel 8 MiB `[1,1,...]` bodies   - the router process's peak RSS growth, /health max;
  N slow-body connections (body_timeout_s 2 s here) - how many got 408 and when, /health max.

Targets (issue 24): every over-limit request refused with a 4xx in < 1 s; /health < 1 s;
RSS growth under 8 parallel maximum bodies < 1.5 GiB.

    python benchmarks/limits_probe.py [--slow-bodies 200]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "serve"), str(ROOT / "tests")]

import httpx  # noqa: E402

from benchmarks.report import table, write  # noqa: E402

BODY_TIMEOUT_S = 2.0
USER = {"role": "user", "content": "hi"}
ATTACKS = {  # name -> (path, body)
    "20,000 prompts": ("completions", {"prompt": [[97]] * 20_000, "max_tokens": 1}),
    "1,000,000 stop_token_ids": ("completions", {"prompt": "a", "stop_token_ids": [1] * 1_000_000}),
    "50,000 stop strings": ("completions", {"prompt": "a", "stop": ["zq"] * 50_000}),
    "one 1 MB stop string": ("completions", {"prompt": "a", "stop": "z" * 1_000_000}),
    "n = 1000": ("completions", {"prompt": "a", "n": 1000}),
    "16 x n 16 x max_tokens 1000": ("completions", {"prompt": ["a"] * 16, "n": 16,
                                                     "max_tokens": 1000}),
    "logprobs 100000": ("completions", {"prompt": "a", "logprobs": 100_000}),
    "100,000 chat messages": ("chat/completions", {"messages": [USER] * 100_000}),
    "250,000 content parts": ("chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": ""}] * 250_000}]}),
    "a 2M-token prompt": ("completions", {"prompt": [1] * 2_000_000}),
}


def serve(port: int) -> None:
    """The router process."""
    import uvicorn

    from local_fleet import LocalFleet
    from raypaged.serve.config import ServeOptions
    from raypaged.serve.frontend import ModelInfo, OpenAIFrontend
    from raypaged.serve.dispatch import Dispatcher
    from raypaged.serve.http_app import build_http_app
    from raypaged.serve.limits import RequestLimits
    from raypaged.serve.metrics import RequestMetrics, render
    from raypaged.serve.routing import Router

    options = ServeOptions()
    fleet = LocalFleet(step_delay_s=0.005)
    engine = next(iter(fleet.workers.values())).engine
    info = ModelInfo("fake-model", engine.max_model_len, len(engine.tokenizer), 0)
    metrics = RequestMetrics()
    frontend = OpenAIFrontend(Dispatcher(fleet, Router(options, engine.block_size), metrics),
                              engine.tokenizer, info, limits=RequestLimits.of(options),
                              request_timeout_s=options.request_timeout_s)
    app = build_http_app(frontend, fleet.snapshot, metrics,
                         lambda: render(fleet.snapshot(), metrics.snapshot(), info.name), None,
                         options.max_request_bytes, body_timeout_s=BODY_TIMEOUT_S)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="error", lifespan="off",
                limit_concurrency=None, backlog=4096)


def rss_mib(pid: int, key: str = "VmRSS") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(key)


def children(pid: int) -> list[int]:
    """The router's child processes (its body parsers, serve/body_parser.py)."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


async def health_poller(client: httpx.AsyncClient, url: str, stop: asyncio.Event) -> list[float]:
    times = []
    while not stop.is_set():
        t = time.perf_counter()
        await client.get(url + "/health")
        times.append(time.perf_counter() - t)
        await asyncio.sleep(0.05)
    return times


async def small(client: httpx.AsyncClient, url: str) -> float:
    t = time.perf_counter()
    r = await client.post(url + "/v1/completions",
                          json={"prompt": "hello", "max_tokens": 4, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return time.perf_counter() - t


async def probe(url: str, pid: int, slow_bodies: int) -> dict:
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=64)) as client:
        idle = sorted([await small(client, url) for _ in range(10)])[5]
        attacks = []
        for name, (path, body) in ATTACKS.items():
            raw = json.dumps(body).encode()
            t = time.perf_counter()
            r = await client.post(f"{url}/v1/{path}", content=raw,
                                  headers={"Content-Type": "application/json"})
            took = time.perf_counter() - t
            attacks.append({"request": name, "body_mib": len(raw) / 2**20,
                            "status": r.status_code, "seconds": took,
                            "param": (r.json().get("error") or {}).get("param")})
        # 8 parallel maximum bodies
        big = b'{"prompt":[' + b"1," * (4 * 2**20 - 16) + b"1]}"
        before = rss_mib(pid)
        stop = asyncio.Event()
        poller = asyncio.create_task(health_poller(client, url, stop))
        t = time.perf_counter()

        async def send_big() -> tuple[httpx.Response, float]:
            r = await client.post(url + "/v1/completions", content=big,
                                  headers={"Content-Type": "application/json"})
            return r, time.perf_counter() - t

        answers = await asyncio.gather(*(send_big() for _ in range(8)))
        rs = [r for r, _ in answers]
        bodies_s = time.perf_counter() - t
        small_during = await small(client, url)
        stop.set()
        health = await poller
        peak = rss_mib(pid, "VmHWM")
        # each body parser's peak: how much of the bodies' cost moved out of the router
        parser_peaks = [round(rss_mib(c, "VmHWM"), 1) for c in children(pid)]
        bodies = {"bodies": 8, "body_mib": len(big) / 2**20, "statuses": sorted({r.status_code
                                                                                for r in rs}),
                  "seconds": bodies_s, "each_answered_s": sorted(round(s, 3) for _, s in answers),
                  "rss_before_mib": before, "rss_peak_mib": peak,
                  "rss_growth_mib": peak - before, "body_parser_peak_rss_mib": parser_peaks,
                  "health_max_s": max(health),
                  "small_request_s": small_during}
        # slow bodies: connections that send headers and a few bytes, then nothing
        stop = asyncio.Event()
        poller = asyncio.create_task(health_poller(client, url, stop))
        port = int(url.rsplit(":", 1)[1])
        t = time.perf_counter()
        results = await asyncio.gather(*(slow_body(port) for _ in range(slow_bodies)))
        slow_s = time.perf_counter() - t
        small_during = await small(client, url)
        stop.set()
        health = await poller
        slow = {"connections": slow_bodies, "got_408": sum(r == 408 for r in results),
                "closed_within_s": slow_s, "body_timeout_s": BODY_TIMEOUT_S,
                "health_max_s": max(health), "small_request_s": small_during}
        return {"idle_small_request_s": idle, "attacks": attacks, "parallel_bodies": bodies,
                "slow_bodies": slow}


async def slow_body(port: int) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100000\r\n\r\n{\"prompt\": ")
    await writer.drain()
    data = await reader.read()  # until the server closes it
    writer.close()
    return int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--slow-bodies", type=int, default=200)
    ap.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve is not None:
        return serve(args.serve)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, __file__, "--serve", str(port)])
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(200):
            try:
                httpx.get(url + "/health", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        out = asyncio.run(probe(url, proc.pid, args.slow_bodies))
    finally:
        proc.terminate()
        proc.wait(10)
    print(f"idle small request: {out['idle_small_request_s'] * 1000:.1f} ms")
    print(table(out["attacks"], ["request", "body_mib", "status", "seconds", "param"]))
    print(table([out["parallel_bodies"]], ["bodies", "body_mib", "statuses", "seconds",
                                           "rss_growth_mib", "body_parser_peak_rss_mib",
                                           "health_max_s", "small_request_s"]))
    print("each body answered after (s):", out["parallel_bodies"]["each_answered_s"])
    print(table([out["slow_bodies"]], ["connections", "got_408", "closed_within_s",
                                       "health_max_s", "small_request_s"]))
    path = write("limits_probe", {"command": "python benchmarks/limits_probe.py "
                                  f"--slow-bodies {args.slow_bodies}", **out})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
