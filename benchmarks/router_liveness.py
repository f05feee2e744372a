"""Does the router's event loop stay responsive while huge prompts are parsed and tokenized?

An in-process router (the real HTTP app, frontend and tokenizer of the default model; fake
engines behind it) receives N prompts of ~7.5 MB each at once (under the 8 MiB body limit; they
are refused after tokenizing, as over max_model_len) while a client polls /health every 50 ms.
Reports /health latency (median, p90, max) during the burst. Target: max < 100 ms with 8 prompts.

    python benchmarks/router_liveness.py [--prompts 8] [--megabytes 7.5]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "serve"), str(ROOT / "tests")]

from transformers import AutoTokenizer  # noqa: E402

from benchmarks.report import plot_path, pyplot, table, write  # noqa: E402
from local_fleet import LocalFleet, client_for  # noqa: E402
from raypaged.model.default_model import default_model_dir  # noqa: E402
from raypaged.serve.config import ServeOptions  # noqa: E402
from raypaged.serve.frontend import ModelInfo, OpenAIFrontend  # noqa: E402
from raypaged.serve.generation import Dispatcher  # noqa: E402
from raypaged.serve.http_app import build_http_app  # noqa: E402
from raypaged.serve.metrics import RequestMetrics  # noqa: E402
from raypaged.serve.routing import Router  # noqa: E402


async def burst(app, prompts: int, text: str) -> tuple[list[float], list[int]]:
    # serialized once, up front: client and server share this event loop, and the client's own
    # json.dumps of 7.5 MB must not be what stalls it
    body = json.dumps({"model": "fake-model", "prompt": text}).encode()
    headers = {"content-type": "application/json"}
    async with client_for(app) as client:
        tasks = [asyncio.create_task(client.post("/v1/completions", content=body,
                                                 headers=headers))
                 for _ in range(prompts)]
        latencies = []
        while not all(t.done() for t in tasks):
            start = time.perf_counter()
            assert (await client.get("/health")).status_code == 200
            latencies.append(time.perf_counter() - start)
            await asyncio.sleep(0.05)
        return latencies, [t.result().status_code for t in tasks]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--megabytes", type=float, default=7.5)
    ns = ap.parse_args()
    fleet = LocalFleet()
    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir()))
    metrics = RequestMetrics()
    info = ModelInfo("fake-model", 1024, len(tokenizer), 0)
    frontend = OpenAIFrontend(Dispatcher(fleet, Router(ServeOptions(), 16), metrics), tokenizer,
                              info)
    app = build_http_app(frontend, fleet.snapshot, metrics, lambda: b"", None, 8 << 20)
    sentence = "hello world, this is a prompt. "
    text = sentence * int(ns.megabytes * 1e6 / len(sentence))
    try:
        latencies, statuses = asyncio.run(burst(app, ns.prompts, text))
    finally:
        fleet.shutdown()
    ms = sorted(1000 * x for x in latencies)
    row = {"prompts": ns.prompts, "megabytes": ns.megabytes, "health_replies": len(ms),
           "median_ms": ms[len(ms) // 2], "p90_ms": ms[int(0.9 * len(ms))], "max_ms": ms[-1],
           "prompt_statuses": sorted(set(statuses))}
    print(table([row], list(row)))
    print(f"target: /health max < 100 ms during the burst: {ms[-1]:.1f} ms "
          f"({'met' if ms[-1] < 100 else 'MISSED'})")
    print(f"wrote {write('router_liveness', {'args': vars(ns), 'rows': [row], 'latencies_ms': ms})}")
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(5, 3.2))
        ax.plot(range(len(ms)), ms)
        ax.axhline(100, color="red", linestyle="--", label="target 100 ms")
        ax.set_xlabel("/health replies during the burst (sorted)")
        ax.set_ylabel("latency (ms)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(plot_path("router_liveness"), dpi=80)
        print(f"wrote {plot_path('router_liveness')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
