"""Build AttentionMetadata and paged block tables by hand, as the model runner would from a batch."""
from __future__ import annotations

import random
from typing import Sequence

import torch

from raypaged.model.attention.base import AttentionMetadata


def make_metadata(block_tables: Sequence[Sequence[int]], query_lens: Sequence[int],
                  seq_lens: Sequence[int], block_size: int,
                  device: torch.device | str = "cpu") -> AttentionMetadata:
    """Metadata for a step where sequence b computes its last query_lens[b] of seq_lens[b] tokens.

    slot of position p = block_tables[b][p // block_size] * block_size + p % block_size
    """
    slots = []
    for table, q_len, s_len in zip(block_tables, query_lens, seq_lens, strict=True):
        assert len(table) * block_size >= s_len, "block table too short for the sequence"
        slots += [table[p // block_size] * block_size + p % block_size
                  for p in range(s_len - q_len, s_len)]
    width = max(len(t) for t in block_tables)
    padded = [list(t) + [0] * (width - len(t)) for t in block_tables]
    starts = [0]
    for q_len in query_lens:
        starts.append(starts[-1] + q_len)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(list(seq_lens), dtype=torch.int32, device=device),
        block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens),
    )


def positions_for(query_lens: Sequence[int], seq_lens: Sequence[int]) -> torch.Tensor:
    """[T] int64 absolute positions of the step's new tokens, sequence by sequence."""
    return torch.cat([torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens, strict=True)])


def scattered_block_tables(seq_lens: Sequence[int], block_size: int, num_blocks: int,
                           seed: int = 0) -> list[list[int]]:
    """Disjoint, shuffled block ids per sequence, so tests never pass by reading blocks in order."""
    need = [-(-s // block_size) for s in seq_lens]
    assert sum(need) <= num_blocks
    ids = list(range(num_blocks))
    random.Random(seed).shuffle(ids)
    tables, at = [], 0
    for n in need:
        tables.append(ids[at:at + n])
        at += n
    return tables

