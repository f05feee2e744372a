"""The offline engine's time per output token for one request: what serving at concurrency 1
should come close to (issue 11: the serving path adds at most 10%). benchmarks/vs_vllm.py runs
it after its servers and reports each raypaged server's TPOT at concurrency 1 against it.

One random prompt of --input-len tokens, timed as benchmarks/decode_ab.py times a decode (for 1
and for --output-len tokens, interleaved --repeats times; prefix caching off so every run
prefills): per-token time = (median time for output-len - median time for 1) / (output-len - 1).
Engine settings are the offline defaults (all the machine's torch threads, unless --num-threads).

    python benchmarks/offline_tpot.py [--input-len 256] [--output-len 64] [--dtype auto]
                                      [--repeats 5] [--num-threads N]   # prints one JSON line
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import decode_ab  # noqa: E402


def measure(input_len: int, output_len: int, dtype: str, repeats: int,
            num_threads: int | None = None) -> dict:
    import torch

    from raypaged import LLM

    llm = LLM(dtype=dtype, enable_prefix_caching=False, num_threads=num_threads)
    row, = decode_ab.interleaved(llm, {"engine": lambda: None}, [1], repeats, input_len,
                                 output_len)
    return {"per_token_ms": row["engine_ms_per_step"], "prefill_ms": row["engine_prefill_ms"],
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
