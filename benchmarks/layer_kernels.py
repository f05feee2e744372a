"""The C++ layer kernels (`--cpu-layer-kernels`: RMSNorm alone and after the residual add, rotary,
KV store) against torch's ops, offline, in one process: the same bf16 engine switched between
them (`raypaged.model.llama.use_layer_kernels`, the attention backend's `store_kernel`) between
runs, interleaved --repeats times, so the machine's drift falls on both alike.

Per-token decode time at each batch size as benchmarks/decode_ab.py measures it (prefix caching
off). Also checks that both give the same tokens (the kernels claim torch's bits).

    python benchmarks/layer_kernels.py [--batches 1,4,16] [--num-threads 1,2] [--repeats 5]
        [--input-len 256] [--output-len 64] [--name layer_kernels]   # table, JSON, PNG
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import decode_ab  # noqa: E402


def measure(threads: int, batches: list[int], repeats: int, input_len: int,
            output_len: int) -> list[dict]:
    from raypaged import LLM
    from raypaged.kernels import cpu_paged_decode
    from raypaged.model.llama import apply_rotary, use_layer_kernels

    llm = LLM(dtype="bfloat16", enable_prefix_caching=False, num_threads=threads)
    model = llm.engine.runner.model

    def use(ops):
        def switch() -> None:
            use_layer_kernels(model, *ops[:3])
            model.backend.store_kernel = ops[3]
        return switch

    modes = {"kernels": use((cpu_paged_decode.rms_norm_bf16, cpu_paged_decode.add_rms_norm_bf16,
                             cpu_paged_decode.rotary_bf16, cpu_paged_decode.store_kv)),
             "torch": use((None, None, apply_rotary, None))}
    return [{"threads": threads, **row,
             "kernels_over_torch": row["kernels_ms_per_step"] / row["torch_ms_per_step"]}
            for row in decode_ab.interleaved(llm, modes, batches, repeats, input_len, output_len)]


if __name__ == "__main__":
    decode_ab.main(__doc__, "layer_kernels", measure,
                   [("torch_ms_per_step", "torch ops"),
                    ("kernels_ms_per_step", "C++ layer kernels")],
                   "bf16 decode step, layer glue: torch ops vs C++ (lower is better)")
