"""Turns logits into tokens: penalties, min_tokens, temperature, top-k/top-p/min-p, seeds, logprobs.

Order (as vLLM): penalties -> min_tokens mask -> greedy argmax, or temperature -> top-k -> top-p
-> min-p -> sample. Sampling draws q ~ Exp(1) per vocab entry and takes argmax(p / q), which is
an exact draw from p. Seeded rows draw q from their own generator, seeded by (seed, sample index,
output position): the same seed gives the same text whatever else is in the batch, and a
preempted request that recomputes draws the same tokens again.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from raypaged.core.contracts import TokenLogprobs
from raypaged.core.sampling_params import SamplingParams


@dataclass(frozen=True)
class SampleRow:
    """One token to draw: a logits row plus what the sampler needs to know of its sequence."""

    params: SamplingParams
    prompt_token_ids: list[int] | tuple[int, ...]
    output_token_ids: list[int] | tuple[int, ...]
    sample_index: int
    eos_token_id: int | None


def _seed_for(row: SampleRow) -> int:
    # splitmix-style mixing of (seed, sample, position) into one 63-bit seed
    x = (row.params.seed * 0x9E3779B97F4A7C15 + row.sample_index * 0xBF58476D1CE4E5B9
         + len(row.output_token_ids) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    x ^= x >> 31
    return x & 0x7FFFFFFFFFFFFFFF


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self._generator = torch.Generator().manual_seed(seed)  # for unseeded rows (on the CPU)

    def __call__(self, logits: torch.Tensor, rows: list[SampleRow]
                 ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits: [N, vocab] float32, one row per entry of `rows`."""
        raw = logits
        logits = logits.float().clone()
        if any(r.params.has_penalties for r in rows):
            self._apply_penalties(logits, rows)
        self._mask_until_min_tokens(logits, rows)

        greedy = torch.tensor([r.params.greedy for r in rows], device=logits.device)
        if bool(greedy.all()):
            tokens = logits.argmax(dim=-1)
        else:
            tokens = torch.where(greedy, logits.argmax(dim=-1), self._sample(logits, rows))
        token_list = tokens.tolist()
        return token_list, self._logprobs(raw, rows, token_list)

    # -- logits processing -------------------------------------------------------------------
    @staticmethod
    def _apply_penalties(logits: torch.Tensor, rows: list[SampleRow]) -> None:
        vocab = logits.shape[1]
        for i, r in enumerate(rows):
            p = r.params
            if not p.has_penalties:
                continue
            out = torch.tensor(list(r.output_token_ids), dtype=torch.long, device=logits.device)
            if p.repetition_penalty != 1.0:
                seen = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
                seen[torch.tensor(list(r.prompt_token_ids), dtype=torch.long, device=logits.device)] = True
                seen[out] = True
                row = logits[i]
                # CTRL-style: shrink positive logits, grow negative ones
                logits[i] = torch.where(seen, torch.where(row > 0, row / p.repetition_penalty,
                                                           row * p.repetition_penalty), row)
            if len(out) and (p.frequency_penalty or p.presence_penalty):
                counts = torch.zeros(vocab, device=logits.device).scatter_add_(
                    0, out, torch.ones(len(out), device=logits.device))
                logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()

    @staticmethod
    def _mask_until_min_tokens(logits: torch.Tensor, rows: list[SampleRow]) -> None:
        for i, r in enumerate(rows):
            if len(r.output_token_ids) >= r.params.min_tokens:
                continue
            banned = list(r.params.stop_token_ids)
            if r.eos_token_id is not None and not r.params.ignore_eos:
                banned.append(r.eos_token_id)
            if banned:
                logits[i, banned] = float("-inf")

    def _sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        temps = torch.tensor([r.params.temperature or 1.0 for r in rows], device=logits.device)
        logits = logits / temps.unsqueeze(1)
        if any(r.params.top_k > 0 or r.params.top_p < 1.0 for r in rows):
            logits = self._top_k_top_p(logits, rows)
        probs = logits.softmax(dim=-1)
        if any(r.params.min_p > 0 for r in rows):
            min_p = torch.tensor([r.params.min_p for r in rows], device=logits.device).unsqueeze(1)
            probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
        q = torch.empty_like(probs)
        unseeded = [i for i, r in enumerate(rows) if r.params.seed is None]
        if unseeded:
            q[unseeded] = torch.empty(len(unseeded), probs.shape[1]).exponential_(
                generator=self._generator).to(probs.device)
        for i, r in enumerate(rows):
            if r.params.seed is not None:
                gen = torch.Generator().manual_seed(_seed_for(r))
                q[i] = torch.empty(probs.shape[1]).exponential_(generator=gen).to(probs.device)
        return (probs / q).argmax(dim=-1)

    @staticmethod
    def _top_k_top_p(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        vocab = logits.shape[1]
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # [N, vocab]
        ks = torch.tensor([r.params.top_k if r.params.top_k > 0 else vocab for r in rows],
                          device=logits.device)
        ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
        drop = ranks >= ks.unsqueeze(1)
        top_p = torch.tensor([r.params.top_p for r in rows], device=logits.device).unsqueeze(1)
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # drop a token when the mass *before* it already reaches top_p (the top token always stays)
        drop |= (probs.cumsum(dim=-1) - probs) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.empty_like(logits).scatter_(1, order, sorted_logits)

    # -- logprobs ----------------------------------------------------------------------------
    @staticmethod
    def _logprobs(raw: torch.Tensor, rows: list[SampleRow], tokens: list[int]
                  ) -> list[TokenLogprobs | None]:
        want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        out: list[TokenLogprobs | None] = [None] * len(rows)
        if not want:
            return out
        lp = raw[want].float().log_softmax(dim=-1)  # [W, vocab], of the model's raw distribution
        k = max(rows[i].params.logprobs for i in want)
        top_vals, top_ids = lp.topk(max(k, 1), dim=-1)
        for j, i in enumerate(want):
            tok = tokens[i]
            tok_lp = lp[j, tok]
            rank = int((lp[j] > tok_lp).sum()) + 1
            n = rows[i].params.logprobs
            top = tuple(zip(top_ids[j, :n].tolist(), top_vals[j, :n].tolist()))
            out[i] = TokenLogprobs(token_id=tok, logprob=float(tok_lp), rank=rank, top=top)
        return out
