"""Where a worker's memory goes under steady load: one in-process engine (no Ray), many requests.

A steady stream of varied requests (prompt and output lengths drawn anew each time, so every
step's tensors have new shapes; some n > 1, some stop strings, some aborted mid-way) runs through
`Engine.from_args` while every sample records, side by side:

    rss          resident set size (/proc/self/status)
    heap_in_use  glibc mallinfo2: bytes malloc handed out and not freed (uordblks + hblkhd)
    heap_free    glibc mallinfo2: bytes glibc holds free inside its arenas (fordblks): memory the
                 process keeps but nobody uses: fragmentation when it grows
    py_traced    tracemalloc's traced Python-level bytes (with --tracemalloc; slows the run)
    objects      live gc objects of raypaged's request-side types, and the engine's dicts

`rss` growing with `heap_in_use` flat and `heap_free` growing is the allocator, not a leak.
Each configuration (a oneDNN kernel-cache capacity, optionally +tcmalloc or +jemalloc through
LD_PRELOAD) runs the same seeded workload in a fresh child process, one after another:

    python benchmarks/memory_probe.py [--minutes 2.5] [--configs 1024,128,128+tcmalloc,128+jemalloc]
    python benchmarks/memory_probe.py --cache-cost    # what one new shape costs oneDNN's caches
                                                      # (benchmarks/results/memory_probe_cache_cost.json)

The allocators come from Debian (libtcmalloc-minimal4, libjemalloc2); a missing one is skipped.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import random
import subprocess
import sys
import time
import tracemalloc
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.report import plot_path, pyplot, table, write  # noqa: E402


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                               "usmblks", "fsmblks", "uordblks", "fordblks",
                                               "keepcost")]


def rss_bytes(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def glibc_heap() -> dict | None:
    """(in use, free inside arenas) from glibc's mallinfo2; None under another allocator, whose
    malloc glibc's counters do not see."""
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "mallinfo2") or os.environ.get("LD_PRELOAD"):
        return None
    libc.mallinfo2.restype = _Mallinfo2
    m = libc.mallinfo2()
    return {"heap_in_use": m.uordblks + m.hblkhd, "heap_free": m.fordblks, "mmapped": m.hblkhd}


REQUEST_TYPES = ("Request", "_Sequence", "IncrementalDetokenizer", "SampleRow",
                 "ScheduledRequest", "RequestDelta", "SequenceOutput")


def live_objects() -> dict[str, int]:
    counts = Counter(type(o).__name__ for o in gc.get_objects())
    return {t: counts.get(t, 0) for t in REQUEST_TYPES}


def engine_dicts(engine) -> dict[str, int]:
    s = engine.core.scheduler
    return {"engine._seqs": len(engine._seqs), "engine._prompts": len(engine._prompts),
            "scheduler.requests": len(s.requests), "scheduler.children": len(s.children),
            "kv.tables": len(s.kv.tables), "kv.block_ids": len(s.kv.block_ids)}


def random_request(rng: random.Random, vocab: int, max_prompt: int, max_output: int):
    from raypaged import SamplingParams

    prompt = [rng.randrange(100, vocab - 100) for _ in range(rng.randint(8, max_prompt))]
    kw = {"max_tokens": rng.randint(1, max_output), "n": rng.choice((1, 1, 1, 2, 3)),
          "temperature": rng.choice((0.0, 0.8)), "seed": rng.randrange(1000)}
    if rng.random() < 0.2:
        kw["stop"] = [" the", "."]
    return prompt, SamplingParams(**kw)


def soak(args) -> dict:
    """The workload, in this process; returns samples and totals."""
    import torch

    from raypaged.engine import Engine, EngineArgs

    torch.set_num_threads(args.threads)
    engine = Engine.from_args(EngineArgs(kv_memory_mb=args.kv_memory_mb, max_model_len=2048,
                                     num_threads=args.threads,
                                     onednn_cache_capacity=args.onednn_cache_capacity))
    vocab = len(engine.tokenizer)
    rng = random.Random(args.seed)
    if args.tracemalloc:
        tracemalloc.start(25)
    live: dict[str, int] = {}  # request id -> step at which to abort it (-1: never)
    done = tokens = step = 0
    samples, first_snap = [], None
    t0 = time.monotonic()
    next_sample = t0
    while time.monotonic() - t0 < args.minutes * 60:
        while len(live) < args.concurrency:
            rid = f"r{done + len(live)}-{step}"
            prompt, params = random_request(rng, vocab, args.max_prompt, args.max_output)
            engine.add_request(rid, prompt, params)
            live[rid] = step + rng.randint(1, 20) if rng.random() < 0.1 else -1
        for rid, at in list(live.items()):
            if at == step:
                engine.abort(rid)
        for out in engine.step():
            tokens += len(out.new_token_ids)
        unfinished = set(engine.core.scheduler.requests) | set(engine._prompts)
        for rid in [r for r in live if r not in unfinished]:
            del live[rid]
            done += 1
        step += 1
        if time.monotonic() >= next_sample:
            next_sample += args.sample_every
            gc.collect()
            sample = {"t_s": round(time.monotonic() - t0, 1), "requests": done,
                      "rss_mib": rss_bytes() / 2**20}
            heap = glibc_heap()
            if heap:
                sample.update({k: v / 2**20 for k, v in heap.items()})
            if args.tracemalloc:
                snap = tracemalloc.take_snapshot()
                first_snap = first_snap or snap
                sample["py_traced_mib"] = tracemalloc.get_traced_memory()[0] / 2**20
            sample.update(live_objects())
            samples.append(sample)
            print(json.dumps(sample), file=sys.stderr, flush=True)
    elapsed = time.monotonic() - t0
    for rid in list(live):
        engine.abort(rid)
    gc.collect()
    result = {"requests": done, "output_tokens": tokens, "seconds": elapsed,
              "tok_per_s": tokens / elapsed, "samples": samples,
              "idle_objects": live_objects(), "idle_engine_dicts": engine_dicts(engine)}
    if args.tracemalloc and first_snap is not None:
        stats = tracemalloc.take_snapshot().compare_to(first_snap, "traceback")
        result["tracemalloc_top"] = [
            {"size_diff_kib": s.size_diff / 1024, "count_diff": s.count_diff,
             "where": [str(f) for f in s.traceback.format()[-6:]]} for s in stats[:10]]
    return result


