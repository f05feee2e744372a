"""CUDA graphs for pure decode steps: one graph per batch-size bucket, replayed with padding.

A decode step of B sequences runs the graph of the smallest bucket >= B. Graphs are captured on
the runner's persistent input buffers (`InputBuffers`), which each step fills in place, so a
replay copies nothing; rows B..bucket-1 are padding (slot -1: nothing written; seq_len 0: the
attention kernels skip them). Graphs are captured with max_seq_len = max_model_len, so the
kernels' launch grids never depend on the step's actual lengths. Any capture failure logs one
warning and leaves the runner eager; `enforce_eager` never builds this object.
"""
from __future__ import annotations

import logging

import torch

from raypaged.model.attention.base import AttentionMetadata, LayerKVCache
from raypaged.model.input_buffers import InputBuffers
from raypaged.model.llama import LlamaModel

log = logging.getLogger(__name__)


class CudaGraphDecoder:
    def __init__(self, model: LlamaModel, kv_caches: list[LayerKVCache], max_num_seqs: int,
                 max_model_len: int, buffers: InputBuffers) -> None:
        self.model = model
        self.kv_caches = kv_caches
        # 1, 2, 4, 8, then every multiple of 8 up to max_num_seqs (which is always included)
        small = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
        self.buckets = sorted({*small, *range(16, max_num_seqs, 8), max_num_seqs})
        self.max_model_len = max_model_len
        self.input_ids, self.positions = buffers.input_ids, buffers.positions
        self.slot_mapping, self.seq_lens = buffers.slot_mapping, buffers.seq_lens
        self.block_tables = buffers.block_tables
        # decode's query starts are always 0..B; the runner's own buffer holds prefill's
        self.query_start_loc = torch.arange(max_num_seqs + 1, dtype=torch.int32, device=buffers.device)
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

    def run(self, b: int) -> torch.Tensor | None:
        """Replay the bucket for a decode step of b sequences whose inputs are already in the
        shared buffers; None when no graph applies (run eager)."""
        bucket = next((x for x in self.buckets if x >= b), None)
        if bucket is None or bucket not in self.graphs:
            return None
        # padding rows: write nothing, attend to nothing
        self.slot_mapping[b:bucket].fill_(-1)
        self.seq_lens[b:bucket].zero_()
        graph, out = self.graphs[bucket]
        graph.replay()
        return out[:b]
