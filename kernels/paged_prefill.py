"""Paged prefill / extend attention: the new tokens of each request attend to the request's
cached prefix (through the block table) and causally to themselves. One launch serves any mix
of requests: a decode row is simply a request with query_len 1.

Grid = [cdiv(max_query_len, BLOCK_M), num_seqs, num_kv_heads]. Program (tile, b, kv_head) owns
BLOCK_M new tokens x the GQA group's query heads, flattened into one query tile:

    row r  ->  token  tile * BLOCK_M + r // GROUP_PAD,  head  kv_head * group + r % GROUP_PAD
    rows = BLOCK_M * GROUP_PAD           # [ROWS, HEAD_DIM_PAD]; padded heads/tokens masked

Key positions it visits (absolute, context_len = seq_len - query_len):

    0 ........................ full_end ............. kv_end
    |  every row sees all: no mask |  diagonal: causal mask |  (beyond: skipped, never loaded)
    full_end = position of the tile's first token + 1, rounded down to BLOCK_N
    kv_end   = position of the tile's last token + 1

Tiles of a request past its query_len do no work. Online softmax in fp32 with exp2 (scale *
k_scale * log2(e) folded into the scores); v_scale applied once at the output. An fp8 cache under
16-bit queries is widened to fp16 up to head dim 128, as in paged_decode (which says why).

Static tile rule (no autotuning; prefill_tiles, which says why): each choice is the fastest tile
measured that ptxas compiles without spilling on sm_80, sm_89 and sm_90
(benchmarks/kernel_resources.py, benchmarks/kernel_builds/compile_check.py; timings:
benchmarks/results/kernels_nvidia_h200.json).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch_checks import check_paged_inputs
from .paged_decode import paged_launch_args


@triton.jit
def _attend_kv_tile(
    q, acc, m_i, l_i,           # query tile [ROWS, D] and the running softmax state
    start,                      # first absolute key position of this tile
    k_cache_ptr, v_cache_ptr, table_ptr,  # caches and this sequence's block-table row
    seq_len, q_pos,             # keys < seq_len exist; row i may see keys <= q_pos[i]
    kv_head, stride_cb, stride_cs, stride_ch,
    dims, dim_mask, qk_scale,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL_MASK: tl.constexpr,  # False when every row sees every key of the tile
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 queries, "tf32" (the default) otherwise
):
    pos = start + tl.arange(0, BLOCK_N)
    pos_mask = pos < seq_len
    page = tl.load(table_ptr + pos // BLOCK_SIZE, mask=pos_mask, other=0).to(tl.int64)
    kv_off = page * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch  # [N]
    k = tl.load(k_cache_ptr + kv_off[None, :] + dims[:, None],
                mask=dim_mask[:, None] & pos_mask[None, :], other=0.0)  # [D, N]
    s = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION) * qk_scale  # [ROWS, N]
    if CAUSAL_MASK:
        s = tl.where((pos[None, :] <= q_pos[:, None]) & pos_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row with nothing visible yet keeps m = -inf; shift by 0 instead so exp2 gives 0, not NaN.
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_shift[:, None])
    alpha = tl.math.exp2(m_i - m_shift)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_cache_ptr + kv_off[:, None] + dims[None, :],
                mask=pos_mask[:, None] & dim_mask[None, :], other=0.0)  # [N, D]
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype),
                                        input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _paged_prefill_kernel(
    q_ptr,                 # [T, num_heads, head_dim] new tokens of all sequences, flattened
    k_cache_ptr, v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,      # [B, max_blocks] int32
    query_start_loc_ptr,   # [B + 1] int32
    seq_lens_ptr,          # [B] int32 cached + new tokens
    out_ptr,               # [T, num_heads, head_dim]
    qk_scale,              # softmax scale * k_scale * log2(e) (x 16 under FP8_AS_FP16)
    out_scale,             # v_scale
    stride_qt, stride_qh,
    stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch,
    stride_bt,
    group_size, head_dim,
    BLOCK_SIZE: tl.constexpr,    # tokens per page
    BLOCK_M: tl.constexpr,       # new tokens per program
    GROUP_PAD: tl.constexpr,     # next_power_of_2(group_size)
    BLOCK_N: tl.constexpr,       # key positions per KV tile
    HEAD_DIM_PAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 queries, "tf32" (the default) otherwise
    FP8_AS_FP16: tl.constexpr,   # fp8 cache, 16-bit queries: dots in fp16
):
    tile = tl.program_id(0)
    b = tl.program_id(1)
    kv_head = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + b)
    query_len = tl.load(query_start_loc_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)
    context_len = seq_len - query_len

    rows = tl.arange(0, BLOCK_M * GROUP_PAD)
    tok = tile * BLOCK_M + rows // GROUP_PAD  # token index within the request's new tokens
    g = rows % GROUP_PAD
    heads = kv_head * group_size + g
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < head_dim
    row_mask = (tok < query_len) & (g < group_size)
    q_pos = context_len + tok  # absolute position of each row's token
    q_off = (q_start + tok)[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :]
    io_mask = row_mask[:, None] & dim_mask[None, :]
    q = tl.load(q_ptr + q_off, mask=io_mask, other=0.0)  # [ROWS, D]
    if FP8_AS_FP16:  # / 16: |q| up to ~1e6 fits fp16 (score_scale puts the 16 back)
        q = (q.to(tl.float32) * 0.0625).to(tl.float16)

    first_tok = tile * BLOCK_M
    last_tok = tl.minimum(first_tok + BLOCK_M, query_len) - 1
    active = first_tok < query_len
    kv_end = tl.where(active, context_len + last_tok + 1, 0)
    full_end = tl.where(active, tl.maximum(context_len + first_tok + 1, 0) // BLOCK_N * BLOCK_N, 0)

    m_i = tl.full([BLOCK_M * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_M * GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    table = block_tables_ptr + b * stride_bt
    for start in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_kv_tile(
            q, acc, m_i, l_i, start, k_cache_ptr, v_cache_ptr, table, seq_len, q_pos, kv_head,
            stride_cb, stride_cs, stride_ch, dims, dim_mask, qk_scale,
            BLOCK_SIZE, BLOCK_N, False, DOT_PRECISION)
    for start in range(full_end, kv_end, BLOCK_N):
        acc, m_i, l_i = _attend_kv_tile(
            q, acc, m_i, l_i, start, k_cache_ptr, v_cache_ptr, table, seq_len, q_pos, kv_head,
            stride_cb, stride_cs, stride_ch, dims, dim_mask, qk_scale,
            BLOCK_SIZE, BLOCK_N, True, DOT_PRECISION)

    # Rows that saw nothing (padding: seq_len 0) have l_i == 0 and come out as zeros.
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None] * out_scale
    o_off = (q_start + tok)[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :]
    tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=io_mask)


def prefill_tiles(group: int, head_dim: int, query_dtype: torch.dtype,
                  cache_dtype: torch.dtype, block_size: int = 16) -> dict:
    """The static tile rule as the prefill kernel's launch options (each branch says why)."""
    group_pad = triton.next_power_of_2(group)
    head_dim_pad = triton.next_power_of_2(head_dim)
    num_stages = 3  # Triton's default: two KV tiles in flight while one is used
    if query_dtype == torch.float32:
        # FMA-unit dots; these spilled: 64 rows, 32 keys at head dim 128 (some block size /
        # group mixes), two tiles in flight (with 16 keys) or 4 warps at 256
        rows, num_warps = 16, 8
        block_n = 16 if head_dim_pad == 128 else 32
        num_stages = 2 if head_dim_pad > 128 else 3
    elif head_dim == 128 and cache_dtype.itemsize == 2 and block_size <= 16:
        # the fastest on an H200; it spills with pages of 32 on sm_80, an fp8 cache on sm_89
        rows, num_warps, block_n = 128, 8, 64
    else:
        # 8 warps from head dim 128: the fp32 accumulator and Q tile outgrow 255 registers a
        # thread at 4; 16 fp8 keys above 128: sm_89 widens fp8 K/V tiles to 16 bits in registers
        rows, num_warps = 64, 4 if head_dim_pad <= 64 else 8
        block_n = 64 if head_dim_pad <= 128 else 16 if cache_dtype.itemsize == 1 else 32
    return dict(BLOCK_M=max(1, rows // group_pad), GROUP_PAD=group_pad, BLOCK_N=block_n,
                HEAD_DIM_PAD=head_dim_pad, num_warps=num_warps, num_stages=num_stages)


def paged_prefill(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                  block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                  seq_lens: torch.Tensor, max_query_len: int, scale: float,
                  k_scale: float = 1.0, v_scale: float = 1.0, *,
                  out: torch.Tensor | None = None, tiles: dict | None = None) -> torch.Tensor:
    """Causal attention of query [T, num_heads, head_dim] over cached prefix + new tokens.

    Sequence b owns query rows query_start_loc[b] : query_start_loc[b + 1] ([B + 1] int32) and
    has seq_lens[b] ([B] int32) positions in the cache after this step, new K/V already written.
    max_query_len (host int) sizes the grid, so the launch needs no device sync.
    Returns out [T, num_heads, head_dim] in query's dtype; rows of seq_len-0 sequences are 0.
    tiles: launch options in place of prefill_tiles' (benchmarks/kernel_bench.py sweeps them).
    """
    num_tokens, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, cache_head_dim = key_cache.shape
    num_seqs = seq_lens.shape[0]
    out = check_paged_inputs(query, key_cache, value_cache, block_tables, seq_lens, out)
    assert query_start_loc.dtype == torch.int32 and query_start_loc.shape == (num_seqs + 1,)
    assert query_start_loc.is_contiguous()
    if num_tokens == 0 or num_seqs == 0 or max_query_len == 0:
        return out
    group = num_heads // num_kv_heads
    tiles = tiles or prefill_tiles(group, head_dim, query.dtype, key_cache.dtype, block_size)
    args, consts = paged_launch_args(query, key_cache, block_tables, out, scale, k_scale, v_scale)
    grid = (triton.cdiv(max_query_len, tiles["BLOCK_M"]), num_seqs, num_kv_heads)
    _paged_prefill_kernel[grid](
        query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, out, *args,
        group, head_dim,
        **consts,
        **tiles,
    )
    return out
