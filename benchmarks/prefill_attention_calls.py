"""What batching prefill attention across sequences could save: the fixed cost of one call.

The CPU backend attends each prefill chunk with its own SDPA call (the linears already run on
every sequence's tokens at once). A batched formulation could save at most the per-call fixed
cost, so this measures one layer's prefill attention (TorchAttentionBackend.attend, default
model's heads: 9 query heads, 3 KV heads, head dim 64, bf16, block size 16, 1 thread) for 1 and 8
sequences of 2 tokens (nearly all fixed cost) and of 128 and 256 tokens, and reports the fixed
cost per sequence as a share of each chunk's attention.

    python benchmarks/prefill_attention_calls.py [--repeats 9]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.forward_step import BLOCK, step_inputs  # noqa: E402
from benchmarks.report import plot_path, pyplot, table, write  # noqa: E402
from raypaged.model.attention.base import LayerKVCache  # noqa: E402
from raypaged.model.attention.torch_backend import TorchAttentionBackend  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def prefill_case(n_seqs: int, tokens: int):
    """n_seqs fresh prompts of `tokens` tokens each, as forward_step lays them out."""
    _, _, meta, _, num_blocks = step_inputs(n_seqs, 0, tokens)
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    g = torch.Generator().manual_seed(0)
    cache = LayerKVCache(torch.randn(shape, generator=g).bfloat16(),
                         torch.randn(shape, generator=g).bfloat16())
    query = torch.randn(n_seqs * tokens, HEADS, HEAD_DIM, generator=g).bfloat16()
    return query, cache, meta


@torch.inference_mode()
def time_us(n_seqs: int, tokens: int, repeats: int) -> float:
    query, cache, meta = prefill_case(n_seqs, tokens)
    backend = TorchAttentionBackend()
    backend.attend(query, cache, meta, HEAD_DIM ** -0.5)  # warm-up and the step plan
    samples = []
    for _ in range(repeats):
        calls = max(1, 40 // n_seqs)
        start = time.process_time()
        for _ in range(calls):
            backend.attend(query, cache, meta, HEAD_DIM ** -0.5)
        samples.append((time.process_time() - start) / calls * 1e6)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(1)
    fixed = time_us(8, 2, args.repeats) / 8  # 8 two-token chunks: almost nothing but call cost
    rows = []
    for tokens in (2, 128, 256):
        for n_seqs in (1, 8):
            us = time_us(n_seqs, tokens, args.repeats)
            rows.append({"sequences": n_seqs, "tokens_each": tokens, "us_per_layer": us,
                         "us_per_sequence": us / n_seqs,
                         "fixed_share": fixed / (us / n_seqs)})
    print(table(rows, ["sequences", "tokens_each", "us_per_layer", "us_per_sequence",
                       "fixed_share"]))
    print(f"fixed cost per sequence per layer: {fixed:.0f} us (1 thread, bf16, process CPU time)")
    out = write("prefill_attention_calls", {"repeats": args.repeats, "fixed_us": fixed,
                                            "rows": rows})
    print(f"wrote {out}")
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for n_seqs in (1, 8):
            sel = [r for r in rows if r["sequences"] == n_seqs]
            ax.plot([r["tokens_each"] for r in sel], [r["us_per_sequence"] for r in sel],
                    marker="o", label=f"{n_seqs} sequence(s) per step")
        ax.axhline(fixed, color="grey", ls="--", label="fixed cost per call")
        ax.set_xlabel("prefill tokens per sequence")
        ax.set_ylabel("us per sequence per layer")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(plot_path("prefill_attention_calls"))


if __name__ == "__main__":
    main()
