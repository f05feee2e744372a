"""Torch references for the kernels (kernels/): slow, obvious, fp32 inside. Tests
(tests/kernels, tests/gpu) and benchmarks/kernel_bench.py compare against these; nothing on the
serving path calls them, so they live here, beside the benchmarks, not in the library. Only torch:
this loads on a bare GPU box too.

Layout (same as raypaged.model.attention.base):
    caches      [num_blocks, block_size, num_kv_heads, head_dim]   (fp8 caches hold value / scale)
    query       [T, num_heads, head_dim], sequence b owns rows query_start_loc[b] : [b+1]
    seq_lens    [B] cached + new tokens; the new tokens are the last query_len positions
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448.0, as kernels/numerics.py


def store_kv_ref(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """In-place scatter of key/value [T, kv_heads, head_dim] by slot (-1 = skip)."""
    block_size = key_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // block_size, slots % block_size
    for new, cache, scale in ((key, key_cache, k_scale), (value, value_cache, v_scale)):
        rows = new[keep].float()
        if cache.dtype == torch.float8_e4m3fn:
            rows = (rows / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
        cache[blocks, offsets] = rows.to(cache.dtype)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int,
              scale: float = 1.0) -> torch.Tensor:
    """One sequence's first seq_len positions as fp32 [seq_len, kv_heads, head_dim], dequantized."""
    block_size = cache.shape[1]
    pos = torch.arange(seq_len, device=cache.device)
    blocks = block_table.long()[pos // block_size]
    return cache[blocks, pos % block_size].float() * scale


def paged_attention_ref(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                        block_tables: torch.Tensor, scale: float,
                        k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Causal attention of every new token over its sequence's cache (prefix + new tokens).

    Covers decode (query_len 1) and prefill/extend alike. Rows of sequences with seq_len 0
    (padding) come out as zeros. Returns [T, num_heads, head_dim] in query's dtype.
    """
    num_heads = query.shape[1]
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros_like(query, dtype=torch.float32)
    starts = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        q_start, q_end = starts[b], starts[b + 1]
        query_len = q_end - q_start
        if seq_len == 0 or query_len == 0:
            continue
        k = gather_kv(key_cache, block_tables[b], seq_len, k_scale)    # [S, kv_heads, D]
        v = gather_kv(value_cache, block_tables[b], seq_len, v_scale)  # [S, kv_heads, D]
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)          # [heads, S, D]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)          # [heads, S, D]
        q = query[q_start:q_end].float().transpose(0, 1)               # [heads, Q, D]
        scores = q @ k.transpose(1, 2) * scale                         # [heads, Q, S]
        q_pos = torch.arange(seq_len - query_len, seq_len, device=query.device)
        k_pos = torch.arange(seq_len, device=query.device)
        scores = scores.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        out[q_start:q_end] = (scores.softmax(-1) @ v).transpose(0, 1)
    return out.to(query.dtype)


@dataclass
class PagedBatch:
    """A random batch laid out the way the engine lays it out, for tests and benchmarks."""

    query: torch.Tensor            # [T, num_heads, head_dim]
    key_cache: torch.Tensor        # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor
    block_tables: torch.Tensor     # [B, max_blocks] int32, pages in random order, unused 0
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor         # [B] int32
    slot_mapping: torch.Tensor     # [T] int64 slots of the new tokens (-1 for padding rows)
    max_query_len: int
    k_scale: float = 1.0
    v_scale: float = 1.0


def make_paged_batch(context_lens: list[int], query_lens: list[int], num_heads: int,
                     num_kv_heads: int, head_dim: int, block_size: int,
                     dtype: torch.dtype, kv_dtype: torch.dtype | None = None,
                     device: str | torch.device = "cpu", num_padding: int = 0,
                     spare_blocks: int = 3, seed: int = 0) -> PagedBatch:
    """Sequence b has context_lens[b] cached + query_lens[b] new positions, all filled with random
    K/V already (as after store_kv). num_padding sequences are appended the way CUDA-graph
    buckets pad a decode batch: one query row each, seq_len 0, slot -1, block table row 0.
    fp8 caches get scales that map the random values (|x| < ~5) well inside e4m3's range.
    """
    assert len(context_lens) == len(query_lens)
    context_lens = list(context_lens) + [0] * num_padding
    query_lens = list(query_lens) + [1] * num_padding
    padding = [False] * (len(context_lens) - num_padding) + [True] * num_padding
    gen = torch.Generator(device="cpu").manual_seed(seed)
    kv_dtype = kv_dtype or dtype
    seq_lens = [0 if pad else c + q for c, q, pad in zip(context_lens, query_lens, padding)]
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    order = torch.randperm(num_blocks, generator=gen).tolist()  # scattered pages
    table = torch.zeros(len(seq_lens), max(1, max(blocks_per_seq)), dtype=torch.int32)
    next_block = 0
    for b, n in enumerate(blocks_per_seq):
        table[b, :n] = torch.tensor(order[next_block:next_block + n], dtype=torch.int32)
        next_block += n
    slots = []
    for b, (c, q) in enumerate(zip(context_lens, query_lens)):
        for p in range(c, c + q):
            page = int(table[b, p // block_size]) if not padding[b] else -1
            slots.append(page * block_size + p % block_size if page >= 0 else -1)
    k_scale = v_scale = 1.0
    if kv_dtype == torch.float8_e4m3fn:
        k_scale, v_scale = 5.0 / FP8_E4M3_MAX, 4.0 / FP8_E4M3_MAX
    # Big tensors are drawn on the target device (benchmark caches are GiBs).
    dev_gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        x = torch.randn(shape, generator=dev_gen, device=device)
        return (x / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX) if scale != 1.0 else x

    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    num_tokens = sum(query_lens)
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    return PagedBatch(
        query=randn(num_tokens, num_heads, head_dim).to(dtype),
        key_cache=randn(*shape, scale=k_scale).to(kv_dtype),
        value_cache=randn(*shape, scale=v_scale).to(kv_dtype),
        block_tables=table.to(device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=max(query_lens, default=0),
        k_scale=k_scale, v_scale=v_scale,
    )
