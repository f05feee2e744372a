"""A deterministic model runner that also simulates the paged KV cache.

It stores the *token id* at every slot it is told to write, and before each step checks that
every cached position a request attends to holds exactly that request's token: so any mistake
in block tables, prefix hits, forks, copy-on-write or preemption shows up as a wrong read.
The next token is a function of the whole sequence, so a wrong read also changes the output.
"""
from __future__ import annotations

from raypaged.core.contracts import ScheduledBatch, StepResult

VOCAB = 1000


def next_token(seq: list[int], sample_index: int = 0) -> int:
    acc = 17 + 7919 * sample_index
    for i, t in enumerate(seq):
        acc = (acc * 31 + t * (i + 1)) % 1_000_003
    return acc % VOCAB


class FakeRunner:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.kv: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.batches: list[ScheduledBatch] = []

    def execute(self, batch: ScheduledBatch) -> StepResult:
        self.batches.append(batch)
        bs = self.block_size
        for src, dst in batch.block_copies:
            self.kv[dst] = list(self.kv[src])
        sampled = {}
        for sr in batch.requests:
            seq = list(sr.prompt_token_ids) + list(sr.output_token_ids)
            table, seq_len = sr.block_table, sr.start_position + len(sr.token_ids)
            assert len(table) * bs >= seq_len, "block table too short for this step"
            for p in range(sr.start_position):
                got = self.kv[table[p // bs]][p % bs]
                assert got == seq[p], f"{sr.request_id}: KV at position {p} is {got}, want {seq[p]}"
            for k, t in enumerate(sr.token_ids):
                p = sr.start_position + k
                assert seq[p] == t
                self.kv[table[p // bs]][p % bs] = t
            if sr.num_samples:
                ctx = seq[:seq_len]
                first = sr.sample_index
                sampled[sr.request_id] = tuple(next_token(ctx, first + j) for j in range(sr.num_samples))
        return StepResult(sampled=sampled)
