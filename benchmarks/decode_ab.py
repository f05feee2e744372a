"""Per-token decode time of one engine switched between modes, interleaved, for A/B benchmarks
(layer_kernels.py, layer_loop.py): the machine's drift falls on every mode alike.

Per token at each batch size: `LLM.generate` of B random prompts of `input_len` tokens for 1 and
for `output_len` tokens (greedy, ignore_eos), per token = (median time for output_len - median
time for 1) / (output_len - 1). Also whether every mode gave the same tokens.
"""
from __future__ import annotations

import random
import statistics
import time
from typing import Callable


def interleaved(llm, modes: dict[str, Callable[[], None]], batches: list[int], repeats: int,
                input_len: int, output_len: int) -> list[dict]:
    """modes: name -> a function that switches `llm` to it. One row per batch:
    {batch, <mode>_ms_per_step for each mode, same_tokens}."""
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
        row["same_tokens"] = all(t == tokens[next(iter(modes))] for t in tokens.values())
        rows.append(row)
    return rows
