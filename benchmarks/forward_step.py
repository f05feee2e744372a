"""One model step on the CPU: the default model's forward + logits, per engine optimisation.

Each variant is the default model (SmolLM2-135M) with some of the forward's CPU optimisations on;
all variants live in this one process and are timed interleaved (variant order rotates every
repeat), so a shared machine slows them alike, and only the ratios to `baseline` (every
optimisation off) are reported. Time is the process's CPU time, not wall time: on a machine
shared with other jobs, waiting for a core is not the step's cost (with --threads 1 the step
runs on the calling thread). Steps: decode of --batches sequences (1, 4, 16, 64) at --context
tokens each, and a prefill of --prefill tokens of one sequence.

    python benchmarks/forward_step.py [--repeats 9] [--threads 1] [--dtype bfloat16]
                                      [--name forward_step]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.report import plot_path, pyplot, table, write  # noqa: E402
from raypaged.model.attention.base import AttentionMetadata  # noqa: E402
from raypaged.model.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from raypaged.model.default_model import default_model_dir  # noqa: E402
from raypaged.model.kv_cache import allocate_kv_caches  # noqa: E402
from raypaged.model.loader import load_model  # noqa: E402
from raypaged.model.llama import pack_linears  # noqa: E402
from raypaged.model.setup import ModelSetup  # noqa: E402
from raypaged.config import EngineArgs  # noqa: E402

BLOCK = 16


class PerLayerPlan(TorchAttentionBackend):
    """The torch backend as it was: slot checks, masks and block ids rebuilt by every layer."""

    def _plan(self, meta, block_size):
        self._last = None
        return super()._plan(meta, block_size)


# variant -> the optimisations it turns on; None ("default"): the model as the engine builds it
# on this CPU (ModelSetup: every switch at its default, the C++ layer glue and prefill attention too)
VARIANTS = {"baseline": (), "packed_linears": ("packed_linears",), "step_plan": ("step_plan",),
            "packed+plan": ("packed_linears", "step_plan"), "default": None}


def build(variant: str, dtype: str):
    on = VARIANTS[variant]
    if on is None:
        setup = ModelSetup.decide(EngineArgs(dtype=dtype, device="cpu"))
        return setup.load_model(), setup.config
    model, cfg = load_model(default_model_dir(), dtype, "cpu")
    if "packed_linears" in on:
        pack_linears(model)
    if "step_plan" not in on:
        model.backend = PerLayerPlan()
    return model, cfg


def step_inputs(batch: int, context: int, query: int):
    """Sequence b owns blocks b*n .. b*n+n-1 and computes positions context .. context+query-1."""
    n = -(-(context + query) // BLOCK)
    tables = [[b * n + i for i in range(n)] for b in range(batch)]
    positions = [p for _ in range(batch) for p in range(context, context + query)]
    slots = [tables[b][p // BLOCK] * BLOCK + p % BLOCK for b in range(batch)
             for p in range(context, context + query)]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.arange(0, batch * query + 1, query,
                                                                        dtype=torch.int32),
        seq_lens=torch.full((batch,), context + query, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32), max_query_len=query,
        max_seq_len=context + query, query_lens_cpu=[query] * batch,
        seq_lens_cpu=[context + query] * batch)
    ids = torch.randint(100, 10_000, (batch * query,), generator=torch.Generator().manual_seed(0))
    last_rows = [(b + 1) * query - 1 for b in range(batch)]
    return ids, torch.tensor(positions), meta, last_rows, batch * n


@torch.inference_mode()
def time_step(model, caches, inputs) -> float:
    ids, positions, meta, last_rows, _ = inputs
    start = time.process_time()
    hidden = model(ids, positions, caches, meta)
    model.compute_logits(hidden[last_rows])
    return time.process_time() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--context", type=int, default=256, help="tokens cached per decoding sequence")
    ap.add_argument("--prefill", type=int, default=256)
    ap.add_argument("--batches", default="1,4,16,64", help="decoding sequences per step")
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--name", default="forward_step", help="results file name")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    variants = ["baseline", *(v for v in args.variants if v != "baseline")]
    cases = [(f"decode x{b}", int(b), args.context, 1) for b in args.batches.split(",")]
    cases.append((f"prefill {args.prefill}", 1, 0, args.prefill))
    built = {v: build(v, args.dtype) for v in variants}
    cfg = built["baseline"][1]
    inputs = {name: step_inputs(b, ctx, q) for name, b, ctx, q in cases}
    num_blocks = max(i[-1] for i in inputs.values())
    caches = allocate_kv_caches(cfg, num_blocks, BLOCK, getattr(torch, args.dtype), "cpu")
    times = {(c[0], v): [] for c in cases for v in variants}
    for name, *_ in cases:
        for v in variants:  # warm-up: oneDNN builds its kernels for each shape once
            time_step(built[v][0], caches, inputs[name])
            time_step(built[v][0], caches, inputs[name])
    for r in range(args.repeats):
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        for name, *_ in cases:
            for v in order:
                times[name, v].append(time_step(built[v][0], caches, inputs[name]))

    rows = []
    for name, *_ in cases:
        base = statistics.median(times[name, "baseline"])
        for v in variants:
            ms = statistics.median(times[name, v])
            rows.append({"step": name, "variant": v, "median_cpu_ms": ms * 1e3,
                         "speedup_vs_baseline": base / ms})
    print(table(rows, ["step", "variant", "median_cpu_ms", "speedup_vs_baseline"]))
    print(f"(threads={args.threads}, dtype={args.dtype}, {args.repeats} interleaved repeats)")
    out = write(args.name, {"threads": args.threads, "dtype": args.dtype,
                                 "context": args.context, "repeats": args.repeats, "rows": rows})
    print(f"wrote {out}")
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(7, 3.5))
        names = [c[0] for c in cases]
        width = 0.8 / len(variants)
        for i, v in enumerate(variants):
            ax.bar([j + i * width for j in range(len(names))],
                   [next(r["speedup_vs_baseline"] for r in rows
                         if r["step"] == n and r["variant"] == v) for n in names],
                   width, label=v)
        ax.set_xticks([j + width * (len(variants) - 1) / 2 for j in range(len(names))], names)
        ax.set_ylabel("speedup vs baseline (same run)")
        ax.axhline(1, color="grey", lw=0.5)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(plot_path(args.name))


if __name__ == "__main__":
    main()
