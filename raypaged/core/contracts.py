"""Frozen types that cross the border between core and the model runner / serving layers.

Tensors never enter core, and block-pool internals never leave it: the runner sees block ids,
token ids and positions, nothing else. Sequence fields may be views of core's lists (no copy
per step); they are read-only and valid only during the call that receives them.
"""
from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field
from typing import Mapping, Protocol, Sequence

from raypaged.core.sampling_params import SamplingParams


class TokensView(SequenceABC):
    """The first `length` ids of an append-only list, then `tail`: O(1) to make, and unchanged
    by later appends, so a step in flight can read a request's outputs while core appends."""

    __slots__ = ("_base", "_length", "_tail")

    def __init__(self, base: Sequence[int], length: int, tail: tuple[int, ...] = ()) -> None:
        self._base, self._length, self._tail = base, length, tail

    def __len__(self) -> int:
        return self._length + len(self._tail)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self._base[i] if i < self._length else self._tail[i - self._length]

    def __iter__(self):
        yield from self._base[:self._length]
        yield from self._tail

    def extended(self, tail: tuple[int, ...]) -> "TokensView":
        return TokensView(self._base, self._length, self._tail + tail)


# A token id not known yet when its step was scheduled (see ScheduledRequest.num_placeholders).
PLACEHOLDER = -1


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step: compute `token_ids` at positions start..start+len-1.

        positions   0 ........ start-1 | start ..... start+len-1 |
                    already in KV cache | computed this step      |
        block_table covers every position up to start+len-1 (block = pos // block_size).
    """

    request_id: str
    token_ids: Sequence[int]          # the new tokens fed this step
    start_position: int               # == num_computed_tokens before this step
    block_table: Sequence[int]        # physical block ids, in order
    # tokens sampled after this step: 0 before a prompt's last chunk; n > 1 for one about to fork
    num_samples: int
    sampling: SamplingParams
    prompt_token_ids: Sequence[int]   # for repetition penalty
    output_token_ids: Sequence[int]   # for penalties, min_tokens, per-step seeds
    sample_index: int = 0             # which of the n samples this sequence is (seeds differ)
    eos_token_id: int | None = None
    # Overlapped scheduling: the last `num_placeholders` entries of token_ids are PLACEHOLDER,
    # the tokens the step before this one samples for this request; they are filled in (and
    # appended to output_token_ids) from that step's result before this step runs.
    num_placeholders: int = 0


@dataclass(frozen=True)
class ScheduledBatch:
    requests: tuple[ScheduledRequest, ...]
    # Copy-on-write: copy KV block src -> dst (all layers) *before* this step's writes.
    block_copies: tuple[tuple[int, int], ...] = ()
    # Requests that left since the last step (finished, aborted, preempted): runners drop state.
    finished_request_ids: frozenset[str] = frozenset()

    @property
    def is_pure_decode(self) -> bool:
        return all(len(r.token_ids) == 1 and r.num_samples == 1 for r in self.requests)


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probability of the sampled token and the top-k alternatives at one position."""

    token_id: int
    logprob: float
    rank: int                           # 1 = most likely
    top: tuple[tuple[int, float], ...]  # (token id, logprob), best first


@dataclass(frozen=True)
class StepResult:
    # request id -> the tokens sampled for it this step (one each; n for a prompt that forks)
    sampled: Mapping[str, tuple[int, ...]]
    logprobs: Mapping[str, tuple[TokenLogprobs, ...]] = field(default_factory=dict)


class ModelRunner(Protocol):
    """What EngineCore needs from the model side; tests use a deterministic fake."""

    def execute(self, batch: ScheduledBatch) -> StepResult: ...


@dataclass(frozen=True)
class Continuation:
    """One sample of a request begun on another worker, to be carried on from where it stopped:
    the original prompt is re-admitted with these outputs already generated (their KV
    recomputed, as after a preemption), so limits, penalties and seeds go on as if
    uninterrupted, and the text goes on after the `text_chars` characters the client has."""

    sample_index: int                 # which of the original request's n samples
    output_token_ids: tuple[int, ...]  # generated so far (and already sent to the client)
    text_chars: int                   # characters of text already sent to the client


@dataclass(frozen=True)
class RequestDelta:
    """What one step produced for one sequence (engine output)."""

    request_id: str
    new_token_ids: tuple[int, ...]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    new_logprobs: tuple[TokenLogprobs, ...] = ()
    num_cached_tokens: int = 0        # prompt tokens served from the prefix cache at admission
    parent_id: str | None = None      # for n > 1: the request this sequence was forked from
    sample_index: int = 0
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class MemoryStats:
    """The block pool's state and cache counters (token counts, not bytes: bytes live in the plan)."""

    num_blocks: int
    block_size: int
    blocks_used: int      # referenced by at least one request
    blocks_cached: int    # free but holding a registered prefix (evictable, reusable)
    blocks_free: int      # free and empty
    prefix_queries: int   # prompt tokens looked up in the prefix cache
    prefix_hits: int      # of those, tokens served from cache
    evictions: int        # cached blocks reclaimed for new data
    cow_copies: int       # copy-on-write block copies


@dataclass(frozen=True)
class PreemptionStats:
    """What preemption cost since the engine started (see core/preemption.py)."""

    computed_tokens: int = 0        # tokens fed to the model: prefill, decode and recompute
    recomputed_tokens: int = 0      # of those, tokens computed before and lost to a preemption
    preempted_seconds: float = 0.0  # summed over requests: preemption until resume (or finish)
    # [k] = finished sequences that were preempted k times (len: the most times, plus one)
    preempted_per_request: tuple[int, ...] = ()


@dataclass(frozen=True)
class EngineStats:
    memory: MemoryStats
    num_running: int
    num_waiting: int
    num_preemptions: int
    num_finished: int
    num_steps: int
    num_blocked: int = 0  # waiting for KV blocks or seats at the last schedule (see Scheduler)
    num_queued_tokens: int = 0  # tokens admitted but not computed yet: the work queued here
    num_prefill_tokens: int = 0  # monotonic: queued tokens computed (prompts, recompute; no decode)
    preemption: PreemptionStats = PreemptionStats()

    @property
    def kv_cache_usage(self) -> float:
        return self.memory.blocks_used / self.memory.num_blocks if self.memory.num_blocks else 0.0
