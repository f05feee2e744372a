"""The attention backend interface: the only place the model touches the paged KV cache.

A step's batch is flattened: T new tokens from B sequences, sequence b owning rows
query_start_loc[b] : query_start_loc[b+1]. Each layer first writes the new K/V into the cache
(by slot mapping), then attends every new token over its sequence's cached prefix *and* the new
tokens (causal), reading all of them back through the block table:

    sequence b:  | cached prefix (context_len) | new tokens (query_len) |
                 0                        seq_len - query_len      seq_len
    token at position p (absolute) sees positions 0..p.
    slot of position p = block_tables[b, p // block_size] * block_size + p % block_size

Padded rows (CUDA-graph buckets) have slot -1 (skipped by writes) and seq_len 0.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class LayerKVCache:
    """One layer's paged cache. fp8 caches hold value/scale; readers multiply by the scale."""

    key: torch.Tensor    # [num_blocks, block_size, num_kv_heads, head_dim]
    value: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    k_scale: float = 1.0
    v_scale: float = 1.0

    @property
    def block_size(self) -> int:
        return self.key.shape[1]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor     # [T] int64, -1 = padding
    query_start_loc: torch.Tensor  # [B + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor         # [B] int32, tokens in context after this step (cached + new)
    block_tables: torch.Tensor     # [B, max_blocks_per_seq] int32, unused entries 0
    max_query_len: int
    max_seq_len: int
    # Host copies, so a CPU backend can loop without device syncs.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]


class AttentionBackend(Protocol):
    name: str

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, cache: LayerKVCache,
                 meta: AttentionMetadata) -> None:
        """key/value: [T, num_kv_heads, head_dim]; scatter into cache at meta.slot_mapping."""

    def attend(self, query: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata,
               scale: float) -> torch.Tensor:
        """query: [T, num_heads, head_dim] -> [T, num_heads, head_dim] in query's dtype."""
