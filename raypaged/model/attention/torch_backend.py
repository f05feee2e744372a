"""Paged attention in plain torch: the CPU production path and the reference for the Triton kernels.

A step's sequences are split by query length:
  - decode rows (query_len == 1) are attended together: gather each sequence's blocks into a
    padded [B, L, Hkv, D], then one masked SDPA call with queries grouped as [B, Hkv, G, D], so
    grouped-query attention never copies K/V per query head;
  - prefill chunks (query_len > 1) go one sequence at a time through SDPA, with a causal mask
    shifted by the cached prefix:

        keys     0 ......... ctx-1 | ctx ......... seq_len-1
        query i  sees all of these | up to and including ctx+i     (ctx = seq_len - query_len)

Blocks are gathered with index_select (several times faster on CPU than advanced indexing).
Given a `decode_kernel` (on CPUs, the C++ kernel of raypaged.kernels.cpu_paged_decode), decode
rows skip the gather and the padded SDPA: the kernel reads each sequence's blocks in place.
Given a `prefill_kernel` (bf16 on CPUs with AVX512-BF16, cpu_paged_decode.paged_prefill),
prefill chunks skip the gather and SDPA likewise (torch's CPU SDPA computes in fp32).
Given a `store_kernel` (cpu_paged_decode.store_kv), write_kv is one call per layer for a cache in
the model's dtype (not two index_copy_ calls and a row selection).
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Callable

import torch
import torch.nn.functional as F

from raypaged.kernels.numerics import FP8_E4M3_MAX
from raypaged.model.attention.base import AttentionMetadata, LayerKVCache


@dataclass
class _DecodePlan:
    """What every layer's decode attention shares within one step (only block ids and lengths)."""
    seqs: list[int]               # sequences with query_len 1
    rows: torch.Tensor | None     # [n] their query rows; None: sequence b at row b, b < n
    block_tables: torch.Tensor    # [n, max_blocks] int32, contiguous (the kernel's input)
    seq_lens: torch.Tensor        # [n] int32, contiguous
    # The gather + SDPA path's (None when a decode kernel reads the cache in place):
    blocks: torch.Tensor | None   # [n * num_blocks] int64 block ids, sequence-major
    length: int                   # L = num_blocks * block_size, the padded key length
    visible: torch.Tensor | None  # [n, 1, 1, L] bool, key position < seq_len


@dataclass
class _StepPlan:
    """Built once per step (per AttentionMetadata object) and reused by all layers, so the
    per-layer work is the attention itself, not 30 rebuilds of masks and index lists."""
    valid_rows: torch.Tensor | None  # rows of new K/V with a slot; None: all of them
    slots: torch.Tensor              # [rows written] slot per written row
    starts: list[int]                # first query row of each sequence
    prefill: list[int]               # sequences with query_len > 1
    decode: _DecodePlan | None
    covers_all_rows: bool            # decode rows are exactly 0..T-1: no zero-filled output


# Called as raypaged.kernels.cpu_paged_decode.paged_decode, .paged_prefill and .store_kv
DecodeKernel = PrefillKernel = Callable[..., torch.Tensor]
StoreKernel = Callable[..., None]


