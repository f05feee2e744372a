"""ModelRunner: a scheduled batch -> model inputs -> forward -> logits of sampling rows -> tokens.

Implements core's ModelRunner protocol. Flattens the batch into T tokens:

    request:        a (chunk of 3)      b (decode)   c (last chunk of 2, samples)
    input_ids:      [a0 a1 a2          | b0         | c0 c1 ]
    query_start:    0                   3            4        6
    sample rows:                        ^3           ^5           (last token of each sampler)
"""
from __future__ import annotations

from itertools import accumulate

import torch

from raypaged.core.contracts import ScheduledBatch, StepResult
from raypaged.model.attention.base import LayerKVCache
from raypaged.model.cuda_graphs import CudaGraphDecoder
from raypaged.model.input_buffers import InputBuffers
from raypaged.model.llama import LlamaModel
from raypaged.model.sampler import SampleRow, Sampler


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
            self._copy_blocks(batch.block_copies)
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

        sampled, lps, i = {}, {}, 0
        for r in samplers:
            k = r.num_samples
            sampled[r.request_id] = tuple(tokens[i:i + k])
            if r.sampling.logprobs is not None:
                lps[r.request_id] = tuple(logprobs[i:i + k])
            i += k
        return StepResult(sampled=sampled, logprobs=lps)

    def _set_threads(self, n: int) -> None:
        # Called from the thread that runs the model: OpenMP's thread count is per calling thread.
        if n != self._threads:
            torch.set_num_threads(n)
            self._threads = n

    def _copy_blocks(self, copies: tuple[tuple[int, int], ...]) -> None:
        src, dst = torch.tensor(copies, dtype=torch.long, device=self.buffers.device).T
        for cache in self.kv_caches:
            cache.key[dst] = cache.key[src]
            cache.value[dst] = cache.value[src]
