"""ModelRunner: a scheduled batch -> model inputs -> forward -> logits of sampling rows -> tokens.

Implements core's ModelRunner protocol. Flattens the batch into T tokens:

    request:        a (chunk of 3)      b (decode)   c (last chunk of 2, samples)
    input_ids:      [a0 a1 a2          | b0         | c0 c1 ]
    query_start:    0                   3            4        6
    sample rows:                        ^3           ^5           (last token of each sampler)
"""
from __future__ import annotations

import logging
from itertools import accumulate

import torch

from raypaged.core.contracts import ScheduledBatch, StepResult
from raypaged.model.attention.base import AttentionMetadata, LayerKVCache
from raypaged.model.input_buffers import InputBuffers
from raypaged.model.llama import LlamaModel
from raypaged.model.sampler import SampleRow, Sampler

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_caches: list[LayerKVCache], buffers: InputBuffers,
                 sampler: Sampler, graphs: CudaGraphDecoder | None = None,
                 num_threads: int | None = None, decode_threads: int | None = None) -> None:
        """num_threads: torch CPU threads, set here (None: as they are); decode_threads: those of
        decode-only steps, every other step runs with num_threads (None: one count for all)."""
        self.model = model
        self.decode_threads = decode_threads
        self._threads = torch.get_num_threads()
        self.full_threads = num_threads or self._threads
        self._set_threads(self.full_threads)
        self.kv_caches = kv_caches
        self.buffers = buffers
        self.sampler = sampler
        self.graphs = graphs
        self.num_graph_steps = 0
        self.num_eager_steps = 0

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepResult:
        if batch.block_copies:
            src, dst = torch.tensor(batch.block_copies, dtype=torch.long,
                                    device=self.buffers.device).T
            for cache in self.kv_caches:
                cache.key[dst] = cache.key[src]
                cache.value[dst] = cache.value[src]
        if self.decode_threads is not None:
            self._set_threads(self.decode_threads if batch.is_pure_decode else self.full_threads)
        input_ids, positions, meta = self.buffers.prepare(batch)
        hidden = None
        if self.graphs is not None and batch.is_pure_decode:
            hidden = self.graphs.run(len(batch.requests))  # None: no bucket fits
        if hidden is not None:
            self.num_graph_steps += 1
        else:
            hidden = self.model(input_ids, positions, self.kv_caches, meta)  # [T, hidden]
            self.num_eager_steps += 1

        samplers = [r for r in batch.requests if r.num_samples]
        if not samplers:
            return StepResult(sampled={})
        # row indices from the host's query lengths: no device read before the sampler's
        last_rows = [end - 1 for r, end in zip(batch.requests, accumulate(meta.query_lens_cpu))
                     if r.num_samples]
        logits = self.model.compute_logits(hidden[last_rows])    # [S, vocab] float32
        # A prompt about to fork into n samples draws n tokens from its one logits row.
        if any(r.num_samples > 1 for r in samplers):
            repeats = torch.tensor([r.num_samples for r in samplers]).to(logits.device)
            num_rows = sum(r.num_samples for r in samplers)  # given, so no device read
            logits = logits.repeat_interleave(repeats, dim=0, output_size=num_rows)
        rows = [SampleRow(r.sampling, r.prompt_token_ids, r.output_token_ids,
                          r.sample_index + j, r.eos_token_id, r.request_id)
                for r in samplers for j in range(r.num_samples)]
        tokens, logprobs = self.sampler(logits, rows)

        # each sampler's tokens (and logprobs) are its num_samples consecutive rows
        starts = accumulate((r.num_samples for r in samplers), initial=0)
        spans = [(r, slice(i, i + r.num_samples)) for r, i in zip(samplers, starts)]
        return StepResult(sampled={r.request_id: tuple(tokens[s]) for r, s in spans},
                          logprobs={r.request_id: tuple(logprobs[s]) for r, s in spans
                                    if r.sampling.logprobs is not None})

    def _set_threads(self, n: int) -> None:
        # Called from the thread that runs the model: OpenMP's thread count is per calling thread.
        if n != self._threads:
            torch.set_num_threads(n)
            self._threads = n


class CudaGraphDecoder:
    """CUDA graphs for pure decode steps: one graph per batch-size bucket, replayed with padding.

    A decode step of B sequences runs the graph of the smallest bucket >= B. Graphs are captured on
    the runner's persistent input buffers (`InputBuffers`), which each step fills in place, so a
    replay copies nothing; rows B..bucket-1 are padding (slot -1: nothing written; seq_len 0: the
    attention kernels skip them). Graphs are captured with max_seq_len = max_model_len, so the
    kernels' launch grids never depend on the step's actual lengths. Any capture failure logs one
    warning and leaves the runner eager; `enforce_eager` never builds this object.
    """

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
