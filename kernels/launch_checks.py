"""Launcher checks shared by the paged attention kernels: dtypes, shapes and strides."""
from __future__ import annotations

import torch

# Cache dtypes the kernels read and write. fp8 is e4m3 (the "fn" variant: no infinities).
KV_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn)


def check_paged_inputs(query, key_cache, value_cache, block_tables, seq_lens,
                       out: torch.Tensor | None) -> torch.Tensor:
    """-> the output: `out`, checked, or a new tensor like the query."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, cache_head_dim = key_cache.shape[2], key_cache.shape[3]
    assert query.dtype in (torch.float16, torch.bfloat16, torch.float32), query.dtype
    assert query.stride(2) == 1, "query head_dim must be contiguous"
    assert head_dim >= 16 and cache_head_dim == head_dim, (head_dim, cache_head_dim)
    assert num_heads % num_kv_heads == 0, f"{num_heads} heads over {num_kv_heads} kv heads"
    assert value_cache.shape == key_cache.shape and value_cache.dtype == key_cache.dtype
    assert key_cache.dtype in KV_DTYPES, key_cache.dtype
    assert key_cache.stride() == value_cache.stride() and key_cache.stride(3) == 1
    assert block_tables.dtype == torch.int32 and block_tables.dim() == 2
    assert block_tables.shape[0] == seq_lens.shape[0] and block_tables.stride(1) == 1
    assert seq_lens.dtype == torch.int32 and seq_lens.is_contiguous()
    out = torch.empty_like(query) if out is None else out
    assert out.shape == query.shape and out.dtype == query.dtype and out.stride(2) == 1
    return out
