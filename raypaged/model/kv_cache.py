"""Allocate the paged KV cache: per layer, K and V of [num_blocks, block_size, num_kv_heads, head_dim].

kv_dtype "auto" stores K/V in the model's dtype. "fp8_e4m3" stores value / scale as
torch.float8_e4m3fn (half the bytes of bf16, so twice the tokens fit) and readers multiply by the
scale. The scales default to 1.0 because none of the supported checkpoints ship calibrated KV
scales, and K/V activations of Llama-family models sit far inside e4m3's +-448 range, so 1.0
loses nothing to clipping; what fp8 costs is mantissa precision (3 bits), not range. This is
also vLLM's behaviour for checkpoints without scales. Writers clamp to +-448 regardless.
"""
from __future__ import annotations

import torch

from raypaged.config import KV_DTYPES
from raypaged.model.attention.base import LayerKVCache
from raypaged.model.model_config import ModelConfig


def kv_storage_dtype(dtype: torch.dtype, kv_dtype: str) -> torch.dtype:
    """The element type the cache stores for a model running in `dtype`."""
    if kv_dtype == "auto":
        return dtype
    if kv_dtype == "fp8_e4m3":
        return torch.float8_e4m3fn
    raise ValueError(f"unknown kv_dtype {kv_dtype!r}; choices: {', '.join(KV_DTYPES)}")


def allocate_kv_caches(config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                       device: torch.device | str = "cpu") -> list[LayerKVCache]:
    """One LayerKVCache per layer storing `dtype` (kv_storage_dtype's answer), zero-filled (a
    never-written slot reads as 0, not NaN, which keeps masked-out garbage finite in the
    attention kernels), with unit scales (the module's docstring says why)."""
    shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
    return [LayerKVCache(key=torch.zeros(shape, dtype=dtype, device=device),
                         value=torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(config.num_layers)]
