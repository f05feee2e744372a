"""store_kv against its torch reference: exact bytes in the cache, padding slots untouched."""
from __future__ import annotations

import pytest
import torch

from benchmarks.kernel_reference import FP8_E4M3_MAX, store_kv_ref
from raypaged.kernels.store_kv import store_kv

NUM_BLOCKS = 12


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def packed_kv(num_tokens: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
              seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V as the model hands them over: strided views into one fused qkv projection."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(num_tokens, (2 + 2 * num_kv_heads) * head_dim, generator=gen) * 2
    qkv = qkv.to(dtype)
    k, v = qkv[:, 2 * head_dim:].split(num_kv_heads * head_dim, dim=1)
    return k.view(num_tokens, num_kv_heads, head_dim), v.view(num_tokens, num_kv_heads, head_dim)


@pytest.mark.parametrize("dtype,cache_dtype,block_size,num_kv_heads,head_dim", [
    (torch.float16, torch.float16, 8, 1, 64),
    (torch.float32, torch.float32, 16, 2, 128),
    (torch.bfloat16, torch.bfloat16, 32, 3, 64),
    (torch.float16, torch.float8_e4m3fn, 16, 8, 64),
    (torch.float32, torch.float8_e4m3fn, 8, 2, 128),
])
def test_store_kv_writes_the_same_bytes_as_the_reference(dtype, cache_dtype, block_size,
                                                         num_kv_heads, head_dim):
    k, v = packed_kv(9, num_kv_heads, head_dim, dtype, seed=block_size)
    # Slots across pages, out of order, a page's first and last slot, and padding (-1).
    last = NUM_BLOCKS * block_size - 1
    slots = torch.tensor([5, -1, last, block_size, 3 * block_size - 1, -1, 0, 2 * block_size + 1,
                          last - block_size], dtype=torch.int64)
    scales = (0.011, 0.007) if cache_dtype == torch.float8_e4m3fn else (1.0, 1.0)
    shape = (NUM_BLOCKS, block_size, num_kv_heads, head_dim)
    # A sentinel everywhere, so a stray write (or a write of a padding row) shows.
    key_cache = torch.full(shape, 3.0).to(cache_dtype)
    value_cache = torch.full(shape, -3.0).to(cache_dtype)
    ref_k, ref_v = key_cache.clone(), value_cache.clone()

    store_kv(k, v, key_cache, value_cache, slots, *scales)
    store_kv_ref(k, v, ref_k, ref_v, slots, *scales)

    assert same_bytes(key_cache, ref_k)
    assert same_bytes(value_cache, ref_v)


def test_fp8_store_rounds_to_nearest_even_and_saturates_like_torch():
    # Every positive e4m3 value, the midpoints between neighbours (ties), and one fp32 ulp to
    # either side of each midpoint; plus values past the range, which must clamp to +-448.
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
    mid = (grid[1:] + grid[:-1]) / 2
    values = torch.cat([grid, mid, mid.nextafter(torch.tensor(0.0)),
                        mid.nextafter(torch.tensor(1e9)), torch.tensor([449.0, 500.0, 1e6])])
    values = torch.cat([values, -values])
    head_dim = 64
    values = torch.cat([values, values.new_zeros(-len(values) % head_dim)])
    rows = values.view(-1, 1, head_dim)  # [T, 1 kv head, 64]
    slots = torch.arange(rows.shape[0], dtype=torch.int64)
    shape = (rows.shape[0], 1, 1, head_dim)  # block_size 1: slot t = block t
    key_cache = torch.zeros(shape, dtype=torch.float8_e4m3fn)
    value_cache = torch.zeros(shape, dtype=torch.float8_e4m3fn)

    store_kv(rows, rows, key_cache, value_cache, slots, 1.0, 0.5)

    expected_k = rows.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    expected_v = (rows / 0.5).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    assert same_bytes(key_cache.view(rows.shape), expected_k)
    assert same_bytes(value_cache.view(rows.shape), expected_v)


def test_store_kv_of_an_all_padding_step_changes_nothing():
    k, v = packed_kv(4, 2, 64, torch.float16, seed=1)
    key_cache = torch.ones(4, 16, 2, 64, dtype=torch.float16)
    value_cache = torch.ones(4, 16, 2, 64, dtype=torch.float16)
    store_kv(k, v, key_cache, value_cache, torch.full((4,), -1, dtype=torch.int64))
    assert bool((key_cache == 1).all()) and bool((value_cache == 1).all())
