"""The Triton paged-attention kernels on one GPU, against SDPA over contiguous K/V.

    cd <checkout> && PYTHONPATH=. python3 benchmarks/kernel_bench.py [--quick] [--reps 20]

Needs a CUDA GPU with torch and triton; not ray and not an installed raypaged (the kernels load
by path, see benchmarks/_kernels.py). Prints a table and writes
benchmarks/results/kernels_<device>.json (+ .png when matplotlib imports).

Timing: one call captured in a CUDA graph and replayed between L2 flushes (a buffer >= 4x L2 is
zeroed), CUDA events around each replay, median of --reps after 3 warm-up calls. The graph keeps
the host's launch cost out (a Triton launch from Python takes tens of microseconds, more than a
small decode call; the engine runs decode from CUDA graphs too); SDPA is timed the same way. Shapes are Llama-3-8B's: 32 query heads, 8 KV
heads, head dim 128, pages of --block-size tokens scattered in random order.

  copy bw  a 1 GiB device-to-device copy, (read + write) bytes / time: the roof for decode
  decode   batch {1, 16, 64, 256} x context {512, 2k, 8k, 32k} up to --max-kv-tokens (batch x
           context: 2M by default, so 256 x 32k, 34 GB of K/V plus its contiguous copy, is left
           out), bf16 and fp8 KV caches (bf16 queries);
           bytes/s = (K + V + q + out + block table bytes) / latency, and that as a fraction of
           copy bw; baseline: SDPA on the same K/V gathered into contiguous [B, 8, ctx, 128],
           queries grouped [B, 8, 4, 128] (so no K/V copy per query head); the baseline's output
           also checks ours (max_err)
  prefill  one prompt of {1k, 4k, 16k} tokens, no cached prefix; baseline: causal SDPA on the
           same K/V, contiguous [1, 32, N, 128] (heads expanded before timing)
  sweeps   (bf16) every decode shape at split counts 1-16 beside the split rule's choice;
           prefill under other tile shapes beside the static tile rule's; fp8 decode tiles at
           three shapes: what a tuned rule would gain, measured
  check    the prefill tile rule against the one before it on shapes it was not chosen on
           (SmolLM2's 9/3 heads of dim 64; batches extending a cached prefix; an fp8 cache)
The GPU runs matrix products for ~1 s first, so the first shape is not timed at idle clocks.
"""
from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from benchmarks import kernel_reference as reference  # noqa: E402
from benchmarks._kernels import kernel_module  # noqa: E402
from benchmarks.report import pyplot, plot_path, table, write  # noqa: E402

decode_k = kernel_module("paged_decode")
prefill_k = kernel_module("paged_prefill")

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
SCALE = HEAD_DIM ** -0.5
BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
DEVICE = "cuda"
TARGETS = {
    "decode_bw_fraction_min": 0.80,     # batch >= 64, context >= 2k, of measured copy bandwidth
    "paged_vs_contiguous_max": 1.15,    # bf16 paged decode latency / contiguous SDPA latency
    "fp8_vs_bf16_per_token_max": 0.60,  # fp8 decode latency / bf16 decode latency, same shape
}


class Timer:
    def __init__(self, reps: int, warmup: int = 3) -> None:
        self.reps, self.warmup = reps, warmup
        l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
        self.flush = torch.empty(max(4 * l2, 256 << 20), dtype=torch.int8, device="cuda")

    def ms(self, fn, graph: bool = True) -> float:
        for _ in range(self.warmup):
            fn()  # compiles, autotunes, allocates: outside the graph
        torch.cuda.synchronize()
        captured, run = None, fn
        try:
            if graph:
                captured = torch.cuda.CUDAGraph()
                with torch.cuda.graph(captured):
                    fn()
                run = captured.replay
        except RuntimeError as e:  # not capturable: timed as launched (host cost included)
            print(f"  (timed without a graph: {str(e)[:100]})")
            torch.cuda.synchronize()
            run = fn
        events = []
        for _ in range(self.reps):
            self.flush.zero_()  # evict everything the previous call left in L2
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            events.append((start, end))
        torch.cuda.synchronize()
        del captured, run
        return statistics.median(s.elapsed_time(e) for s, e in events)


