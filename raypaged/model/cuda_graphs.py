"""CUDA graphs for pure decode steps: one graph per batch-size bucket, replayed with padding.

A decode step of B sequences runs the graph of the smallest bucket >= B. Inputs live in
persistent buffers; rows B..bucket-1 are padding (slot -1: nothing written; seq_len 0: the
attention kernels skip them). Graphs are captured with max_seq_len = max_model_len, so the
kernels' launch grids never depend on the step's actual lengths. Any capture failure logs one
warning and leaves the runner eager; `enforce_eager` never builds this object.
"""
from __future__ import annotations

import logging

import torch

from raypaged.model.attention.base import AttentionMetadata, LayerKVCache
from raypaged.model.llama import LlamaModel

log = logging.getLogger(__name__)


def decode_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_num_seqs (which is always included)."""
    small = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    return sorted({*small, *range(16, max_num_seqs, 8), max_num_seqs})


class CudaGraphDecoder:
    def __init__(self, model: LlamaModel, kv_caches: list[LayerKVCache], max_num_seqs: int,
                 max_model_len: int, block_size: int, device: torch.device) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.buckets = decode_buckets(max_num_seqs)
        self.max_model_len = max_model_len
        self.max_blocks = -(-max_model_len // block_size)
        n = self.buckets[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:b], query_start_loc=self.query_start_loc[:b + 1],
            seq_lens=self.seq_lens[:b], block_tables=self.block_tables[:b], max_query_len=1,
            max_seq_len=self.max_model_len, query_lens_cpu=[1] * b,
            seq_lens_cpu=[self.max_model_len] * b)

    @torch.inference_mode()
    def capture(self) -> bool:
        """Capture every bucket, largest first so smaller graphs reuse its memory pool."""
        try:
            pool = torch.cuda.graph_pool_handle()
            self.seq_lens.fill_(1)  # capture-time values are irrelevant but must be valid
            for b in reversed(self.buckets):
                args = (self.input_ids[:b], self.positions[:b], self.kv_caches, self._meta(b))
                self.model(*args)  # warm up: triton compiles and autotune-free launches settle
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self.model(*args)
                self.graphs[b] = (graph, out)
            self.seq_lens.zero_()
            torch.cuda.synchronize()
            return True
        except Exception as e:  # noqa: BLE001 - any failure means: stay eager, loudly once
            log.warning("CUDA graph capture failed (%s: %s); decoding eagerly", type(e).__name__, e)
            self.graphs.clear()
            return False

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor | None:
        """Replay the bucket for this decode step; None when no graph applies (run eager)."""
        b = meta.num_seqs
        bucket = next((x for x in self.buckets if x >= b), None)
        if bucket is None or bucket not in self.graphs or meta.block_tables.shape[1] > self.max_blocks:
            return None
        width = meta.block_tables.shape[1]
        self.input_ids[:b].copy_(input_ids)
        self.positions[:b].copy_(positions)
        self.slot_mapping[:b].copy_(meta.slot_mapping)
        self.seq_lens[:b].copy_(meta.seq_lens)
        self.block_tables[:b, :width].copy_(meta.block_tables)
        # padding rows: write nothing, attend to nothing
        self.slot_mapping[b:bucket].fill_(-1)
        self.seq_lens[b:bucket].zero_()
        graph, out = self.graphs[bucket]
        graph.replay()
        return out[:b]
