"""Command-line flags for EngineArgs, shared by `raypaged generate`, `plan` and `serve`."""
from __future__ import annotations

import argparse

from raypaged.config import BLOCK_SIZES, KV_DTYPES
from raypaged.engine import EngineArgs


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and KV cache")
    g.add_argument("--model", default=None,
                   help="local Hugging Face folder (config.json + safetensors); default: SmolLM2-135M-Instruct")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--block-size", type=int, default=16, choices=BLOCK_SIZES)
    budget = g.add_mutually_exclusive_group()
    budget.add_argument("--kv-memory-mb", type=float, help="KV cache budget in MiB")
    budget.add_argument("--kv-memory-fraction", type=float,
                        help="KV budget as a fraction of free GPU memory after weights (default 0.9)")
    budget.add_argument("--kv-context-len", type=int, help="size the pool to hold this many tokens")
    g.add_argument("--kv-dtype", default="auto", choices=KV_DTYPES)
    g.add_argument("--no-prefix-caching", action="store_true", help="turn the prefix cache off")
    s = p.add_argument_group("scheduler and execution")
    s.add_argument("--max-model-len", type=int, help="longest prompt + output (default: the model's)")
    s.add_argument("--max-num-seqs", type=int, default=256)
    s.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="per-step token budget; longer prompts are prefilled in chunks")
    s.add_argument("--attention-backend", choices=["torch", "triton"],
                   help="default: triton on CUDA, torch on CPU")
    s.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    s.add_argument("--num-threads", type=int, help="torch CPU threads")
    s.add_argument("--onednn-cache-capacity", type=int, default=EngineArgs.onednn_cache_capacity,
                   help="oneDNN kernels kept per input shape on CPU bf16 (default: %(default)s; "
                        "1024 = the libraries' default, which grows RSS by ~0.6 GiB under load)")


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    return EngineArgs(
        model=ns.model, dtype=ns.dtype, block_size=ns.block_size, kv_memory_mb=ns.kv_memory_mb,
        kv_memory_fraction=ns.kv_memory_fraction, kv_context_len=ns.kv_context_len,
        kv_dtype=ns.kv_dtype, enable_prefix_caching=not ns.no_prefix_caching,
        max_model_len=ns.max_model_len, max_num_seqs=ns.max_num_seqs,
        max_num_batched_tokens=ns.max_num_batched_tokens, attention_backend=ns.attention_backend,
        enforce_eager=ns.enforce_eager, num_threads=ns.num_threads,
        onednn_cache_capacity=ns.onednn_cache_capacity)
