"""A request as the scheduler sees it: tokens, and how many of them are already in the KV cache.

There is no prefill/decode flag. `num_computed_tokens` catches up with `num_tokens`:

    all_token_ids:  | prompt ............................ | outputs ...... |
                    0                num_computed_tokens ^          num_tokens
    a step schedules n more tokens (a prefill chunk, or the one token of a decode).

`num_computed_tokens` advances when a step is scheduled (its KV is being or has been written);
`num_placeholders` counts the tokens scheduled steps will sample, not appended yet (overlapped
scheduling: see scheduler.py).
"""
from __future__ import annotations

import enum
from typing import Sequence

from raypaged.core.block_hash import BlockHash, hash_block_tokens
from raypaged.core.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, its blocks freed; recomputes from scratch
    FINISHED = "finished"


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                 max_tokens: int, eos_token_id: int | None = None, cache_salt: str | None = None,
                 parent_id: str | None = None, sample_index: int = 0, arrival: int = 0,
                 output_token_ids: Sequence[int] = (),
                 block_hashes: Sequence[BlockHash] = ()) -> None:
        """`block_hashes`: the chain's leading hashes over all_token_ids, computed by the router
        (EngineCore.add_request checks them); update_block_hashes goes on from there."""
        if not prompt_token_ids:
            raise ValueError("the prompt is empty: give at least one token")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        # Outputs given at construction continue a sample begun elsewhere (a Continuation).
        self.output_token_ids: list[int] = list(output_token_ids)
        self.all_token_ids = self.prompt_token_ids + self.output_token_ids
        self.sampling = sampling
        self.max_tokens = max_tokens          # resolved: never None here
        self.eos_token_id = eos_token_id
        self.cache_salt = cache_salt
        self.parent_id = parent_id
        self.sample_index = sample_index
        self.arrival = arrival                # arrival order (forked samples: the parent's)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_placeholders = 0             # tokens sampled by scheduled steps, not appended yet
        self.num_cached_tokens = 0            # prefix-cache hit at first admission (reported)
        self.num_preemptions = 0
        # the most tokens whose KV a preemption threw away: computing them again is recompute
        self.num_lost_tokens = 0
        self.preempted_at: float | None = None  # the scheduler's clock at its last preemption
        self.forked = sampling.n == 1         # n > 1 forks once, when its prompt is done
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        # hashes of the full blocks of all_token_ids (a leading part of the chain)
        self.block_hashes: list[BlockHash] = list(block_hashes)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
        self.output_token_ids.append(token_id)

    def update_block_hashes(self, block_size: int) -> None:
        """Extend the hash chain over every full block of the known tokens."""
        have = len(self.block_hashes)
        if have < self.num_tokens // block_size:
            self.block_hashes += hash_block_tokens(
                self.all_token_ids, block_size, self.cache_salt, start=have,
                parent=self.block_hashes[-1] if have else None)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, "
                f"computed={self.num_computed_tokens}/{self.num_tokens})")
