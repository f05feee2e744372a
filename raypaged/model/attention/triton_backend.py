"""The Triton attention backend: store_kv, then paged decode (split-K) for pure-decode steps or
paged prefill, in one launch, for anything else (prefill, chunked prefill, mixed).

The backend owns the split-K workspace: allocated once, sized for max_num_seqs, reused by every
layer and step, so a pure-decode step allocates nothing but its output (which a CUDA graph's
private pool serves) and never syncs with the host. The number of splits (host integers only:
see __init__) never changes results.

On CPU tensors it runs when TRITON_INTERPRET=1 was set before triton was imported (tests do);
otherwise `get_attention_backend` refuses it on a device without CUDA, once, at engine start.
"""
from __future__ import annotations

import functools

import torch

from raypaged.kernels.paged_decode import (MAX_SPLITS, DecodeWorkspace, choose_num_splits,
                                           paged_decode)
from raypaged.kernels.paged_prefill import paged_prefill
from raypaged.kernels.store_kv import store_kv
from raypaged.model.attention.base import AttentionMetadata, LayerKVCache

# The interpreter has no SMs; this stand-in keeps the split-K path exercised by CPU tests.
INTERPRETER_NUM_SMS = 4


class TritonAttentionBackend:
    name = "triton"

    def __init__(self, max_num_seqs: int = 256, max_model_len: int | None = None,
                 split_k: bool = True) -> None:
        """max_model_len, when given, replaces each step's max_seq_len in the split rule, which
        makes the split count depend on the batch size alone (what CUDA-graph capture wants).
        split_k=False turns split-K off (one program per sequence and kv head)."""
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.split_k = split_k
        self._workspace: DecodeWorkspace | None = None
        self._retired: list[DecodeWorkspace] = []

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, cache: LayerKVCache,
                 meta: AttentionMetadata) -> None:
        store_kv(key, value, cache.key, cache.value, meta.slot_mapping,
                 cache.k_scale, cache.v_scale)

    def attend(self, query: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata,
               scale: float) -> torch.Tensor:
        num_seqs = meta.seq_lens.shape[0]
        if meta.max_query_len == 1 and query.shape[0] == num_seqs:
            splits = self.num_splits(num_seqs, cache.key.shape[2], meta.max_seq_len, query.device)
            workspace = (self.workspace(num_seqs, query.shape[1], query.shape[2], query.device)
                         if splits > 1 else None)
            return paged_decode(query, cache.key, cache.value, meta.block_tables, meta.seq_lens,
                                scale, cache.k_scale, cache.v_scale, num_splits=splits,
                                workspace=workspace)
        return paged_prefill(query, cache.key, cache.value, meta.block_tables,
                             meta.query_start_loc, meta.seq_lens, meta.max_query_len, scale,
                             cache.k_scale, cache.v_scale)

    def num_splits(self, num_seqs: int, num_kv_heads: int, max_seq_len: int,
                   device: torch.device) -> int:
        if not self.split_k:
            return 1
        max_len = self.max_model_len if self.max_model_len is not None else max_seq_len
        return choose_num_splits(num_seqs, num_kv_heads, max_len, _sm_count(device))

    def workspace(self, batch: int, num_heads: int, head_dim: int,
                  device: torch.device) -> DecodeWorkspace:
        """The split-K scratch; call once before CUDA-graph capture to allocate it up front."""
        ws = self._workspace
        if (ws is None or ws.part_out.device != device
                or not ws.fits(batch, num_heads, head_dim, MAX_SPLITS)):
            # Grows only past max_num_seqs or for another model's head shape. The old one is
            # kept alive: a CUDA graph captured with it still writes to its memory on replay.
            if ws is not None:
                self._retired.append(ws)
            ws = self._workspace = DecodeWorkspace.allocate(max(batch, self.max_num_seqs),
                                                            num_heads, head_dim, device)
        return ws


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETER_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count
