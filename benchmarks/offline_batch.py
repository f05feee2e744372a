"""The offline engine at a served benchmark's shape: what `raypaged serve` at concurrency c
should come close to, step for step (benchmarks/serve_cpu.py --offline runs it after its servers).

`LLM.generate` on --prompts random prompts of --input-len tokens, --output-len tokens each
(ignore_eos, greedy, prefix caching off), at most `concurrency` running at once (max_num_seqs),
with the torch threads a served worker uses (--num-threads, --decode-threads). Reports output
tok/s, wall and CPU (every thread of this process) ms per engine step, and tokens per step; the
served worker's step thread CPU per step (serve_cpu.py) is compared with `cpu_ms_per_step`.

    python benchmarks/offline_batch.py [--concurrency 16] [--prompts 48] [--input-len 256]
        [--output-len 64] [--num-threads 2] [--decode-threads 1]   # prints one JSON line
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def measure(concurrency: int, prompts: int, input_len: int, output_len: int, dtype: str = "auto",
            num_threads: int | None = None, decode_threads: int | None = None,
            seed: int = 0) -> dict:
    from raypaged import LLM, SamplingParams

    llm = LLM(dtype=dtype, enable_prefix_caching=False, max_num_seqs=concurrency,
              num_threads=num_threads, decode_threads=decode_threads)
    vocab = llm.get_tokenizer().vocab_size
    rng = random.Random(seed)
    batch = [{"prompt_token_ids": [rng.randrange(100, vocab - 100) for _ in range(input_len)]}
             for _ in range(prompts)]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate(batch[:concurrency], params, use_tqdm=False)  # warm-up: oneDNN's kernels
    steps0, cpu0, t0 = llm.engine.stats().num_steps, time.process_time(), time.perf_counter()
    llm.generate(batch, params, use_tqdm=False)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    steps = llm.engine.stats().num_steps - steps0
    tokens = prompts * output_len
    return {"concurrency": concurrency, "prompts": prompts, "input_len": input_len,
            "output_len": output_len, "num_threads": num_threads, "decode_threads": decode_threads,
            "output_throughput": tokens / wall, "steps": steps, "tokens_per_step": tokens / steps,
            "wall_ms_per_step": 1000 * wall / steps, "cpu_ms_per_step": 1000 * cpu / steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--num-threads", type=int)
    ap.add_argument("--decode-threads", type=int)
    a = ap.parse_args()
    print(json.dumps(measure(a.concurrency, a.prompts, a.input_len, a.output_len, a.dtype,
                             a.num_threads, a.decode_threads)))


if __name__ == "__main__":
    main()
