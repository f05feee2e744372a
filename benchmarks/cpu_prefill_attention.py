"""Prefill attention on a CPU: torch's SDPA against the C++ bf16 kernel (--cpu-prefill-kernel).

Three measurements, each variant interleaved with the other in one process (a shared machine
slows both alike):
  1. one layer's prefill attention call, the default model's shapes (9 query heads over 3 KV
     heads, head dim 64, 16-token blocks, bf16), for fresh prompts and a chunk over a cached
     prefix, at --threads (the best wall time of --repeats calls: on a shared machine the
     median is the neighbours' (a 1,024-token call's median ran 18 to 416 ms here), the best
     is the call's own; the medians are kept in the JSON);
  2. the engine's whole prefill (best of the repeats; LLM.generate, one prompt of --engine-len random tokens,
     max_tokens 1, prefix caching off, 1 thread), kernel on and off;
  3. accuracy: the next token's top-20 log-probabilities after three long natural prompts (this
     repo's docs/performance.md), bf16 with and without the kernel, against the fp32 engine.

    python benchmarks/cpu_prefill_attention.py [--threads 1,2] [--repeats 7] [--engine-len 1024]
                                               [--name cpu_prefill_attention]
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.report import plot_path, pyplot, table, write  # noqa: E402
from raypaged.kernels import cpu_paged_decode  # noqa: E402
from raypaged.model.attention.base import LayerKVCache  # noqa: E402
from raypaged.model.attention.torch_backend import TorchAttentionBackend  # noqa: E402

H, HKV, D, BS = 9, 3, 64, 16
# (name, tokens computed, tokens already cached)
CALLS = [("fresh 256", 256, 0), ("fresh 1024", 1024, 0), ("fresh 2048", 2048, 0),
         ("chunk 512 over 1024", 512, 1024)]
VARIANTS = {"sdpa": TorchAttentionBackend(), "kernel":
            TorchAttentionBackend(prefill_kernel=cpu_paged_decode.paged_prefill)}


def layer_calls(threads: list[int], repeats: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n_threads in threads:
        torch.set_num_threads(n_threads)
        for name, n, ctx in CALLS:
            seq_len = n + ctx
            blocks = -(-seq_len // BS)
            shape = (blocks, BS, HKV, D)
            cache = LayerKVCache(torch.randn(shape, generator=gen).bfloat16(),
                                 torch.randn(shape, generator=gen).bfloat16())
            table_ = torch.randperm(blocks, generator=gen).int()  # scattered blocks
            q = torch.randn(n, H, D, generator=gen).bfloat16()
            times = {v: [] for v in VARIANTS}
            for v, backend in VARIANTS.items():  # warm-up
                backend._prefill(q, cache, table_, seq_len, D ** -0.5)
            for r in range(repeats):
                for v in (list(VARIANTS) if r % 2 == 0 else list(VARIANTS)[::-1]):
                    start = time.perf_counter()
                    VARIANTS[v]._prefill(q, cache, table_, seq_len, D ** -0.5)
                    times[v].append(time.perf_counter() - start)
            sdpa, kernel = (min(times[v]) * 1e3 for v in VARIANTS)
            rows.append({"call": name, "threads": n_threads, "sdpa_ms": sdpa,
                         "kernel_ms": kernel, "speedup": sdpa / kernel,
                         "per_30_layers_saved_ms": 30 * (sdpa - kernel),
                         **{f"{v}_median_ms": statistics.median(times[v]) * 1e3 for v in VARIANTS}})
    return rows


def engine_prefill(length: int, repeats: int) -> list[dict]:
    from raypaged import LLM, SamplingParams

    llms = {on: LLM(dtype="bfloat16", enable_prefix_caching=False, num_threads=1,
                    cpu_prefill_kernel=on) for on in (False, True)}
    vocab = llms[True].get_tokenizer().vocab_size
    rng = random.Random(0)
    prompt = {"prompt_token_ids": [rng.randrange(100, vocab - 100) for _ in range(length)]}
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    times = {on: [] for on in llms}
    for llm in llms.values():
        llm.generate([prompt], params, use_tqdm=False)
    for r in range(repeats):
        for on in ((False, True) if r % 2 == 0 else (True, False)):
            start = time.perf_counter()
            llms[on].generate([prompt], params, use_tqdm=False)
            times[on].append(time.perf_counter() - start)
    sdpa, kernel = (min(times[on]) * 1e3 for on in (False, True))  # best, as above
    return [{"prompt_tokens": length, "threads": 1, "sdpa_ms": sdpa, "kernel_ms": kernel,
             "speedup": sdpa / kernel, "sdpa_median_ms": statistics.median(times[False]) * 1e3,
             "kernel_median_ms": statistics.median(times[True]) * 1e3}]


def accuracy() -> list[dict]:
    """Top-20 log-probabilities of the next token vs the fp32 engine's (same prompts)."""
    from raypaged import LLM, SamplingParams

    text = (Path(__file__).resolve().parents[1] / "docs" / "performance.md").read_text()
    prompts = [f"Summarize the following text.\n\n{text[:n]}\n\nSummary:" for n in (1500, 3000, 5000)]
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=20)
    top = {}
    for name, kw in (("fp32", {"dtype": "float32"}),
                     ("bf16 kernel", {"dtype": "bfloat16", "cpu_prefill_kernel": True}),
                     ("bf16 sdpa", {"dtype": "bfloat16", "cpu_prefill_kernel": False})):
        llm = LLM(enable_prefix_caching=False, num_threads=1, **kw)
        outs = llm.generate(prompts, params, use_tqdm=False)
        top[name] = [(len(o.prompt_token_ids), dict(o.outputs[0].logprobs[0].top)) for o in outs]
        del llm
    rows = []
    for i, (length, ref) in enumerate(top["fp32"]):
        for name in ("bf16 kernel", "bf16 sdpa"):
            got = top[name][i][1]
            common = [t for t in ref if t in got]
            rows.append({"prompt_tokens": length, "variant": name,
                         "max_abs_logprob_diff_vs_fp32": max(abs(ref[t] - got[t]) for t in common),
                         "common_top20": len(common),
                         "same_top1": max(ref, key=ref.get) == max(got, key=got.get)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2", help="torch threads for the layer calls")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--engine-len", type=int, default=1024)
    ap.add_argument("--name", default="cpu_prefill_attention", help="results file name")
    args = ap.parse_args()
    if not cpu_paged_decode.prefill_built():
        sys.exit("this CPU has no AVX512-BF16: the prefill kernel is not built here")
    layer = layer_calls([int(t) for t in args.threads.split(",")], args.repeats)
    print(table(layer, ["call", "threads", "sdpa_ms", "kernel_ms", "speedup",
                        "per_30_layers_saved_ms"]))
    engine = engine_prefill(args.engine_len, max(3, args.repeats // 2))
    print(table(engine, ["prompt_tokens", "threads", "sdpa_ms", "kernel_ms", "speedup"]))
    acc = accuracy()
    print(table(acc, ["prompt_tokens", "variant", "max_abs_logprob_diff_vs_fp32",
                      "common_top20", "same_top1"]))
    load = Path("/proc/loadavg").read_text().split()[:3]
    print(f"(load average at the end: {' '.join(load)})")
    out = write(args.name, {"args": vars(args), "layer_calls": layer, "engine_prefill": engine,
                            "accuracy": acc, "load_avg_end": load})
    print(f"wrote {out}")
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(7, 3.5))
        labels = [f"{r['call']}\n{r['threads']} thr" for r in layer]
        x = range(len(layer))
        ax.bar([i - 0.2 for i in x], [r["sdpa_ms"] for r in layer], 0.4, label="SDPA")
        ax.bar([i + 0.2 for i in x], [r["kernel_ms"] for r in layer], 0.4, label="C++ kernel")
        ax.set_xticks(list(x), labels, fontsize=6)
        ax.set_ylabel("ms per layer call (best of repeats)")
        ax.set_yscale("log")
        ax.set_title("bf16 prefill attention, SmolLM2-135M shapes")
        ax.legend()
        fig.tight_layout()
        fig.savefig(plot_path(args.name), dpi=120)
        print(f"wrote {plot_path(args.name)}")


if __name__ == "__main__":
    main()