def kernel_cache_cost(shapes: int = 64) -> list[dict]:
    """What one new input shape costs a bf16 linear (576 -> 1536, one of the default model's
    sizes): heap kept by oneDNN's caches, and the time of a first (miss) and repeated (hit) call."""
    import torch

    torch.set_num_threads(1)
    w = torch.randn(1536, 576, dtype=torch.bfloat16)
    rows = []
    with torch.inference_mode():
        for lo in (1, 600):
            before = glibc_heap()["heap_in_use"]
            times = []
            for _ in range(2):  # first pass: every shape new; second: every shape cached
                t = time.perf_counter()
                for m in range(lo, lo + shapes):
                    torch.nn.functional.linear(torch.randn(m, 576, dtype=torch.bfloat16), w)
                times.append((time.perf_counter() - t) / shapes * 1e3)
                if len(times) == 1:
                    grown = glibc_heap()["heap_in_use"] - before
            rows.append({"tokens": f"{lo}..{lo + shapes - 1}", "kib_per_shape": grown / shapes / 1024,
                         "miss_ms": times[0], "hit_ms": times[1]})
    return rows


def run_child(args, capacity: int, preload: str | None) -> dict:
    """One soak in a fresh process: the caches and the allocator are chosen at process start."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    for name in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LD_PRELOAD"):
        env.pop(name, None)
    if preload:
        env["LD_PRELOAD"] = preload
    argv = [sys.executable, __file__, "--child", "--onednn-cache-capacity", str(capacity),
            *(f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
              if k in ("minutes", "sample_every", "concurrency", "max_prompt", "max_output",
                       "kv_memory_mb", "threads", "seed"))]
    out = subprocess.run(argv, env=env, check=True, stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def find_library(name: str) -> str | None:
    for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib"):
        hits = sorted(Path(d).glob(f"{name}.so*")) if Path(d).is_dir() else []
        if hits:
            return str(hits[0])
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=2.5, help="per configuration")
    p.add_argument("--sample-every", type=float, default=15.0, help="seconds")
    p.add_argument("--concurrency", type=int, default=8, help="requests kept in flight")
    p.add_argument("--max-prompt", type=int, default=600)
    p.add_argument("--max-output", type=int, default=64)
    p.add_argument("--kv-memory-mb", type=float, default=256)
    p.add_argument("--threads", type=int, default=1, help="torch threads (the machine is shared)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--configs", default="1024,128,128+tcmalloc,128+jemalloc",
                   help="oneDNN cache capacities, each optionally +tcmalloc or +jemalloc")
    p.add_argument("--onednn-cache-capacity", type=int, default=128, help="with --child")
    p.add_argument("--tracemalloc", action="store_true", help="trace Python allocations (slow)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--cache-cost", action="store_true",
                   help="only measure what one new shape costs oneDNN's caches (seconds)")
    args = p.parse_args()
    if args.child:
        print(json.dumps(soak(args)))
        return
    if args.cache_cost:
        rows = kernel_cache_cost()
        print(table(rows, list(rows[0])))
        print(f"wrote {write('memory_probe_cache_cost', {'rows': rows})}")
        return
    libs = {"tcmalloc": "libtcmalloc_minimal", "jemalloc": "libjemalloc"}
    rows, runs = [], {}
    for config in args.configs.split(","):
        capacity, _, allocator = config.partition("+")
        preload = find_library(libs[allocator]) if allocator else None
        if allocator and preload is None:
            print(f"{config}: {libs[allocator]}.so not found, skipped (apt-get install "
                  "libtcmalloc-minimal4 / libjemalloc2)")
            continue
        label = config if config not in runs else f"{config} (again)"
        run = runs[label] = run_child(args, int(capacity), preload)
        s = run["samples"]
        half = s[len(s) // 2]
        rows.append({"config": label, "requests": run["requests"], "tok/s": run["tok_per_s"],
                     "rss_start_mib": s[0]["rss_mib"], "rss_half_mib": half["rss_mib"],
                     "rss_end_mib": s[-1]["rss_mib"],
                     "heap_in_use_growth_mib": (s[-1]["heap_in_use"] - s[0]["heap_in_use"])
                     if "heap_in_use" in s[0] else None,
                     "heap_free_end_mib": s[-1].get("heap_free"),
                     "idle_request_objects": sum(run["idle_objects"].values()) -
                     run["idle_objects"].get("SequenceOutput", 0)})
    columns = list(rows[0])
    print(table(rows, columns))
    path = write("memory_probe", {"args": {k: v for k, v in vars(args).items() if k != "child"},
                                  "rows": rows, "runs": runs})
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(7, 4))
        for config, run in runs.items():
            ax.plot([x["t_s"] / 60 for x in run["samples"]], [x["rss_mib"] for x in run["samples"]],
                    label=f"cache {config}")
        ax.set_xlabel("minutes of steady varied load (in-process engine, no Ray)")
        ax.set_ylabel("RSS (MiB)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(plot_path("memory_probe"), dpi=90)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
