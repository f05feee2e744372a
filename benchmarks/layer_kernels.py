"""The C++ layer kernels (`--cpu-layer-kernels`: RMSNorm alone and after the residual add, rotary,
KV store) against torch's ops, offline, in one process: the same bf16 engine switched between
them (`raypaged.model.llama.use_layer_kernels`, the attention backend's `store_kernel`) between
runs, interleaved --repeats times, so the machine's drift falls on both alike.

Per-token decode time at each batch size: `LLM.generate` of B random prompts of --input-len
tokens for 1 and for --output-len tokens (greedy, ignore_eos, prefix caching off); per token =
(median time for output-len - median time for 1) / (output-len - 1). Also checks that both give
the same tokens (the kernels claim torch's bits).

    python benchmarks/layer_kernels.py [--batches 1,4,16] [--num-threads 1,2] [--repeats 5]
        [--input-len 256] [--output-len 64] [--name layer_kernels]   # table, JSON, PNG
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import report  # noqa: E402


def measure(threads: int, batches: list[int], repeats: int, input_len: int,
            output_len: int) -> list[dict]:
    from raypaged import LLM, SamplingParams
    from raypaged.kernels import cpu_paged_decode
    from raypaged.model.llama import apply_rotary, use_layer_kernels

    llm = LLM(dtype="bfloat16", enable_prefix_caching=False, num_threads=threads)
    model = llm.engine.runner.model
    modes = {"kernels": (cpu_paged_decode.rms_norm_bf16, cpu_paged_decode.add_rms_norm_bf16,
                         cpu_paged_decode.rotary_bf16, cpu_paged_decode.store_kv),
             "torch": (None, None, apply_rotary, None)}

    def use(ops) -> None:
        use_layer_kernels(model, *ops[:3])
        model.backend.store_kernel = ops[3]

    vocab = llm.get_tokenizer().vocab_size
    rng = random.Random(0)
    rows = []
    for batch in batches:
        prompts = [{"prompt_token_ids": [rng.randrange(100, vocab - 100) for _ in range(input_len)]}
                   for _ in range(batch)]

        def run(n: int) -> tuple[float, list]:
            params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            return time.perf_counter() - start, [o.outputs[0].token_ids for o in outs]

        times = {mode: ([], []) for mode in modes}
        tokens = {}
        for mode, ops in modes.items():  # warm-up: oneDNN builds its kernels per shape once
            use(ops)
            run(output_len)
        for _ in range(repeats):
            for mode, ops in modes.items():
                use(ops)
                one, full = times[mode]
                one.append(run(1)[0])
                elapsed, tokens[mode] = run(output_len)
                full.append(elapsed)
        per_token = {mode: (statistics.median(full) - statistics.median(one)) / (output_len - 1)
                     for mode, (one, full) in times.items()}
        rows.append({"threads": threads, "batch": batch,
                     "kernels_ms_per_step": per_token["kernels"] * 1e3,
                     "torch_ms_per_step": per_token["torch"] * 1e3,
                     "kernels_over_torch": per_token["kernels"] / per_token["torch"],
                     "same_tokens": tokens["kernels"] == tokens["torch"]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    ap.add_argument("--batches", type=ints, default=[1, 4, 16])
    ap.add_argument("--num-threads", type=ints, default=[1, 2])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--name", default="layer_kernels")
    args = ap.parse_args()
    rows = [row for threads in args.num_threads
            for row in measure(threads, args.batches, args.repeats, args.input_len,
                               args.output_len)]
    print(report.table(rows, list(rows[0])))
    print("wrote", report.write(args.name, {"input_len": args.input_len,
                                            "output_len": args.output_len,
                                            "repeats": args.repeats, "rows": rows}))
    plt = report.pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(7, 4))
        labels = [f"{r['threads']}t b{r['batch']}" for r in rows]
        xs = range(len(rows))
        ax.bar([x - 0.2 for x in xs], [r["torch_ms_per_step"] for r in rows], 0.4, label="torch ops")
        ax.bar([x + 0.2 for x in xs], [r["kernels_ms_per_step"] for r in rows], 0.4,
               label="C++ layer kernels")
        ax.set_xticks(list(xs), labels)
        ax.set_ylabel("ms per decode step")
        ax.set_title("bf16 decode step, layer glue: torch ops vs C++ (lower is better)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(report.plot_path(args.name))
        print("wrote", report.plot_path(args.name))


if __name__ == "__main__":
    main()
