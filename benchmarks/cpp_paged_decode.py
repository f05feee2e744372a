"""The CPU decode attention (kernels/cpu_paged_decode*.cpp) vs the gather + SDPA path.

The kernel reads each sequence's blocks of the paged KV cache in place (C++/OpenMP, -O3
-march=native -ffast-math, at::parallel_for over (sequence, KV head) pairs); it is built here in
a fresh cache folder (XDG_CACHE_HOME, under which torch puts its build root), so the build time
printed is a cold build.
The torch side is `TorchAttentionBackend.attend` on the same cache and metadata without the
kernel: gather each sequence's blocks into a padded copy, then one masked SDPA with GQA grouping.
The step plan is built once before timing, as the engine builds it once per step for all 30
layers, so both sides are timed per layer call.

Shapes are the default model's (SmolLM2-135M: 9 query heads, 3 KV heads, head dim 64), block size
16, each sequence's blocks scattered over the cache (a shuffled block pool). A timed call is one
decode step's --layers layer calls, each over its own cache with the step's one block table, as
the engine's 30 layers read 30 caches: at 16 sequences of 1,024 tokens that is 378 MB, read from
memory, where repeating one layer's 13 MB (--layers 1, what this benchmark did before 2026-11-29)
reads it from the CPU's last-level cache. Times are per layer call. Both implementations are
timed in one process, interleaved, for every (threads, batch, context) case; each sample is the
mean of enough calls to last ~--sample-ms, and the median of --repeats samples is reported, both
process CPU time (all threads; what the step costs the machine) and wall time.

    python benchmarks/cpp_paged_decode.py [--repeats 15] [--sample-ms 20] [--layers 30]
        [--name cpp_paged_decode]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.report import plot_path, pyplot, table, write  # noqa: E402
from raypaged.kernels import cpu_paged_decode  # noqa: E402
from raypaged.model.attention.base import AttentionMetadata, LayerKVCache  # noqa: E402
from raypaged.model.attention.torch_backend import TorchAttentionBackend  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def build() -> float:
    """Build the kernel in an empty extensions folder -> seconds of wall time (a cold build)."""
    os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="cpu_paged_decode_")
    cpu_paged_decode.load.cache_clear()
    start = time.perf_counter()
    cpu_paged_decode.load()
    return time.perf_counter() - start


def decode_case(batch: int, context: int, dtype: torch.dtype, seed: int = 0):
    """A decode step of `batch` sequences with `context` cached tokens plus the new one, whose
    blocks sit at shuffled places in a cache with one spare block per sequence."""
    g = torch.Generator().manual_seed(seed)
    seq_len = context + 1
    n_blocks = -(-seq_len // BLOCK)
    pool = batch * (n_blocks + 1)
    shape = (pool, BLOCK, KV_HEADS, HEAD_DIM)
    cache = LayerKVCache(key=torch.randn(shape, generator=g).to(dtype),
                         value=torch.randn(shape, generator=g).to(dtype), k_scale=1.0, v_scale=1.0)
    tables = torch.randperm(pool, generator=g)[:batch * n_blocks].view(batch, n_blocks)
    slots = tables[:, (seq_len - 1) // BLOCK] * BLOCK + (seq_len - 1) % BLOCK
    meta = AttentionMetadata(
        slot_mapping=slots, query_start_loc=torch.arange(batch + 1, dtype=torch.int32),
        seq_lens=torch.full((batch,), seq_len, dtype=torch.int32),
        block_tables=tables.to(torch.int32), max_query_len=1, max_seq_len=seq_len,
        query_lens_cpu=[1] * batch, seq_lens_cpu=[seq_len] * batch)
    query = torch.randn(batch, HEADS, HEAD_DIM, generator=g).to(dtype)
    return query, cache, meta


def runners(batch: int, context: int, dtype: torch.dtype, layers: int = 1):
    """-> {"torch": fn, "cpp": fn}, each a step's decode attention over `layers` caches (the
    first case's block table and query, each layer's cache drawn with its own seed)."""
    query, cache, meta = decode_case(batch, context, dtype)
    caches = [cache] + [decode_case(batch, context, dtype, seed)[1] for seed in range(1, layers)]
    scale = HEAD_DIM ** -0.5
    gather, kernel = TorchAttentionBackend(), TorchAttentionBackend(cpu_paged_decode.paged_decode)
    for backend in (gather, kernel):  # the step plan, built once per step in the engine
        backend.attend(query, cache, meta, scale)

    def step(backend):
        for c in caches:
            out = backend.attend(query, c, meta, scale)
        return out
    return {"torch": lambda: step(gather), "cpp": lambda: step(kernel)}


@torch.inference_mode()
def check() -> list[dict]:
    """Max abs difference to the torch path: bf16 outputs, and fp32 (must agree within 1e-5)."""
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        worst = 0.0
        for batch in (1, 4, 16, 64):
            for context in (0, 15, 16, 255, 256, 1024):
                fns = runners(batch, context, dtype)
                worst = max(worst, (fns["torch"]().float() - fns["cpp"]().float()).abs().max().item())
        rows.append({"dtype": str(dtype).removeprefix("torch."), "max_abs_diff": worst})
    return rows


@torch.inference_mode()
def sample(fn, sample_s: float) -> tuple[float, float]:
    """-> (process CPU us, wall us) per call, the mean over enough calls to last ~sample_s."""
    calls = 1
    while True:
        c0, w0 = time.process_time(), time.perf_counter()
        for _ in range(calls):
            fn()
        cpu, wall = time.process_time() - c0, time.perf_counter() - w0
        if wall >= sample_s or calls >= 1 << 16:
            return cpu / calls * 1e6, wall / calls * 1e6
        # double while far off; once a sample is long enough to trust, jump to the target
        calls = calls * 2 if wall < sample_s / 4 else max(calls + 1, int(calls * sample_s / wall))


def measure(threads: int, batch: int, context: int, repeats: int, sample_s: float,
            layers: int) -> dict:
    torch.set_num_threads(threads)
    fns = runners(batch, context, torch.bfloat16, layers)
    cpu = {name: [] for name in fns}
    wall = {name: [] for name in fns}
    for fn in fns.values():
        sample(fn, sample_s / 4)  # warm-up
    for r in range(repeats):
        for name in (list(fns) if r % 2 == 0 else list(reversed(fns))):
            c, w = sample(fns[name], sample_s)
            cpu[name].append(c)
            wall[name].append(w)
    med = {f"{kind}_{name}_us": statistics.median(vals[name]) / layers
           for kind, vals in (("cpu", cpu), ("wall", wall)) for name in fns}
    return {"threads": threads, "batch": batch, "context": context, **med,
            "cpu_speedup": med["cpu_torch_us"] / med["cpu_cpp_us"],
            "wall_speedup": med["wall_torch_us"] / med["wall_cpp_us"]}


def plot(rows: list[dict], name: str) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    contexts = sorted({r["context"] for r in rows})
    fig, axes = plt.subplots(1, len(contexts), figsize=(5.5 * len(contexts), 4), sharey=True,
                             squeeze=False)
    axes = axes[0]
    for ax, context in zip(axes, contexts):
        for threads, marker in zip(sorted({r["threads"] for r in rows}), "os^v"):
            sel = [r for r in rows if r["context"] == context and r["threads"] == threads]
            xs = [r["batch"] for r in sel]
            ax.plot(xs, [r["cpu_speedup"] for r in sel], marker=marker, label=f"{threads} thr, CPU time")
            ax.plot(xs, [r["wall_speedup"] for r in sel], marker=marker, ls="--",
                    label=f"{threads} thr, wall")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("decode batch (sequences)")
        ax.set_title(f"context {context}")
    axes[0].set_ylabel("torch path time / C++ kernel time")
    axes[0].legend(fontsize=8)
    fig.suptitle("Decode attention per layer, bf16, SmolLM2-135M heads: C++ paged kernel speedup")
    fig.tight_layout()
    path = plot_path(name)
    fig.savefig(path, dpi=110)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--sample-ms", type=float, default=20.0)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--layers", type=int, default=30,
                        help="layer calls per timed step, each over its own cache")
    parser.add_argument("--name", default="cpp_paged_decode")
    args = parser.parse_args()

    build_s = build()
    print(f"cold build: {build_s:.1f} s")
    checks = check()
    print(table(checks, ["dtype", "max_abs_diff"]))
    fp32 = next(c for c in checks if c["dtype"] == "float32")["max_abs_diff"]
    if fp32 > 1e-5:
        raise SystemExit(f"fp32 outputs differ from the torch path by {fp32:.3g} > 1e-5")
    rows = [measure(t, b, c, args.repeats, args.sample_ms / 1e3, args.layers)
            for t in args.threads for c in args.contexts for b in args.batches]
    print(table(rows, ["threads", "batch", "context", "cpu_torch_us", "cpu_cpp_us", "cpu_speedup",
                       "wall_torch_us", "wall_cpp_us", "wall_speedup"]))
    path = write(args.name, {
        "build_s": build_s, "checks": checks, "repeats": args.repeats, "layers": args.layers,
        "sample_ms": args.sample_ms, "shape": {"heads": HEADS, "kv_heads": KV_HEADS,
                                               "head_dim": HEAD_DIM, "block_size": BLOCK},
        "dtype": "bfloat16", "torch": torch.__version__, "rows": rows})
    print(f"wrote {path}" + (f" and {png}" if (png := plot(rows, args.name)) else ""))


if __name__ == "__main__":
    main()