SPLIT_SWEEP = (1, 2, 3, 4, 6, 8, 12, 16)
# prefill launch options tried beside the static rule's (BLOCK_M tokens x GROUP_PAD heads = rows)
PREFILL_SWEEP = [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=st) for m, n, w, st in (
    (16, 64, 8, 3), (32, 64, 8, 3), (32, 64, 8, 2), (32, 128, 8, 2), (16, 128, 8, 3),
    (16, 64, 4, 3), (32, 32, 4, 3), (32, 64, 4, 3), (64, 64, 8, 2))]


FP8_DECODE_SWEEP = [dict(BLOCK_N=n, num_warps=w, num_stages=st)
                    for n in (64, 128) for w in (4, 8) for st in (2, 3, 4)]


def old_prefill_tiles(group: int, head_dim: int) -> dict:
    """The 16-bit prefill tile rule before the H200 sweep (64 rows x 64 keys, 3 stages)."""
    group_pad = triton.next_power_of_2(group)
    return dict(BLOCK_M=max(1, 64 // group_pad), GROUP_PAD=group_pad, BLOCK_N=64,
                HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
                num_warps=4 if head_dim <= 64 else 8, num_stages=3)


def prefill_rule_check(timer: Timer, block_size: int) -> list[dict]:
    """The prefill tile rule vs the one before it on shapes the sweep did not choose it on."""
    rows = []
    for name, heads, kv_heads, dim, ctx, new, kv in (
            ("smollm2 4k prompt", 9, 3, 64, [0], [4096], BF16),
            ("smollm2 8 x (1k cached + 128 new)", 9, 3, 64, [1024] * 8, [128] * 8, BF16),
            ("llama 8 x (2k cached + 256 new)", HEADS, KV_HEADS, HEAD_DIM, [2048] * 8, [256] * 8,
             BF16),
            ("llama 4k prompt, fp8 cache", HEADS, KV_HEADS, HEAD_DIM, [0], [4096], FP8),
            ("llama 16k prompt, fp8 cache", HEADS, KV_HEADS, HEAD_DIM, [0], [16384], FP8)):
        b = reference.make_paged_batch(ctx, new, heads, kv_heads, dim, block_size, BF16, kv,
                                       device=DEVICE, spare_blocks=0)
        out = torch.empty_like(b.query)
        scale = dim ** -0.5

        def call(tiles):
            return timer.ms(lambda: prefill_k.paged_prefill(
                b.query, b.key_cache, b.value_cache, b.block_tables, b.query_start_loc,
                b.seq_lens, max(new), scale, b.k_scale, b.v_scale, out=out, tiles=tiles))
        rule = prefill_k.prefill_tiles(heads // kv_heads, dim, BF16, kv, block_size)
        old_ms, new_ms = call(old_prefill_tiles(heads // kv_heads, dim)), call(rule)
        rows.append({"workload": name, "old_us": old_ms * 1e3, "rule_us": new_ms * 1e3,
                     "old/rule": old_ms / new_ms})
        del b, out
        torch.cuda.empty_cache()
    return rows


def fp8_decode_sweep(timer: Timer, block_size: int, num_sms: int) -> list[dict]:
    rows = []
    for batch, ctx in ((16, 8192), (64, 8192), (256, 2048)):
        b = reference.make_paged_batch([ctx - 1] * batch, [1] * batch, HEADS, KV_HEADS, HEAD_DIM,
                                       block_size, BF16, FP8, device=DEVICE, spare_blocks=0)
        splits = decode_k.choose_num_splits(batch, KV_HEADS, ctx, num_sms)
        workspace = decode_k.DecodeWorkspace.allocate(batch, HEADS, HEAD_DIM, DEVICE)
        out = torch.empty_like(b.query)
        base = decode_k.decode_tiles(HEADS // KV_HEADS, HEAD_DIM, BF16)
        for opts in [{}] + FP8_DECODE_SWEEP:
            tiles = {**base, **opts}
            us = us_or_error(timer, lambda: decode_k.paged_decode(
                b.query, b.key_cache, b.value_cache, b.block_tables, b.seq_lens, SCALE,
                b.k_scale, b.v_scale, num_splits=splits, workspace=workspace, out=out,
                tiles=tiles))
            rows.append({"batch": batch, "ctx": ctx, "tiles": "rule" if not opts else "",
                         **{k: tiles[k] for k in ("BLOCK_N", "num_warps")},
                         "num_stages": tiles.get("num_stages", 3), "us": us})
        del b, out, workspace
        torch.cuda.empty_cache()
    return rows


def us_or_error(timer: Timer, fn) -> float | str:
    """A sweep entry's time in µs, or why that launch option failed (e.g. out of shared
    memory): recorded, not fatal."""
    try:
        return timer.ms(fn) * 1e3
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {str(e)[:80]}"


def warm_up(seconds: float = 1.0) -> None:
    a = torch.randn(8192, 8192, dtype=BF16, device="cuda")
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a @ a
        torch.cuda.synchronize()


def copy_bandwidth(timer: Timer) -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    # launched, not replayed: a 1 GiB copy inside a CUDA graph ran at ~60% of this (H200)
    ms = timer.ms(lambda: dst.copy_(src), graph=False)
    return 2 * src.numel() / (ms / 1e3)


def contiguous_kv(b, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every sequence's first seq_len positions, dequantised to bf16: [B, KV_HEADS, seq_len, D]."""
    num_seqs, block_size = b.block_tables.shape[0], b.key_cache.shape[1]
    pages = b.block_tables[:, :triton.cdiv(seq_len, block_size)].long()
    out = []
    for cache, scale in ((b.key_cache, b.k_scale), (b.value_cache, b.v_scale)):
        # Gather as bytes: not every device has an fp8 indexing kernel.
        x = cache.view(torch.uint8)[pages].view(cache.dtype).to(BF16)  # [B, pages, bs, Hkv, D]
        if scale != 1.0:
            x.mul_(scale)
        x = x.view(num_seqs, -1, KV_HEADS, HEAD_DIM)[:, :seq_len]
        out.append(x.transpose(1, 2).contiguous())
    return out[0], out[1]


def bench_decode(timer: Timer, batch: int, ctx: int, block_size: int, num_sms: int) -> list[dict]:
    rows, sdpa_ms = [], None
    for kv_dtype in (BF16, FP8):
        b = reference.make_paged_batch([ctx - 1] * batch, [1] * batch, HEADS, KV_HEADS, HEAD_DIM,
                                       block_size, BF16, kv_dtype, device=DEVICE, spare_blocks=0)
        splits = decode_k.choose_num_splits(batch, KV_HEADS, ctx, num_sms)
        workspace = decode_k.DecodeWorkspace.allocate(batch, HEADS, HEAD_DIM, DEVICE)
        out = torch.empty_like(b.query)
        ms = timer.ms(lambda: decode_k.paged_decode(
            b.query, b.key_cache, b.value_cache, b.block_tables, b.seq_lens, SCALE, b.k_scale,
            b.v_scale, num_splits=splits, workspace=workspace, out=out))
        k, v = contiguous_kv(b, ctx)
        q = b.query.view(batch, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM)  # GQA group as rows
        expected = F.scaled_dot_product_attention(q, k, v, scale=SCALE).view(batch, HEADS, HEAD_DIM)
        sweep = {}
        if kv_dtype == BF16:
            sdpa_ms = timer.ms(lambda: F.scaled_dot_product_attention(q, k, v, scale=SCALE))
            wide = decode_k.DecodeWorkspace.allocate(batch, HEADS, HEAD_DIM, DEVICE)
            for n in SPLIT_SWEEP:
                sweep[n] = timer.ms(lambda: decode_k.paged_decode(
                    b.query, b.key_cache, b.value_cache, b.block_tables, b.seq_lens, SCALE,
                    b.k_scale, b.v_scale, num_splits=n, workspace=wide, out=out)) * 1e3
            del wide
        moved = (2 * batch * ctx * KV_HEADS * HEAD_DIM * b.key_cache.element_size()
                 + 2 * b.query.numel() * b.query.element_size() + b.block_tables.numel() * 4)
        rows.append({
            "kernel": "decode", "kv": "fp8" if kv_dtype == FP8 else "bf16", "batch": batch,
            "ctx": ctx, "splits": splits, "us": ms * 1e3, "sdpa_us": sdpa_ms * 1e3,
            "vs_sdpa": ms / sdpa_ms, "GB/s": moved / (ms / 1e3) / 1e9,
            "max_err": (out.float() - expected.float()).abs().max().item(),
        })
        if sweep:
            best = min(sweep, key=sweep.get)
            rows[-1].update(split_us=sweep, best_splits=best, rule_vs_best=ms * 1e3 / sweep[best])
        del b, k, v, q, out, expected, workspace
        torch.cuda.empty_cache()
    rows[1]["fp8/bf16"] = rows[1]["us"] / rows[0]["us"]
    return rows


def bench_prefill(timer: Timer, tokens: int, block_size: int) -> list[dict]:
    rows, sdpa_ms = [], None
    flops = 2 * tokens * tokens * HEADS * HEAD_DIM  # causal: half of 2 matmuls x 2 flops
    for kv_dtype in (BF16, FP8):
        b = reference.make_paged_batch([0], [tokens], HEADS, KV_HEADS, HEAD_DIM, block_size, BF16,
                                       kv_dtype, device=DEVICE, spare_blocks=0)
        out = torch.empty_like(b.query)
        ms = timer.ms(lambda: prefill_k.paged_prefill(
            b.query, b.key_cache, b.value_cache, b.block_tables, b.query_start_loc, b.seq_lens,
            tokens, SCALE, b.k_scale, b.v_scale, out=out))
        k, v = contiguous_kv(b, tokens)  # [1, KV_HEADS, N, D]
        group = HEADS // KV_HEADS
        k, v = (x.repeat_interleave(group, dim=1) for x in (k, v))  # [1, HEADS, N, D]
        q = b.query.transpose(0, 1).unsqueeze(0).contiguous()     # [1, HEADS, N, D]
        def sdpa():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=SCALE)

        expected = sdpa()[0].transpose(0, 1)
        sweep = []
        if kv_dtype == BF16:
            sdpa_ms = timer.ms(sdpa)
            group_pad = prefill_k.prefill_tiles(HEADS // KV_HEADS, HEAD_DIM, BF16, BF16)["GROUP_PAD"]
            for opts in PREFILL_SWEEP:
                tiles = dict(opts, GROUP_PAD=group_pad, HEAD_DIM_PAD=HEAD_DIM)
                us = us_or_error(timer, lambda: prefill_k.paged_prefill(
                    b.query, b.key_cache, b.value_cache, b.block_tables, b.query_start_loc,
                    b.seq_lens, tokens, SCALE, b.k_scale, b.v_scale, out=out, tiles=tiles))
                sweep.append({**opts, "us": us})
        rows.append({
            "kernel": "prefill", "kv": "fp8" if kv_dtype == FP8 else "bf16", "tokens": tokens,
            "us": ms * 1e3, "sdpa_us": sdpa_ms * 1e3, "vs_sdpa": ms / sdpa_ms,
            "TFLOP/s": flops / (ms / 1e3) / 1e12,
            "max_err": (out.float() - expected.float()).abs().max().item(),
        })
        timed = [r for r in sweep if isinstance(r["us"], float)]
        if timed:
            best = min(timed, key=lambda r: r["us"])
            rows[-1].update(tile_sweep=sweep, best_tiles={k: v for k, v in best.items() if k != "us"},
                            rule_vs_best=rows[-1]["us"] / best["us"])
        del b, k, v, q, out, expected
        torch.cuda.empty_cache()
    return rows


def check_targets(decode: list[dict], copy_bw: float) -> list[dict]:
    checks = []
    for r in decode:
        frac = r["GB/s"] * 1e9 / copy_bw
        r["bw_frac"] = frac
        if r["batch"] >= 64 and r["ctx"] >= 2048:
            checks.append({"target": f"bw >= {TARGETS['decode_bw_fraction_min']:.0%} of copy",
                           "case": f"{r['kv']} b{r['batch']} ctx{r['ctx']}", "value": frac,
                           "pass": frac >= TARGETS["decode_bw_fraction_min"]})
        if r["kv"] == "bf16":
            checks.append({"target": f"paged <= {TARGETS['paged_vs_contiguous_max']}x contiguous",
                           "case": f"b{r['batch']} ctx{r['ctx']}", "value": r["vs_sdpa"],
                           "pass": r["vs_sdpa"] <= TARGETS["paged_vs_contiguous_max"]})
        else:
            checks.append({"target": f"fp8 <= {TARGETS['fp8_vs_bf16_per_token_max']}x bf16",
                           "case": f"b{r['batch']} ctx{r['ctx']}", "value": r["fp8/bf16"],
                           "pass": r["fp8/bf16"] <= TARGETS["fp8_vs_bf16_per_token_max"]})
    return checks


def plot(name: str, decode: list[dict], prefill: list[dict], copy_bw: float) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    for kv, marker in (("bf16", "o"), ("fp8", "s")):
        rs = [r for r in decode if r["kv"] == kv]
        ax1.plot(range(len(rs)), [r["bw_frac"] for r in rs], marker=marker,
                 label=f"paged decode, {kv} KV")
        ax1.set_xticks(range(len(rs)), [f"b{r['batch']}\n{r['ctx']}" for r in rs], fontsize=7)
    ax1.axhline(TARGETS["decode_bw_fraction_min"], color="gray", ls="--",
                label="target (b >= 64, ctx >= 2k)")
    ax1.set_ylabel(f"fraction of copy bandwidth ({copy_bw / 1e9:,.0f} GB/s)")
    ax1.set_title("decode: achieved bandwidth (batch / context)")
    ax1.legend(fontsize=8)
    for kv, marker in (("bf16", "o"), ("fp8", "s")):
        rs = [r for r in prefill if r["kv"] == kv]
        ax2.plot([r["tokens"] for r in rs], [r["us"] / 1e3 for r in rs], marker=marker,
                 label=f"paged prefill, {kv} KV")
    rs = [r for r in prefill if r["kv"] == "bf16"]
    ax2.plot([r["tokens"] for r in rs], [r["sdpa_us"] / 1e3 for r in rs], marker="^", ls=":",
             label="SDPA, contiguous bf16")
    ax2.set_xscale("log", base=2)
    ax2.set_yscale("log")
    ax2.set_xlabel("prompt tokens")
    ax2.set_ylabel("latency (ms)")
    ax2.set_title("prefill")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    path = plot_path(name)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="a few shapes only (smoke test)")
    parser.add_argument("--max-kv-tokens", type=int, default=1 << 21,
                        help="largest batch x context measured (K/V and its contiguous copy fit)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("kernel_bench needs a CUDA GPU")
    device = torch.cuda.get_device_name(0)
    name = "kernels_" + re.sub(r"[^a-z0-9]+", "_", device.lower()).strip("_")
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    timer = Timer(args.reps)
    warm_up()
    batches, contexts, prompts = ((1, 64), (512, 2048), (1024,)) if args.quick else \
        ((1, 16, 64, 256), (512, 2048, 8192, 32768), (1024, 4096, 16384))

    copy_bw = copy_bandwidth(timer)
    print(f"{device}: {num_sms} SMs, copy bandwidth {copy_bw / 1e9:,.0f} GB/s "
          f"(torch {torch.__version__}, triton {triton.__version__})\n")
    decode = [r for b in batches for c in contexts if b * c <= args.max_kv_tokens
              for r in bench_decode(timer, b, c, args.block_size, num_sms)]
    checks = check_targets(decode, copy_bw)
    print(table(decode, ["kv", "batch", "ctx", "splits", "us", "sdpa_us", "vs_sdpa", "GB/s",
                         "bw_frac", "fp8/bf16", "best_splits", "rule_vs_best", "max_err"]))
    prefill = [r for n in prompts for r in bench_prefill(timer, n, args.block_size)]
    print()
    print(table(prefill, ["kv", "tokens", "us", "sdpa_us", "vs_sdpa", "TFLOP/s", "rule_vs_best",
                          "max_err"]))
    for r in prefill:
        if "tile_sweep" in r:
            print(f"prefill {r['tokens']} tokens, tile sweep (bf16):")
            print(table(r["tile_sweep"], ["BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "us"]))
    fp8_sweep = fp8_decode_sweep(timer, args.block_size, num_sms)
    print("\nfp8 decode, tile sweep:")
    print(table(fp8_sweep, ["batch", "ctx", "tiles", "BLOCK_N", "num_warps", "num_stages", "us"]))
    rule_check = prefill_rule_check(timer, args.block_size)
    print("\nprefill tile rule vs the one before it, on shapes it was not chosen on:")
    print(table(rule_check, ["workload", "old_us", "rule_us", "old/rule"]))
    print()
    print(table(checks, ["target", "case", "value", "pass"]))

    path = write(name, {"device": device, "num_sms": num_sms, "torch": torch.__version__,
                        "triton": triton.__version__, "block_size": args.block_size,
                        "reps": args.reps, "max_kv_tokens": args.max_kv_tokens,
                        "copy_bandwidth_bytes_per_s": copy_bw,
                        "targets": TARGETS, "decode": decode, "prefill": prefill,
                        "fp8_decode_sweep": fp8_sweep, "prefill_rule_check": rule_check,
                        "checks": checks})
    print(f"\nwrote {path}")
    plot(name, decode, prefill, copy_bw)


if __name__ == "__main__":
    main()
