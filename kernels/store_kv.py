"""store_kv: scatter the step's new K/V rows into the paged cache by slot mapping.

    token t  ──slot_mapping[t]──>  slot s  (s = -1: padding, skipped)
    cache[s // BLOCK_SIZE, s % BLOCK_SIZE, :, :] = new[t, :, :]

One program per token writes all of its KV heads (a [KV_HEADS_PAD, HEAD_DIM_PAD] tile) for both
K and V, so a step of T tokens is T programs. An fp8 (e4m3) cache stores value / scale, clamped
to the format's finite range (+-448) so an outlier saturates instead of becoming NaN.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch_checks import KV_DTYPES


@triton.jit
def _round_to_e4m3(x):
    """Round fp32 x (already within +-448) to the nearest e4m3 value, ties to even, in fp32.

    The cast to fp8 that follows is then exact. Hardware casts round correctly on their own, but
    the Triton interpreter's fp32 -> fp8 cast rounds half-up and drops the mantissa carry
    (127.9 -> 64); rounding here first gives the same bits on GPU and in the interpreter.
    e4m3 has 3 mantissa bits and a smallest normal exponent of -6, so the spacing of
    representable values around |x| is 2^(max(e, -6) - 3) with e = floor(log2 |x|).
    """
    a = tl.abs(x)
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 255) - 127
    spacing = ((tl.maximum(e, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)
    # a / spacing < 16 is exact (power of two); adding 2^23 rounds it to an integer (ties to
    # even) in fp32, subtracting gives that integer back exactly.
    r = ((a / spacing + 8388608.0) - 8388608.0) * spacing
    # x's sign bit onto r (r >= 0) with integer ops: compiled, `-r` is 0 - r, which turns -0.0
    # (and what rounds to it) into +0.0 (seen on an H200 with Triton 3.6)
    sign = x.to(tl.int32, bitcast=True) & -2147483648
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr,          # [T, num_kv_heads, head_dim] new rows (any row/head strides)
    key_cache_ptr, value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,            # [T] int64, -1 = padding
    k_scale, v_scale,            # fp32 scalars; only read when QUANTIZE (stored = value / scale)
    stride_kt, stride_kh,        # new key strides (token, head); head_dim stride is 1
    stride_vt, stride_vh,        # new value strides
    stride_cb, stride_cs, stride_ch,  # cache strides (block, slot, head), the same for K and V
    num_kv_heads, head_dim,
    BLOCK_SIZE: tl.constexpr,    # tokens per cache block (page)
    KV_HEADS_PAD: tl.constexpr,  # next_power_of_2(num_kv_heads)
    HEAD_DIM_PAD: tl.constexpr,  # next_power_of_2(head_dim)
    QUANTIZE: tl.constexpr,      # cache is fp8: divide by the scale and clamp before the cast
):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t)  # int64
    heads = tl.arange(0, KV_HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    # slot -1 folds into the mask (as "zero heads"), so padded tokens do no memory traffic.
    # (A scalar bool `&` a tensor mask gives an int mask in the Triton interpreter; avoid it.)
    live_heads = tl.where(slot >= 0, num_kv_heads, 0)
    mask = (heads[:, None] < live_heads) & (dims[None, :] < head_dim)

    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    cache_off = block * stride_cb + offset * stride_cs + heads[:, None] * stride_ch + dims[None, :]

    k = tl.load(key_ptr + t * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(value_ptr + t * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    if QUANTIZE:
        # minimum/maximum rather than tl.clamp: same meaning on every Triton 3.x.
        k = _round_to_e4m3(tl.minimum(tl.maximum(k.to(tl.float32) / k_scale, -448.0), 448.0))
        v = _round_to_e4m3(tl.minimum(tl.maximum(v.to(tl.float32) / v_scale, -448.0), 448.0))
    tl.store(key_cache_ptr + cache_off, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + cache_off, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
             value_cache: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Write key/value [T, num_kv_heads, head_dim] into the caches at slot_mapping [T] (-1 = skip),
    cast to the cache dtype (fp8: module docstring). No allocation and no host sync: safe inside
    a CUDA graph."""
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape, f"value {tuple(value.shape)} != key {tuple(key.shape)}"
    assert key.dtype == value.dtype and key.dtype in (torch.float16, torch.bfloat16, torch.float32)
    assert key.stride(2) == 1 and value.stride(2) == 1, "head_dim must be contiguous"
    assert key_cache.shape == value_cache.shape and key_cache.dim() == 4
    assert key_cache.shape[2:] == (num_kv_heads, head_dim), (
        f"cache {tuple(key_cache.shape)} does not hold {num_kv_heads} heads x {head_dim}")
    assert key_cache.dtype == value_cache.dtype and key_cache.dtype in KV_DTYPES
    assert key_cache.stride() == value_cache.stride() and key_cache.stride(3) == 1
    assert slot_mapping.dtype == torch.int64 and slot_mapping.shape == (num_tokens,)
    assert slot_mapping.is_contiguous()
    if num_tokens == 0:
        return
    quantize = key_cache.dtype == torch.float8_e4m3fn
    _store_kv_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        float(k_scale), float(v_scale),
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        num_kv_heads, head_dim,
        BLOCK_SIZE=key_cache.shape[1],
        KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        QUANTIZE=quantize,
        num_warps=4,
    )
