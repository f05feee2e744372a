"""Workloads for the simulator: the Mooncake conversation trace, or any list of token prompts.

The trace (../shared/traces/mooncake_conversation_trace.jsonl, see its README) names each
prompt's 512-token blocks by id. Each id becomes 512 fixed token ids, the same wherever it
appears, so real block hashes share exactly the prefixes the trace says are shared:

    hash_ids   [0,        14,       15      ]   input_length = 1234
    tokens     |tok(0)x512|tok(14)x512|tok(15)[:210]|   the last block: 1234 - 2 x 512 tokens

tok(id) starts with two tokens that spell the id (so two ids never give the same block) and
continues with a fixed pseudo-random run. Prompts are built when a request arrives and dropped
when it ends: the whole trace's prompts would not fit in memory as Python lists.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

TRACE_BLOCK = 512
MOONCAKE_TRACE = "mooncake_conversation_trace.jsonl"
_LOW, _SPAN = 100, 30_000   # token ids in [100, 30100): inside any Llama-family vocabulary


@dataclass(frozen=True)
class SimRequest:
    """One request of a workload: when it arrives, its prompt, how many tokens it generates."""

    arrival_s: float
    num_prompt_tokens: int
    output_len: int
    prompt: Callable[[], list[int]]      # builds the token ids (exactly num_prompt_tokens)
    after: int | None = None             # index of the request that must finish first (a turn)


def block_tokens(block_id: int) -> list[int]:
    """The 512 token ids a trace block id stands for; distinct ids give distinct blocks."""
    if not 0 <= block_id < _SPAN * _SPAN:
        raise ValueError(f"trace block id {block_id} is outside [0, {_SPAN * _SPAN})")
    head = [_LOW + block_id % _SPAN, _LOW + block_id // _SPAN]
    return head + [_LOW + (block_id * 7919 + j * 104_729) % _SPAN for j in range(2, TRACE_BLOCK)]


def trace_prompt(hash_ids: Sequence[int], input_length: int) -> list[int]:
    last = input_length - TRACE_BLOCK * (len(hash_ids) - 1)
    if not hash_ids or not 0 < last <= TRACE_BLOCK:
        raise ValueError(f"input_length {input_length} does not fit {len(hash_ids)} blocks of "
                         f"{TRACE_BLOCK}: want {TRACE_BLOCK} x (blocks - 1) < length <= "
                         f"{TRACE_BLOCK} x blocks")
    tokens: list[int] = []
    for block_id in hash_ids[:-1]:
        tokens += block_tokens(block_id)
    return tokens + block_tokens(hash_ids[-1])[:last]


def find_trace(repo_root: Path, name: str = MOONCAKE_TRACE) -> Path | None:
    """shared/traces/NAME inside the checkout or beside it (CI keeps shared/ at ../shared)."""
    for shared in (repo_root / "shared", repo_root.parent / "shared"):
        if (shared / "traces" / name).is_file():
            return shared / "traces" / name
    return None


def load_mooncake(path: Path, limit: int | None = None, start: int = 0) -> list[SimRequest]:
    """Requests start..start+limit of the trace, arrivals in seconds from the first of them."""
    requests: list[SimRequest] = []
    t0 = None
    with open(path) as f:
        for i, line in enumerate(f):
            if i < start:
                continue
            if limit is not None and len(requests) >= limit:
                break
            row = json.loads(line)
            t0 = row["timestamp"] if t0 is None else t0
            ids, length = tuple(row["hash_ids"]), row["input_length"]
            requests.append(SimRequest((row["timestamp"] - t0) / 1000, length,
                                       row["output_length"],
                                       lambda ids=ids, n=length: trace_prompt(ids, n)))
    return requests


def from_prompts(items: Sequence[tuple[list[int], int, int | None]],
                 arrivals: Sequence[float]) -> list[SimRequest]:
    """(prompt, output tokens, after) items (benchmarks/serve_datasets.py) at given arrivals."""
    return [SimRequest(t, len(p), out, lambda p=p: p, after)
            for (p, out, after), t in zip(items, arrivals)]


def time_scaled(requests: Sequence[SimRequest], speedup: float) -> list[SimRequest]:
    """The same requests arriving `speedup` times faster (offered load x speedup)."""
    return [SimRequest(r.arrival_s / speedup, r.num_prompt_tokens, r.output_len, r.prompt,
                       r.after) for r in requests]
