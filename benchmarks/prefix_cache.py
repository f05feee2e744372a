"""Prefix caching: 32 requests sharing a 512-token prefix, caching on vs off.

Requests arrive one after another (each as soon as the previous one has its first token, while
earlier ones keep decoding), like users of one system prompt. Reports the share of prompt tokens
served from the cache and the time to first token (TTFT) with caching on and off.

    python benchmarks/prefix_cache.py [--requests 32] [--prefix-len 512] [--suffix-len 32]
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.report import pyplot, plot_path, table, write  # noqa: E402


def run(caching: bool, args) -> dict:
    from raypaged import LLM, SamplingParams

    rng = random.Random(args.seed)
    prefix = [rng.randrange(100, 40000) for _ in range(args.prefix_len)]
    prompts = [prefix + [rng.randrange(100, 40000) for _ in range(args.suffix_len)]
               for _ in range(args.requests)]
    engine = LLM(enable_prefix_caching=caching, kv_memory_mb=512, max_model_len=2048).engine
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    ttft = []
    for i, p in enumerate(prompts):
        t0 = time.perf_counter()
        engine.add_request(f"r{i}", p, params)
        first = False
        while not first:
            first = any(o.request_id == f"r{i}" for o in engine.step())
        ttft.append(time.perf_counter() - t0)
    while engine.has_unfinished():
        engine.step()
    mem = engine.stats().memory
    hit = mem.prefix_hits / mem.prefix_queries if mem.prefix_queries else 0.0
    return {"prefix_caching": caching, "cached_prompt_share": hit,
            "ttft_mean_ms": 1000 * statistics.fmean(ttft), "ttft_p50_ms": 1000 * statistics.median(ttft)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prefix-len", type=int, default=512)
    ap.add_argument("--suffix-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rows = [run(True, args), run(False, args)]
    rows[0]["ttft_speedup"] = rows[1]["ttft_mean_ms"] / rows[0]["ttft_mean_ms"]
    print(table(rows, ["prefix_caching", "cached_prompt_share", "ttft_mean_ms", "ttft_p50_ms", "ttft_speedup"]))
    share = rows[0]["cached_prompt_share"]
    print(f"target: >= 85% of prompt tokens from cache: {share:.1%} ({'met' if share >= 0.85 else 'MISSED'})")
    print(f"wrote {write('prefix_cache', {'args': vars(args), 'rows': rows})}")
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(4.5, 3.5))
    ax.bar(["caching on", "caching off"], [r["ttft_mean_ms"] for r in rows])
    ax.set_ylabel("mean time to first token (ms)")
    ax.set_title(f"{args.requests} requests, shared {args.prefix_len}-token prefix")
    fig.tight_layout()
    fig.savefig(plot_path("prefix_cache"), dpi=80)
    print(f"wrote {plot_path('prefix_cache')}")


if __name__ == "__main__":
    main()
