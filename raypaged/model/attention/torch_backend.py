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
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from raypaged.kernels.numerics import FP8_E4M3_MAX
from raypaged.model.attention.base import AttentionMetadata, LayerKVCache



class TorchAttentionBackend:
    name = "torch"

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, cache: LayerKVCache,
                 meta: AttentionMetadata) -> None:
        """key/value [T, Hkv, D] -> cache slots meta.slot_mapping[t]; rows with slot -1 are skipped."""
        slots = meta.slot_mapping
        valid = slots >= 0
        if not bool(valid.all()):
            slots, key, value = slots[valid], key[valid], value[valid]
        _scatter(cache.key, key, slots, cache.k_scale)
        _scatter(cache.value, value, slots, cache.v_scale)

    def attend(self, query: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata,
               scale: float) -> torch.Tensor:
        """query [T, H, D] -> [T, H, D]; rows outside every sequence (padding) come back zero."""
        out = torch.zeros_like(query)
        starts, decode, prefill = [], [], []
        start = 0
        for b, q_len in enumerate(meta.query_lens_cpu):
            starts.append(start)
            if q_len == 1 and meta.seq_lens_cpu[b] > 0:
                decode.append(b)
            elif q_len > 1:
                prefill.append(b)
            start += q_len
        if decode:
            self._decode(query, out, cache, meta, decode, starts, scale)
        for b in prefill:
            s, q_len = starts[b], meta.query_lens_cpu[b]
            out[s:s + q_len] = self._prefill(query[s:s + q_len], cache, meta.block_tables[b],
                                             meta.seq_lens_cpu[b], scale)
        return out

    def _decode(self, query: torch.Tensor, out: torch.Tensor, cache: LayerKVCache,
                meta: AttentionMetadata, seqs: list[int], starts: list[int], scale: float) -> None:
        n = len(seqs)
        _, H, D = query.shape
        Hkv = cache.key.shape[2]
        # The usual pure-decode batch has sequence b at row b: slice instead of gathering.
        contiguous = seqs == list(range(n))
        if contiguous:
            q, block_tables, seq_lens = query[:n], meta.block_tables[:n], meta.seq_lens[:n]
        else:
            rows = torch.tensor([starts[b] for b in seqs], device=query.device)
            seq_idx = torch.tensor(seqs, device=query.device)
            q = query.index_select(0, rows)
            block_tables = meta.block_tables.index_select(0, seq_idx)
            seq_lens = meta.seq_lens.index_select(0, seq_idx)
        max_len = max(meta.seq_lens_cpu[b] for b in seqs)
        num_blocks = -(-max_len // cache.block_size)
        blocks = block_tables[:, :num_blocks].reshape(-1).long()     # [n * num_blocks]
        L = num_blocks * cache.block_size
        k = _gather(cache.key, blocks, cache.k_scale, query.dtype)   # [n * num_blocks, bs, Hkv, D]
        v = _gather(cache.value, blocks, cache.v_scale, query.dtype)
        k = k.view(n, L, Hkv, D).transpose(1, 2)                     # [n, Hkv, L, D]
        v = v.view(n, L, Hkv, D).transpose(1, 2)
        visible = torch.arange(L, device=query.device)[None, :] < seq_lens[:, None]  # [n, L]
        # Query head h reads kv head h // G, so [n, H, D] -> [n, Hkv, G, D] groups them.
        qg = q.view(n, Hkv, H // Hkv, D)
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=visible[:, None, None, :],
                                           scale=scale)               # [n, Hkv, G, D]
        o = o.reshape(n, H, D)
        if contiguous:
            out[:n] = o
        else:
            out.index_copy_(0, rows, o)

    def _prefill(self, q: torch.Tensor, cache: LayerKVCache, block_table: torch.Tensor,
                 seq_len: int, scale: float) -> torch.Tensor:
        """q [n, H, D] for positions seq_len-n .. seq_len-1 -> [n, H, D]."""
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
