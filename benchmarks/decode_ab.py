"""Per-token decode time of one engine switched between modes, interleaved, for A/B benchmarks
(layer_kernels.py, layer_loop.py): the machine's drift falls on every mode alike; with one mode,
the offline engine's own (offline_tpot.py).

Per token at each batch size: `LLM.generate` of B random prompts of `input_len` tokens for 1 and
for `output_len` tokens (greedy, ignore_eos), per token = (median time for output_len - median
time for 1) / (output_len - 1). Also whether every mode gave the same tokens.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Callable

from benchmarks import report


def interleaved(llm, modes: dict[str, Callable[[], None]], batches: list[int], repeats: int,
                input_len: int, output_len: int) -> list[dict]:
    """modes: name -> a function that switches `llm` to it. One row per batch: {batch,
    <mode>_ms_per_step and <mode>_prefill_ms (median time for 1 token) for each mode,
    same_tokens}."""
    from raypaged import SamplingParams

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
        for use in modes.values():  # warm-up: oneDNN builds its kernels per shape once
            use()
            run(output_len)
        for _ in range(repeats):
            for mode, use in modes.items():
                use()
                one, full = times[mode]
                one.append(run(1)[0])
                elapsed, tokens[mode] = run(output_len)
                full.append(elapsed)
        row = {"batch": batch}
        for mode, (one, full) in times.items():
            per_token = (statistics.median(full) - statistics.median(one)) / (output_len - 1)
            row[f"{mode}_ms_per_step"] = per_token * 1e3
            row[f"{mode}_prefill_ms"] = statistics.median(one) * 1e3
        row["same_tokens"] = all(t == tokens[next(iter(modes))] for t in tokens.values())
        rows.append(row)
    return rows


def main(doc: str, name: str, measure, bars: list[tuple[str, str]], title: str) -> None:
    """The command line of an A/B benchmark: --batches, --num-threads, --repeats, --input-len,
    --output-len, --name; measure(threads, batches, repeats, input_len, output_len) -> rows;
    prints the table, writes the JSON and a bar plot of each (row key, label) in `bars`."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    ap.add_argument("--batches", type=ints, default=[1, 4, 16])
    ap.add_argument("--num-threads", type=ints, default=[1, 2])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--name", default=name)
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
        xs = range(len(rows))
        width = 0.8 / len(bars)
        for k, (key, label) in enumerate(bars):
            ax.bar([x + (k - (len(bars) - 1) / 2) * width for x in xs], [r[key] for r in rows],
                   width, label=label)
        ax.set_xticks(list(xs), [f"{r['threads']}t b{r['batch']}" for r in rows])
        ax.set_ylabel("ms per decode step")
        ax.set_title(title)
        ax.legend()
        fig.tight_layout()
        fig.savefig(report.plot_path(args.name))
        print("wrote", report.plot_path(args.name))
