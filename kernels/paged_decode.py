"""Paged decode attention: one new token per sequence over its whole cached context.

Work split (grid = [num_seqs, num_kv_heads, num_splits]):

    program (b, kv_head, split)
      Q tile  : the GROUP query heads that share kv_head, padded to GROUP_ROWS >= 16 rows so
                tl.dot runs on tensor cores        # [GROUP_ROWS, HEAD_DIM_PAD]
      KV tiles: BLOCK_N context positions at a time, each loaded once for the whole group;
                the pages come from a vector of block-table entries (one per position), so
                BLOCK_N does not depend on the page size (8, 16, 32 ... all work)
      context : |--- split 0 ---|--- split 1 ---| ... |-- split S-1 --|   (whole tiles each)

Online softmax in fp32 with exp2: scores are multiplied by scale * k_scale * log2(e) once, so
the running max/sum live in the log2 domain. v_scale is applied once to the final output.

An fp8 cache under 16-bit queries (head dim <= 128) is widened to fp16, not to the query's
dtype: e4m3 -> fp16 is exact and one hardware conversion per pair on sm_89+ (bf16 was slower).
The query goes to fp16 once, divided by 16 (|q| up to ~1e6 fits); qk_scale puts the 16 back.

Split-K: with few (sequence, kv_head) programs the GPU idles, so each context is cut into
num_splits segments (a runtime argument, not a constexpr: every split count shares one compiled
kernel, instead of up to MAX_SPLITS JIT compiles per dtype as batch sizes vary); each writes a
normalised partial output and its log2-sum-exp into a preallocated workspace, and _merge_kernel
combines them. No allocation and no host sync happen when `out` and `workspace` are given, so
the path can be captured in a CUDA graph.
Correctness never depends on num_splits: segments are computed in the kernel from seq_len.

Static tile rule: decode_tiles (no autotuning). Split rule: choose_num_splits, about two
programs per SM, each split streaming >= MIN_SPLIT_TOKENS positions.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .launch_checks import check_paged_inputs
from .numerics import LOG2E

MAX_SPLITS = 16          # workspace depth and the most splits the rule picks (untuned guess)
MIN_SPLIT_TOKENS = 256   # a split should stream at least this many positions (untuned guess)


@triton.jit(do_not_specialize=["num_splits"])
def _paged_decode_kernel(
    q_ptr,                 # [B, num_heads, head_dim] one new token per sequence
    k_cache_ptr, v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,      # [B, max_blocks] int32
    seq_lens_ptr,          # [B] int32 context length incl. the new token; 0 = padding row
    out_ptr,               # [B, num_heads, head_dim]  written when not SPLIT
    part_out_ptr,          # [>=B, num_heads, >=num_splits, head_dim] fp32, when SPLIT
    part_lse_ptr,          # [>=B, num_heads, >=num_splits] fp32 log2-sum-exp of each split
    qk_scale,              # softmax scale * k_scale * log2(e) (x 16 under FP8_AS_FP16)
    out_scale,             # v_scale (1.0 unless the cache is fp8)
    stride_qb, stride_qh,
    stride_ob, stride_oh,
    stride_cb, stride_cs, stride_ch,  # cache strides (block, slot, kv head); head_dim stride 1
    stride_bt,             # block table row stride
    stride_pb, stride_ph, stride_ps,  # part_out strides (batch, head, split)
    stride_lb, stride_lh,  # part_lse strides (batch, head); split stride 1
    group_size, head_dim,
    num_splits,            # context segments per sequence (grid axis 2)
    BLOCK_SIZE: tl.constexpr,    # tokens per page
    BLOCK_N: tl.constexpr,       # context positions per KV tile
    GROUP_ROWS: tl.constexpr,    # query rows per program: GQA group padded to >= 16
    HEAD_DIM_PAD: tl.constexpr,  # next_power_of_2(head_dim)
    SPLIT: tl.constexpr,         # num_splits > 1: write partials; else write out directly
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 queries (exact fp32 dots); "tf32" (Triton's
                                  # default on NVIDIA) otherwise, where 16-bit operands ignore it
    FP8_AS_FP16: tl.constexpr,   # fp8 cache, 16-bit queries: dots in fp16 (module docstring)
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + b)
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)  # may be <= tile_lo: empty split

    rows = tl.arange(0, GROUP_ROWS)
    dims = tl.arange(0, HEAD_DIM_PAD)
    heads = kv_head * group_size + rows  # query heads of this GQA group
    row_mask = rows < group_size
    dim_mask = dims < head_dim
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + dims[None, :],
                mask=row_mask[:, None] & dim_mask[None, :], other=0.0)  # [GROUP_ROWS, D]
    if FP8_AS_FP16:  # / 16: |q| up to ~1e6 fits fp16 (score_scale puts the 16 back)
        q = (q.to(tl.float32) * 0.0625).to(tl.float16)

    m_i = tl.full([GROUP_ROWS], float("-inf"), tl.float32)  # running max (log2 domain)
    l_i = tl.zeros([GROUP_ROWS], tl.float32)                # running sum of exp2
    acc = tl.zeros([GROUP_ROWS, HEAD_DIM_PAD], tl.float32)
    table = block_tables_ptr + b * stride_bt
    for tile in range(tile_lo, tile_hi):
        pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        pos_mask = pos < seq_len
        page = tl.load(table + pos // BLOCK_SIZE, mask=pos_mask, other=0).to(tl.int64)
        kv_off = page * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch  # [N]
        kv_mask = pos_mask[:, None] & dim_mask[None, :]
        # K is read transposed ([D, N]) so the dot needs no tl.trans.
        k = tl.load(k_cache_ptr + kv_off[None, :] + dims[:, None],
                    mask=dim_mask[:, None] & pos_mask[None, :], other=0.0)
        s = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION) * qk_scale  # [G, N]
        s = tl.where(pos_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every tile holds >= 1 valid position
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype),
                                            input_precision=DOT_PRECISION)
        m_i = m_new

    # Padding rows (seq_len 0) and empty splits have l_i == 0: they produce zeros / lse -inf.
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    store_mask = row_mask[:, None] & dim_mask[None, :]
    if not SPLIT:
        o = o * out_scale
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + dims[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        lse = tl.where(l_i > 0, m_i + tl.math.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(part_out_ptr + b * stride_pb + heads[:, None] * stride_ph + split * stride_ps
                 + dims[None, :], o, mask=store_mask)
        tl.store(part_lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=row_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_kernel(
    out_ptr,               # [B, num_heads, head_dim]
    part_out_ptr,          # [>=B, num_heads, >=num_splits, head_dim] fp32 normalised partials
    part_lse_ptr,          # [>=B, num_heads, >=num_splits] fp32, -inf for empty splits
    out_scale,             # v_scale
    stride_ob, stride_oh,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    head_dim,
    num_splits,
    SPLITS_PAD: tl.constexpr,    # next_power_of_2(num_splits)
    HEAD_DIM_PAD: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    split_mask = splits < num_splits
    dim_mask = dims < head_dim
    lse = tl.load(part_lse_ptr + b * stride_lb + head * stride_lh + splits,
                  mask=split_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # all splits empty (padding row): weights all 0
    w = tl.math.exp2(lse - m)  # [SPLITS_PAD]
    parts = tl.load(part_out_ptr + b * stride_pb + head * stride_ph + splits[:, None] * stride_ps
                    + dims[None, :], mask=split_mask[:, None] & dim_mask[None, :], other=0.0)
    w_sum = tl.sum(w, 0)
    o = tl.sum(parts * w[:, None], 0) / tl.where(w_sum > 0, w_sum, 1.0) * out_scale
    tl.store(out_ptr + b * stride_ob + head * stride_oh + dims, o.to(out_ptr.dtype.element_ty),
             mask=dim_mask)


@dataclass(frozen=True)
class DecodeWorkspace:
    """Split-K scratch, allocated once for the largest batch and reused by every decode step."""

    part_out: torch.Tensor  # [max_batch, num_heads, max_splits, head_dim] fp32
    part_lse: torch.Tensor  # [max_batch, num_heads, max_splits] fp32

    @classmethod
    def allocate(cls, max_batch: int, num_heads: int, head_dim: int,
                 device: torch.device | str, max_splits: int = MAX_SPLITS) -> "DecodeWorkspace":
        part_out = torch.empty(max_batch, num_heads, max_splits, head_dim, dtype=torch.float32,
                               device=device)
        return cls(part_out, torch.empty(part_out.shape[:3], dtype=torch.float32, device=device))

    @property
    def max_batch(self) -> int:
        return self.part_out.shape[0]

    def fits(self, batch: int, num_heads: int, head_dim: int, num_splits: int) -> bool:
        return (batch <= self.max_batch and num_splits <= self.part_out.shape[2]
                and self.part_out.shape[1] == num_heads and self.part_out.shape[3] == head_dim)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """The split rule (module docstring). Host integers only, so a CUDA graph captured for a
    batch size (with a fixed max_seq_len, e.g. max_model_len) keeps a valid choice at replay."""
    programs = max(1, num_seqs * num_kv_heads)
    want = triton.cdiv(2 * num_sms, programs)
    worth = triton.cdiv(max(1, max_seq_len), MIN_SPLIT_TOKENS)
    return max(1, min(want, worth, MAX_SPLITS))


def paged_launch_args(query: torch.Tensor, key_cache: torch.Tensor, block_tables: torch.Tensor,
                      out: torch.Tensor, scale: float, k_scale: float, v_scale: float
                      ) -> tuple[tuple, dict]:
    """The arguments paged decode and paged prefill launch with alike: (qk_scale, out_scale, the
    query, output, cache and block-table strides) and the constexprs BLOCK_SIZE, DOT_PRECISION
    and FP8_AS_FP16 (module docstring; up to head dim 128, where it was measured). qk_scale
    folds every factor of the scores into one host float: other forms made split decode spill
    at head dim 256 on sm_90."""
    fp8_fp16 = (key_cache.dtype.itemsize == 1 and query.dtype.itemsize == 2
                and query.shape[2] <= 128)
    score_scale = float(scale * k_scale * LOG2E * (16.0 if fp8_fp16 else 1.0))  # qk_scale
    strides = (query.stride(0), query.stride(1), out.stride(0), out.stride(1),
               key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
               block_tables.stride(0))
    return (score_scale, float(v_scale), *strides), dict(
        BLOCK_SIZE=key_cache.shape[1], FP8_AS_FP16=fp8_fp16,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32")


def decode_tiles(group: int, head_dim: int, query_dtype: torch.dtype) -> dict:
    """The static tile rule as the decode kernel's launch options. fp32 queries: dots on FMA
    units, not tensor cores, where fewer warps or more keys spilled registers on sm_80-sm_90
    (benchmarks/kernel_resources.py)."""
    fp32 = query_dtype == torch.float32
    return dict(BLOCK_N=64 if head_dim <= 128 and not fp32 else 32,
                GROUP_ROWS=max(16, triton.next_power_of_2(group)),
                HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
                num_warps=8 if fp32 else 4)


def paged_decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                 k_scale: float = 1.0, v_scale: float = 1.0, *, num_splits: int = 1,
                 workspace: DecodeWorkspace | None = None,
                 out: torch.Tensor | None = None, tiles: dict | None = None) -> torch.Tensor:
    """Attention of query [B, num_heads, head_dim] (one token per sequence) over the paged cache.

    key_cache/value_cache: [num_blocks, block_size, num_kv_heads, head_dim] (fp8: value/scale).
    block_tables: [B, max_blocks] int32. seq_lens: [B] int32, 0 for padding rows (output 0).
    num_splits > 1 needs a workspace (allocated here if None: not CUDA-graph safe).
    Returns out [B, num_heads, head_dim] in query's dtype.
    tiles: launch options in place of decode_tiles' (benchmarks/kernel_bench.py sweeps them).
    """
    batch, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    out = check_paged_inputs(query, key_cache, value_cache, block_tables, seq_lens, out)
    assert seq_lens.shape == (batch,), seq_lens.shape
    assert 1 <= num_splits
    if batch == 0:
        return out
    group = num_heads // num_kv_heads
    if num_splits > 1:
        if workspace is None:
            workspace = DecodeWorkspace.allocate(batch, num_heads, head_dim, query.device,
                                                 max_splits=num_splits)
        assert workspace.fits(batch, num_heads, head_dim, num_splits), "workspace too small"
        assert workspace.part_out.stride(3) == 1 and workspace.part_lse.stride(2) == 1
        part_out, part_lse = workspace.part_out, workspace.part_lse
        p_strides, l_strides = part_out.stride()[:3], part_lse.stride()[:2]
    else:  # unused when num_splits == 1; any pointer will do
        part_out, part_lse, p_strides, l_strides = out, seq_lens, (0, 0, 0), (0, 0)

    args, consts = paged_launch_args(query, key_cache, block_tables, out, scale, k_scale, v_scale)
    _paged_decode_kernel[(batch, num_kv_heads, num_splits)](
        query, key_cache, value_cache, block_tables, seq_lens, out, part_out, part_lse, *args,
        *p_strides, *l_strides, group, head_dim, num_splits,
        SPLIT=num_splits > 1,
        **consts,
        **(tiles or decode_tiles(group, head_dim, query.dtype)),
    )
    if num_splits > 1:
        _merge_kernel[(batch, num_heads)](
            out, part_out, part_lse, float(v_scale),
            out.stride(0), out.stride(1), *p_strides, *l_strides, head_dim, num_splits,
            SPLITS_PAD=triton.next_power_of_2(num_splits),
            HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
            num_warps=4,
        )
    return out
