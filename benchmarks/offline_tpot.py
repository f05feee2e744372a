"""The offline engine's time per output token for one request: what serving at concurrency 1
should come close to (issue 11: the serving path adds at most 10%). benchmarks/vs_vllm.py runs
it after its servers and reports each raypaged server's TPOT at concurrency 1 against it.

`LLM.generate` on one random prompt of --input-len tokens, run for 1 and for --output-len tokens
(ignore_eos, greedy, prefix caching off so every run prefills), interleaved --repeats times;
per-token time = (median time for output-len tokens - median time for 1) / (output-len - 1).
Engine settings are the offline defaults (all the machine's torch threads, unless --num-threads).

    python benchmarks/offline_tpot.py [--input-len 256] [--output-len 64] [--dtype auto]
                                      [--repeats 5] [--num-threads N]   # prints one JSON line
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def measure(input_len: int, output_len: int, dtype: str, repeats: int,
            num_threads: int | None = None, seed: int = 0) -> dict:
    import torch

    from raypaged import LLM, SamplingParams

    llm = LLM(dtype=dtype, enable_prefix_caching=False, num_threads=num_threads)
    vocab = llm.get_tokenizer().vocab_size
    rng = random.Random(seed)
    prompt = {"prompt_token_ids": [rng.randrange(100, vocab - 100) for _ in range(input_len)]}

    def run(n: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        return time.perf_counter() - start

    run(output_len)  # warm-up: oneDNN builds its kernels for each shape once
    one, full = [], []
    for _ in range(repeats):
        one.append(run(1))
        full.append(run(output_len))
    per_token = (statistics.median(full) - statistics.median(one)) / (output_len - 1)
    return {"per_token_ms": per_token * 1e3, "prefill_ms": statistics.median(one) * 1e3,
            "threads": torch.get_num_threads(), "input_len": input_len,
            "output_len": output_len, "repeats": repeats}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--num-threads", type=int, help="torch threads (default: all the machine's)")
    args = ap.parse_args()
    print(json.dumps(measure(args.input_len, args.output_len, args.dtype, args.repeats,
                             args.num_threads)))


if __name__ == "__main__":
    main()
