"""Persistent model inputs: block tables kept per request between steps, one host->device copy per step.

A request keeps one row of a persistent host block table for as long as it runs; a step writes
only the entries that changed (new blocks, and the block a copy-on-write replaced), never the
whole table. Each step packs its small int32 inputs into one staging buffer (pinned on CUDA) and
copies it to the device in one non-blocking copy; positions and slots are derived there:

    staging (int32):  | token ids [T] | starts [B] | query lens [B] | block tables [B, W] |
    device:           positions[t]  = starts[b] + t - query_start[b]      (b = request of token t)
                      slot[t]       = block_tables[b, positions[t] // bs] * bs + positions[t] % bs

The device tensors (token ids, positions, slots, sequence lengths, block tables) are the same
buffers the CUDA graphs were captured on, so a graph replay reads them with no further copy.
The staging buffer is rewritten by the next step only after this step's sampled ids were read
back, which waits for the copy on the same stream.
"""
from __future__ import annotations

from itertools import chain

import torch

from raypaged.core.contracts import ScheduledBatch
from raypaged.model.attention.base import AttentionMetadata


class InputBuffers:
    def __init__(self, max_num_seqs: int, max_num_tokens: int, max_model_len: int, block_size: int,
                 device: torch.device) -> None:
        self.block_size = block_size
        self.device = device
        self.max_blocks = -(-max_model_len // block_size)
        seqs, tokens = max_num_seqs, max(max_num_tokens, max_num_seqs)
        # host: the persistent block tables, and the per-step staging area
        self.tables_cpu = torch.zeros(seqs, self.max_blocks, dtype=torch.int32)
        self._known = [0] * seqs                  # entries of each row written so far
        self._row: dict[str, int] = {}            # running request -> its row
        self._free_rows = list(range(seqs - 1, -1, -1))
        staging = tokens + 2 * seqs + seqs * self.max_blocks
        self._staging = torch.zeros(staging, dtype=torch.int32, pin_memory=device.type == "cuda")
        self._staging_dev = torch.zeros(staging, dtype=torch.int32, device=device)
        # device: what the model (and the CUDA graphs) read
        self.input_ids = torch.zeros(tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(tokens, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((tokens,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(seqs, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(seqs, self.max_blocks, dtype=torch.int32, device=device)
        self.query_start_loc = torch.zeros(seqs + 1, dtype=torch.int32, device=device)
        self._arange = torch.arange(tokens, dtype=torch.long, device=device)

    def _update_tables(self, batch: ScheduledBatch) -> list[int]:
        """Rows of the batch's requests, in batch order, with their changed entries written."""
        for rid in batch.finished_request_ids:
            row = self._row.pop(rid, None)
            if row is not None:
                self._free_rows.append(row)
        # A copy-on-write replaces the block that holds a request's next write; only then can
        # an entry before the known end change.
        cow = bool(batch.block_copies)
        rows, ri, ci, vals = [], [], [], []
        for r in batch.requests:
            row = self._row.get(r.request_id)
            if row is None:
                row = self._row[r.request_id] = self._free_rows.pop()
                self._known[row] = 0
            rows.append(row)
            table = r.block_table
            first = min(self._known[row], r.start_position // self.block_size) if cow else self._known[row]
            if first < len(table):
                ri += [row] * (len(table) - first)
                ci += range(first, len(table))
                vals += table[first:]
                self._known[row] = len(table)
        if ri:
            self.tables_cpu[torch.tensor(ri), torch.tensor(ci)] = torch.tensor(vals, dtype=torch.int32)
        return rows

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        reqs = batch.requests
        rows = self._update_tables(batch)
        bs = self.block_size
        query_lens = [len(r.token_ids) for r in reqs]
        seq_lens = [r.start_position + q for r, q in zip(reqs, query_lens)]
        ids = list(chain.from_iterable(r.token_ids for r in reqs))
        B, T = len(reqs), len(ids)
        W = max(-(-s // bs) for s in seq_lens)
        head = ids + [r.start_position for r in reqs] + query_lens
        n = len(head) + B * W
        self._staging[:len(head)] = torch.tensor(head, dtype=torch.int32)
        torch.index_select(self.tables_cpu[:, :W], 0, torch.tensor(rows),
                           out=self._staging[len(head):n].view(B, W))
        dev = self._staging_dev[:n]
        dev.copy_(self._staging[:n], non_blocking=True)  # the step's one host->device copy

        starts, q_lens = dev[T:T + B], dev[T + B:T + 2 * B]           # [B] each
        tables = dev[T + 2 * B:n].view(B, W)                          # [B, W]
        input_ids, positions = self.input_ids[:T], self.positions[:T]
        input_ids.copy_(dev[:T])
        qsl = self.query_start_loc[:B + 1]
        qsl[0] = 0
        torch.cumsum(q_lens, 0, out=qsl[1:])
        req_of_token = torch.repeat_interleave(self._arange[:B], q_lens, output_size=T)  # [T]
        torch.add(starts[req_of_token], self._arange[:T] - qsl[req_of_token], out=positions)
        slots = self.slot_mapping[:T]
        torch.add(tables[req_of_token, positions // bs].long() * bs, positions % bs, out=slots)
        self.seq_lens[:B].copy_(starts + q_lens)
        block_tables = self.block_tables[:B, :W]
        block_tables.copy_(tables)
        meta = AttentionMetadata(
            slot_mapping=slots, query_start_loc=qsl, seq_lens=self.seq_lens[:B],
            block_tables=block_tables, max_query_len=max(query_lens), max_seq_len=max(seq_lens),
            query_lens_cpu=query_lens, seq_lens_cpu=seq_lens)
        return input_ids, positions, meta
