"""Does the router's event loop stay responsive while huge prompts are parsed and tokenized?

An in-process router (the real HTTP app, frontend and tokenizer of the default model; fake
engines behind it) keeps N prompts in flight (for at least 3 s: a slot sends its prompt again
when it is answered) while a client polls /health every 50 ms, and reports /health latency
(median, p90, max) per scenario, all from one run:

  idle            no prompts: what the (shared) machine alone does to /health
  huge, no bound  N prompts of ~7.5 MB (under the 8 MiB body limit) with the byte bound turned
                  off (the frontend's max_token_bytes = None): tokenized, then refused as over
                  max_model_len, as before the bound existed
  huge            the same prompts with the bound on: refused by their byte length, untokenized
  at the bound    N prompts of exactly (max_model_len - 1) x max_token_bytes bytes, the largest
                  the bound lets through to the tokenizer

Target: /health max < 100 ms with 8 huge prompts.

    python benchmarks/router_liveness.py [--prompts 8] [--megabytes 7.5] [--max-model-len 1024]
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
from raypaged.serve.dispatch import Dispatcher  # noqa: E402
from raypaged.serve.http_app import build_http_app  # noqa: E402
from raypaged.serve.metrics import RequestMetrics  # noqa: E402
from raypaged.serve.routing import Router  # noqa: E402

SENTENCE = "hello world, this is a prompt. "
MIN_S = 3.0


async def burst(app, prompts: int, text: str | None) -> tuple[list[float], list[int], float]:
    """/health latencies while `prompts` copies of `text` are kept in flight for at least
    MIN_S (each slot sends again when its prompt is answered), or for MIN_S with none."""
    # serialized once, up front: client and server share this event loop, and the client's own
    # json.dumps of 7.5 MB must not be what stalls it
    body = json.dumps({"model": "fake-model", "prompt": text}).encode()
    headers = {"content-type": "application/json"}
    statuses = []
    async with client_for(app) as client:
        start = time.perf_counter()

        async def slot():
            while True:
                reply = await client.post("/v1/completions", content=body, headers=headers)
                statuses.append(reply.status_code)
                if time.perf_counter() - start >= MIN_S:
                    return

        tasks = [asyncio.create_task(slot()) for _ in range(prompts if text else 0)]
        latencies = []
        while not all(t.done() for t in tasks) if tasks else time.perf_counter() - start < MIN_S:
            sent = time.perf_counter()
            assert (await client.get("/health")).status_code == 200
            latencies.append(time.perf_counter() - sent)
            await asyncio.sleep(0.05)
        await asyncio.gather(*tasks)
        return latencies, statuses, time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--megabytes", type=float, default=7.5)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ns = ap.parse_args()
    fleet = LocalFleet()
    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir()))
    metrics = RequestMetrics()
    info = ModelInfo("fake-model", ns.max_model_len, len(tokenizer), 0)
    frontend = OpenAIFrontend(Dispatcher(fleet, Router(ServeOptions(), 16), metrics), tokenizer,
                              info)
    app = build_http_app(frontend, fleet.snapshot, metrics, lambda: b"", None, 8 << 20)
    bound = frontend.max_token_bytes
    huge = SENTENCE * int(ns.megabytes * 1e6 / len(SENTENCE))
    limit_bytes = (ns.max_model_len - 1) * bound
    at_bound = (SENTENCE * (limit_bytes // len(SENTENCE) + 1))[:limit_bytes]
    scenarios = [("idle", None, bound), ("huge, no bound", huge, None), ("huge", huge, bound),
                 ("at the bound", at_bound, bound)]
    rows, samples = [], {}

    async def run_all():
        for name, text, max_token_bytes in scenarios:
            frontend.max_token_bytes = max_token_bytes
            latencies, statuses, seconds = await burst(app, ns.prompts, text)
            ms = sorted(1000 * x for x in latencies)
            samples[name] = ms
            rows.append({"scenario": name, "in_flight": ns.prompts if text else 0,
                         "requests": len(statuses),
                         "prompt_bytes": len(text) if text else 0, "seconds": seconds,
                         "health_replies": len(ms), "median_ms": ms[len(ms) // 2],
                         "p90_ms": ms[int(0.9 * len(ms))], "max_ms": ms[-1],
                         "prompt_statuses": sorted(set(statuses))})
    try:
        asyncio.run(run_all())
    finally:
        fleet.shutdown()
    print(f"max_model_len {ns.max_model_len}, max_token_bytes {bound}: prompts over "
          f"{limit_bytes} bytes are refused untokenized")
    print(table(rows, list(rows[0])))
    worst = rows[2]["max_ms"]
    print(f"target: /health max < 100 ms during {ns.prompts} huge prompts: {worst:.1f} ms "
          f"({'met' if worst < 100 else 'MISSED'})")
    name = "router_liveness" + ("" if ns.max_model_len == 1024 else f"_{ns.max_model_len}")
    payload = {"args": vars(ns), "max_token_bytes": bound, "rows": rows, "latencies_ms": samples}
    print(f"wrote {write(name, payload)}")
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6, 3.6))
        for scenario, ms in samples.items():
            ax.plot([i / max(1, len(ms) - 1) for i in range(len(ms))], ms, label=scenario)
        ax.axhline(100, color="red", linestyle="--", label="target 100 ms")
        ax.set_yscale("log")
        ax.set_xlabel("fraction of /health replies (sorted)")
        ax.set_ylabel("latency (ms)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(plot_path(name), dpi=80)
        print(f"wrote {plot_path(name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
