"""ModelRunner: a scheduled batch -> model inputs -> forward -> logits of sampling rows -> tokens.

Implements core's ModelRunner protocol. Flattens the batch into T tokens:

    request:        a (chunk of 3)      b (decode)   c (last chunk of 2, samples)
    input_ids:      [a0 a1 a2          | b0         | c0 c1 ]
    query_start:    0                   3            4        6
    sample rows:                        ^3           ^5           (last token of each sampler)
"""
from __future__ import annotations

import torch

from raypaged.core.contracts import ScheduledBatch, StepResult
from raypaged.model.attention.base import AttentionMetadata, LayerKVCache
from raypaged.model.cuda_graphs import CudaGraphDecoder
from raypaged.model.llama import LlamaModel
from raypaged.model.sampler import SampleRow, Sampler


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_caches: list[LayerKVCache], block_size: int,
                 device: torch.device, sampler: Sampler | None = None,
                 graphs: CudaGraphDecoder | None = None) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.sampler = sampler or Sampler()
        self.graphs = graphs
        self.num_graph_steps = 0
        self.num_eager_steps = 0

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepResult:
        if batch.block_copies:
            self._copy_blocks(batch.block_copies)
        input_ids, positions, meta = self.prepare(batch)
        hidden = None
        if self.graphs is not None and batch.is_pure_decode:
            hidden = self.graphs.run(input_ids, positions, meta)  # None: no bucket fits
        if hidden is not None:
            self.num_graph_steps += 1
        else:
            hidden = self.model(input_ids, positions, self.kv_caches, meta)  # [T, hidden]
            self.num_eager_steps += 1

        samplers = [r for r in batch.requests if r.num_samples]
        if not samplers:
            return StepResult(sampled={})
        ends = meta.query_start_loc[1:].tolist()
        last_rows = [ends[i] - 1 for i, r in enumerate(batch.requests) if r.num_samples]
        logits = self.model.compute_logits(hidden[last_rows])    # [S, vocab] float32
        # A prompt about to fork into n samples draws n tokens from its one logits row.
        repeats = torch.tensor([r.num_samples for r in samplers], device=logits.device)
        if int(repeats.max()) > 1:
            logits = logits.repeat_interleave(repeats, dim=0)
        rows = [SampleRow(r.sampling, r.prompt_token_ids, r.output_token_ids,
                          r.sample_index + j, r.eos_token_id)
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

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        reqs = batch.requests
        query_lens = [len(r.token_ids) for r in reqs]
        seq_lens = [r.seq_len for r in reqs]
        ids: list[int] = []
        pos: list[int] = []
        for r in reqs:
            ids.extend(r.token_ids)
            pos.extend(range(r.start_position, r.seq_len))
        width = max(-(-s // bs) for s in seq_lens)
        tables = [list(r.block_table[:width]) + [0] * (width - min(len(r.block_table), width))
                  for r in reqs]

        dev = self.device
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)          # [T]
        positions = torch.tensor(pos, dtype=torch.long, device=dev)          # [T]
        block_tables = torch.tensor(tables, dtype=torch.int32, device=dev)   # [B, width]
        q_lens = torch.tensor(query_lens, dtype=torch.int32, device=dev)     # [B]
        query_start_loc = torch.zeros(len(reqs) + 1, dtype=torch.int32, device=dev)
        torch.cumsum(q_lens, 0, out=query_start_loc[1:])
        req_of_token = torch.repeat_interleave(torch.arange(len(reqs), device=dev), q_lens)  # [T]
        slot_mapping = (block_tables[req_of_token, positions // bs].long() * bs
                        + positions % bs)                                     # [T]
        meta = AttentionMetadata(
            slot_mapping=slot_mapping, query_start_loc=query_start_loc,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=block_tables, max_query_len=max(query_lens), max_seq_len=max(seq_lens),
            query_lens_cpu=query_lens, seq_lens_cpu=seq_lens)
        return input_ids, positions, meta

    def _copy_blocks(self, copies: tuple[tuple[int, int], ...]) -> None:
        src = torch.tensor([s for s, _ in copies], dtype=torch.long, device=self.device)
        dst = torch.tensor([d for _, d in copies], dtype=torch.long, device=self.device)
        for cache in self.kv_caches:
            cache.key[dst] = cache.key[src]
            cache.value[dst] = cache.value[src]