class TorchAttentionBackend:
    name = "torch"

    def __init__(self, decode_kernel: DecodeKernel | None = None,
                 prefill_kernel: PrefillKernel | None = None,
                 store_kernel: StoreKernel | None = None) -> None:
        """prefill_kernel: only for the query and cache dtypes it takes (the caller checks)."""
        self.decode_kernel = decode_kernel
        self.prefill_kernel = prefill_kernel
        self.store_kernel = store_kernel
        # (metadata, block size, plan): holding the metadata keeps `is` a safe identity test. A step's
        # metadata is never mutated once built (InputBuffers makes a new one each step).
        self._last: tuple[AttentionMetadata, int, _StepPlan] | None = None

    def _plan(self, meta: AttentionMetadata, block_size: int) -> _StepPlan:
        if self._last is None or self._last[0] is not meta or self._last[1] != block_size:
            self._last = (meta, block_size,
                          _plan_step(meta, block_size, gather=self.decode_kernel is None))
        return self._last[2]

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, cache: LayerKVCache,
                 meta: AttentionMetadata) -> None:
        """key/value [T, Hkv, D] -> cache slots meta.slot_mapping[t]; rows with slot -1 are skipped."""
        if self.store_kernel is not None and cache.key.dtype == key.dtype:
            self.store_kernel(key, value, cache.key, cache.value, meta.slot_mapping)
            return
        plan = self._plan(meta, cache.block_size)
        if plan.valid_rows is not None:
            key, value = key.index_select(0, plan.valid_rows), value.index_select(0, plan.valid_rows)
        _scatter(cache.key, key, plan.slots, cache.k_scale)
        _scatter(cache.value, value, plan.slots, cache.v_scale)

    def attend(self, query: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata,
               scale: float) -> torch.Tensor:
        """query [T, H, D] -> [T, H, D]; rows outside every sequence (padding) come back zero."""
        plan = self._plan(meta, cache.block_size)
        if plan.covers_all_rows:
            return self._decode(query, cache, plan.decode, scale)
        out = torch.zeros_like(query)
        if plan.decode is not None:
            o = self._decode(query, cache, plan.decode, scale)
            if plan.decode.rows is None:
                out[:len(plan.decode.seqs)] = o
            else:
                out.index_copy_(0, plan.decode.rows, o)
        for b in plan.prefill:
            s, q_len = plan.starts[b], meta.query_lens_cpu[b]
            out[s:s + q_len] = self._prefill(query[s:s + q_len], cache, meta.block_tables[b],
                                             meta.seq_lens_cpu[b], scale)
        return out

    def _decode(self, query: torch.Tensor, cache: LayerKVCache, plan: _DecodePlan,
                scale: float) -> torch.Tensor:
        """-> [n, H, D] for the plan's n decoding sequences, in plan order."""
        n, L = len(plan.seqs), plan.length
        _, H, D = query.shape
        Hkv = cache.key.shape[2]
        q = query[:n] if plan.rows is None else query.index_select(0, plan.rows)
        if self.decode_kernel is not None:
            return self.decode_kernel(q.contiguous(), cache.key, cache.value, plan.block_tables,
                                      plan.seq_lens, scale, cache.k_scale, cache.v_scale)
        k = _gather(cache.key, plan.blocks, cache.k_scale, query.dtype)   # [n * blocks, bs, Hkv, D]
        v = _gather(cache.value, plan.blocks, cache.v_scale, query.dtype)
        k = k.view(n, L, Hkv, D).transpose(1, 2)                          # [n, Hkv, L, D]
        v = v.view(n, L, Hkv, D).transpose(1, 2)
        # Query head h reads kv head h // G, so [n, H, D] -> [n, Hkv, G, D] groups them.
        qg = q.view(n, Hkv, H // Hkv, D)
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=plan.visible, scale=scale)
        return o.reshape(n, H, D)                                         # [n, Hkv, G, D] -> [n, H, D]

    def _prefill(self, q: torch.Tensor, cache: LayerKVCache, block_table: torch.Tensor,
                 seq_len: int, scale: float) -> torch.Tensor:
        """q [n, H, D] for positions seq_len-n .. seq_len-1 -> [n, H, D]."""
        if self.prefill_kernel is not None:
            return self.prefill_kernel(q.contiguous(), cache.key, cache.value, block_table,
                                       seq_len, scale)
        n, H, D = q.shape
        Hkv = cache.key.shape[2]
        num_blocks = -(-seq_len // cache.block_size)
        blocks = block_table[:num_blocks].long()
        k = _gather(cache.key, blocks, cache.k_scale, q.dtype).view(-1, Hkv, D)[:seq_len]
        v = _gather(cache.value, blocks, cache.v_scale, q.dtype).view(-1, Hkv, D)[:seq_len]
        ctx = seq_len - n
        if ctx == 0:
            mask, causal = None, True
        else:
            key_pos = torch.arange(seq_len, device=q.device)
            query_pos = torch.arange(ctx, seq_len, device=q.device)
            mask, causal = key_pos[None, :] <= query_pos[:, None], False  # [n, seq_len]
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=H != Hkv)  # [1, H, n, D]
        return o[0].transpose(0, 1)


def _scatter(cache: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, scale: float) -> None:
    """x [N, Hkv, D] -> cache viewed as [num_blocks * block_size, Hkv, D] at rows `slots`."""
    flat = cache.view(-1, *cache.shape[2:])
    if cache.dtype == torch.float8_e4m3fn:
        x = (x.float() / scale).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
        # index_copy_ has no fp8 kernel on every device; bytes are bytes.
        flat.view(torch.uint8).index_copy_(0, slots, x.view(torch.uint8))
    else:
        flat.index_copy_(0, slots, x.to(cache.dtype))


def _gather(cache: torch.Tensor, blocks: torch.Tensor, scale: float,
            dtype: torch.dtype) -> torch.Tensor:
    """cache [num_blocks, bs, Hkv, D] -> the listed blocks [len(blocks), bs, Hkv, D] in `dtype`."""
    if cache.dtype == torch.float8_e4m3fn:
        raw = cache.view(torch.uint8).index_select(0, blocks).view(torch.float8_e4m3fn)
        return raw.to(dtype) * scale
    return cache.index_select(0, blocks)


def _plan_step(meta: AttentionMetadata, block_size: int, gather: bool) -> _StepPlan:
    slots = meta.slot_mapping
    valid = slots >= 0
    valid_rows = None
    if not bool(valid.all()):  # padding rows (graph buckets); one device read per step
        valid_rows = valid.nonzero().squeeze(1)
        slots = slots.index_select(0, valid_rows)
    query_lens = meta.query_lens_cpu
    starts = list(accumulate(query_lens[:-1], initial=0))
    decode = [b for b, q_len in enumerate(query_lens) if q_len == 1 and meta.seq_lens_cpu[b] > 0]
    prefill = [b for b, q_len in enumerate(query_lens) if q_len > 1]
    plan = _decode_plan(meta, decode, starts, block_size, gather) if decode else None
    covers_all = (plan is not None and plan.rows is None and not prefill
                  and len(decode) == len(meta.slot_mapping))
    return _StepPlan(valid_rows, slots, starts, prefill, plan, covers_all)


def _decode_plan(meta: AttentionMetadata, seqs: list[int], starts: list[int],
                 block_size: int, gather: bool) -> _DecodePlan:
    n = len(seqs)
    device = meta.seq_lens.device
    # The usual pure-decode batch has sequence b at row b: slice instead of gathering.
    if seqs == list(range(n)):
        rows, block_tables, seq_lens = None, meta.block_tables[:n], meta.seq_lens[:n]
    else:
        rows = torch.tensor([starts[b] for b in seqs], device=device)
        seq_idx = torch.tensor(seqs, device=device)
        block_tables = meta.block_tables.index_select(0, seq_idx)
        seq_lens = meta.seq_lens.index_select(0, seq_idx)
    block_tables, seq_lens = block_tables.contiguous(), seq_lens.contiguous()
    if not gather:
        return _DecodePlan(seqs, rows, block_tables, seq_lens, None, 0, None)
    max_len = max(meta.seq_lens_cpu[b] for b in seqs)
    num_blocks = -(-max_len // block_size)
    L = num_blocks * block_size
    blocks = block_tables[:, :num_blocks].reshape(-1).long()             # [n * num_blocks]
    visible = torch.arange(L, device=device)[None, :] < seq_lens[:, None]  # [n, L]
    return _DecodePlan(seqs, rows, block_tables, seq_lens, blocks, L, visible[:, None, None, :])
