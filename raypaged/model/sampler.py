"""Turns logits into tokens: penalties, min_tokens, temperature, top-k/top-p/min-p, seeds, logprobs.

Order (as vLLM): penalties -> min_tokens mask -> logit_bias and grammar bitmask (LogitMasks,
constrained rows only) -> greedy argmax, or temperature -> top-k -> top-p
-> min-p -> sample. Everything on [N, vocab] is a batched tensor op on the logits' device; the
host builds a few [N] tensors from the rows and reads back the sampled ids (and logprobs) once,
at the end.

Sampling draws q ~ Exp(1) per vocab entry and takes argmax(p / q), an exact draw from p. The
noise is counter-based (`uniforms`, below): a seeded row's key is (seed, sample index, output
position), so the same seed gives the same text whatever else is in the batch, and a preempted
request that recomputes draws the same tokens again. Unseeded rows get fresh keys from the
sampler's own host RNG.
"""
from __future__ import annotations

import functools
import random
from dataclasses import dataclass

import torch

from raypaged.core.contracts import TokenLogprobs
from raypaged.core.sampling_params import SamplingParams
from raypaged.model.grammar import GrammarCache

# vLLM's _MAX_TEMP: a temperature in (0, 0.01) samples as 0.01. Far smaller ones overflow the
# float32 logits / temperature (or round to 0) and turn the row into NaNs.
MIN_TEMPERATURE = 0.01


# Counter-based random numbers for sampling: a row's noise is a pure function of (key, vocab index).
#
# No generator state: the uniforms of a row depend on its 64-bit key and nothing else, so a row
# draws the same numbers whatever else is in the batch, and a preempted request that recomputes
# output position p draws what it drew the first time. Keys are mixed on the host (one Python int
# per row per step); the [rows, vocab] noise is integer tensor ops on the logits' device:
#
#     key[i]   = splitmix64(seed, sample index, output position)           host
#     x[i, v]  = mix32(mix32(vocab_hash[v] ^ key_lo[i]) ^ key_hi[i])       device, [N, V]
#     u[i, v]  = ((x >> 9) + 0.5) / 2^23                                   in (0, 1), float32
#
# 23 bits, not 24: (2^24 - 1 + 0.5) is no float32 and rounds to 2^24, which gives u = 1.0,
# q = -log u = 0 and p / q = 0 / 0 = NaN for every p = 0 entry, which argmax takes: a token the
# grammar mask (or top-k/top-p) removed would be drawn. With 23 bits every value is exact and
# u <= 1 - 2^-24.
#
# Every product is a value < 2^32 times a constant < 2^31, so int64 arithmetic never overflows and
# any device computes the same bits.

_M32 = 0xFFFFFFFF
_M64 = 0xFFFFFFFFFFFFFFFF


def splitmix64(*words: int) -> int:
    """Mix integers (any size, any sign) into one 64-bit key."""
    x = 0
    for w in words:
        x = (x ^ (w & _M64)) + 0x9E3779B97F4A7C15 & _M64
        x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _M64
        x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _M64
        x ^= x >> 31
    return x


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche mix, in place on an int64 tensor holding values in [0, 2^32)."""
    x ^= x >> 16
    x.mul_(0x7FEB352D).bitwise_and_(_M32)
    x ^= x >> 15
    x.mul_(0x1B873593).bitwise_and_(_M32)
    x ^= x >> 16
    return x


@functools.cache
def _hashed_vocab(vocab: int, device: torch.device) -> torch.Tensor:
    """mix32 of every vocab index, computed once per (vocab size, device)."""
    return _mix32(torch.arange(vocab, dtype=torch.int64, device=device))


def uniforms(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """keys: [N] int64 on the target device (64-bit keys as signed ints) -> [N, vocab] float32 in (0, 1)."""
    lo = (keys & _M32).unsqueeze(1)                        # [N, 1]
    hi = ((keys >> 32) & _M32).unsqueeze(1)                # [N, 1]
    x = _hashed_vocab(vocab, keys.device).unsqueeze(0) ^ lo  # [N, V] int64
    return unit_interval(_mix32(_mix32(x) ^ hi))


def unit_interval(x: torch.Tensor) -> torch.Tensor:
    """32-bit ints (in int64) -> float32 strictly inside (0, 1): see the module's docstring."""
    return ((x >> 9).float() + 0.5) * (1.0 / (1 << 23))


def as_signed(key: int) -> int:
    """A 64-bit key as the int64 value a tensor can hold."""
    return key - (1 << 64) if key >= 1 << 63 else key


@dataclass(frozen=True)
class SampleRow:
    """One token to draw: a logits row plus what the sampler needs to know of its sequence."""

    params: SamplingParams
    prompt_token_ids: list[int] | tuple[int, ...]
    output_token_ids: list[int] | tuple[int, ...]
    sample_index: int
    eos_token_id: int | None
    request_id: str = ""  # with sample_index: whose grammar state (LogitMasks)


@dataclass
class _State:
    matcher: object   # xgrammar.GrammarMatcher
    accepted: int = 0  # output tokens fed to it so far


class LogitMasks:
    """The sampler's masking step: grammar bitmasks and logit_bias, for the rows that ask only.

    One matcher per sequence, keyed by (request id, sample index). Its state is a pure function of
    the sequence's output tokens, so it is never trusted across steps blindly: before each mask the
    matcher is caught up with the tokens the row carries, and a sequence the matcher has not seen
    (first sample, a fork's child, a request re-admitted after preemption, a continuation from a
    dead worker) gets a fresh matcher that replays every output token. Entries not used by a step
    are dropped, so finished and aborted requests cost nothing and need no hook:

        step k:   rows (a,0) (b,0)      states {(a,0): 5 accepted, (b,0): 2}
        step k+1: rows (a,0)            a: accept its 1 new token; b preempted -> dropped
        step k+9: rows (a,0) (b,0)      b: fresh matcher, replays its 3 output tokens, then masks
    """

    def __init__(self, grammars: GrammarCache | None) -> None:
        self.grammars = grammars
        self._states: dict[tuple[str, int], _State] = {}
        self._bitmask: torch.Tensor | None = None   # [rows, ceil(vocab / 32)] int32, host
        self.num_replayed = 0                         # tokens fed to fresh matchers (tests)

    def apply(self, logits: torch.Tensor, rows) -> None:
        """logits: [N, vocab] float32, changed in place; rows: the sampler's SampleRows."""
        bias = [i for i, r in enumerate(rows) if r.params.logit_bias]
        if bias:
            self._apply_bias(logits, rows, bias)
        constrained = [i for i, r in enumerate(rows) if r.params.structured_outputs is not None]
        if not constrained:
            self._states = {}
            return
        if self.grammars is None:
            raise ValueError("structured_outputs needs an engine built with its tokenizer")
        import xgrammar as xgr

        if self._bitmask is None or self._bitmask.shape[0] < len(rows):
            self._bitmask = xgr.allocate_token_bitmask(max(len(rows), 8), logits.shape[1])
        bitmask = self._bitmask
        states: dict[tuple[str, int], _State] = {}
        for i in constrained:
            r = rows[i]
            key = (r.request_id, r.sample_index)
            state = states.get(key) or self._states.get(key)
            out = r.output_token_ids
            if state is None or state.accepted > len(out):
                state = _State(xgr.GrammarMatcher(self.grammars.get(r.params.structured_outputs)))
                self.num_replayed += len(out)
            for t in out[state.accepted:]:
                if not state.matcher.accept_token(t):
                    raise ValueError(f"request {r.request_id}: output token {t} (position "
                                     f"{state.accepted}) breaks its structured_outputs constraint")
                state.accepted += 1
            state.matcher.fill_next_token_bitmask(bitmask, i)
            states[key] = state
        self._states = states
        mask = bitmask[:len(rows)].to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, mask, indices=constrained)

    @staticmethod
    def _apply_bias(logits: torch.Tensor, rows, idx: list[int]) -> None:
        """One index_put_ (accumulate) for every (row, token, bias) of the rows with a bias."""
        ri, ti, vals = zip(*[(i, t, b) for i in idx for t, b in rows[i].params.logit_bias])
        dev = logits.device
        logits.index_put_((torch.tensor(ri).to(dev, non_blocking=True),
                           torch.tensor(ti).to(dev, non_blocking=True)),
                          torch.tensor(vals, dtype=logits.dtype).to(dev, non_blocking=True),
                          accumulate=True)


class Sampler:
    def __init__(self, seed: int = 0, grammars: GrammarCache | None = None) -> None:
        self._rng = random.Random(seed)  # keys for unseeded rows
        self.masks = LogitMasks(grammars)
        # id(params) -> (params, eos, device tensor of the ids min_tokens bans): built when a
        # request first samples under min_tokens, kept while it still does (each step keeps
        # only the entries it used), so a step's cost does not grow with the ids it lists.
        self._banned: dict[int, tuple[SamplingParams, int | None, torch.Tensor]] = {}

    def __call__(self, logits: torch.Tensor, rows: list[SampleRow]
                 ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits: [N, vocab] float32, one row per entry of `rows`."""
        raw = logits
        logits = logits.float().clone()
        if any(r.params.has_penalties for r in rows):
            self._apply_penalties(logits, rows)
        self._mask_until_min_tokens(logits, rows)
        self.masks.apply(logits, rows)

        if all(r.params.greedy for r in rows):
            tokens = logits.argmax(dim=-1)
        else:
            greedy = torch.tensor([r.params.greedy for r in rows]).to(logits.device, non_blocking=True)
            tokens = torch.where(greedy, logits.argmax(dim=-1), self._sample(logits, rows))
        logprobs = self._logprobs(raw, rows, tokens)  # enqueued before the one sync below
        return tokens.tolist(), logprobs()

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, rows: list[SampleRow]) -> None:
        """One batched update for every row with penalties (the others get neutral values)."""
        dev, vocab = logits.device, logits.shape[1]
        idx = [i for i, r in enumerate(rows) if r.params.has_penalties]
        # [P, L] token ids, padded with `vocab` (a column past the end, dropped below)
        outs = _padded([rows[i].output_token_ids for i in idx], vocab).to(dev, non_blocking=True)
        # the prompt counts only for a repetition penalty (presence/frequency look at outputs)
        seen_ids = _padded([[*(rows[i].prompt_token_ids if rows[i].params.repetition_penalty != 1.0
                               else ()), *rows[i].output_token_ids] for i in idx],
                           vocab).to(dev, non_blocking=True)
        params = torch.tensor([[rows[i].params.repetition_penalty, rows[i].params.frequency_penalty,
                                rows[i].params.presence_penalty] for i in idx]).to(dev, non_blocking=True)
        rep, freq, pres = params.unbind(1)                                  # [P] each
        counts = torch.zeros(len(idx), vocab + 1, device=dev).scatter_add_(
            1, outs, torch.ones(outs.shape, device=dev))[:, :vocab]           # [P, V]
        seen = torch.zeros(len(idx), vocab + 1, dtype=torch.bool, device=dev).scatter_(
            1, seen_ids, True)[:, :vocab]                                     # [P, V]
        sub = logits[idx]                                                   # [P, V]
        # CTRL-style repetition penalty: shrink positive logits, grow negative ones
        rep = rep.unsqueeze(1)
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        sub -= freq.unsqueeze(1) * counts + pres.unsqueeze(1) * (counts > 0).float()
        logits[idx] = sub

    def _mask_until_min_tokens(self, logits: torch.Tensor, rows: list[SampleRow]) -> None:
        """Ban the stop ids (and EOS) of rows still short of min_tokens: one index_put_ over
        each row's banned-id tensor, built once per request, not once per step."""
        cache, self._banned = self._banned, {}
        rows_idx: list[int] = []
        banned: list[torch.Tensor] = []
        for i, r in enumerate(rows):
            if len(r.output_token_ids) >= r.params.min_tokens:
                continue
            entry = cache.get(id(r.params)) or self._banned.get(id(r.params))
            if entry is None or entry[0] is not r.params or entry[1] != r.eos_token_id:
                ids = list(r.params.stop_token_ids)
                if r.eos_token_id is not None and not r.params.ignore_eos:
                    ids.append(r.eos_token_id)
                entry = (r.params, r.eos_token_id,
                         torch.tensor(ids, dtype=torch.long).to(logits.device))
            self._banned[id(r.params)] = entry
            if entry[2].numel():
                rows_idx.append(i)
                banned.append(entry[2])
        if rows_idx:
            counts = torch.tensor([t.numel() for t in banned])
            ri = torch.repeat_interleave(torch.tensor(rows_idx), counts).to(logits.device)
            logits.index_put_((ri, torch.cat(banned)), torch.tensor(float("-inf"),
                                                                    device=logits.device))

    def _sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        dev = logits.device
        # per-row knobs, one host tensor and one copy: [N, 4] = temperature, top_k, top_p, min_p
        # (top_k capped at the vocabulary: a float64 holds it exactly only up to 2**53, and
        # 2**63 - 1 rounds to 2**63, which .long() makes int64's minimum)
        vocab = logits.shape[1]
        knobs = torch.tensor([[max(r.params.temperature, MIN_TEMPERATURE) if r.params.temperature
                               else 1.0, min(r.params.top_k, vocab),
                               r.params.top_p, r.params.min_p] for r in rows], dtype=torch.float64)
        # a seeded row's 64-bit noise key: its seed, which sample, which output position
        keys = torch.tensor([as_signed(
            splitmix64(r.params.seed, r.sample_index, len(r.output_token_ids))
            if r.params.seed is not None else self._rng.getrandbits(64)) for r in rows])
        knobs, keys = knobs.to(dev, non_blocking=True), keys.to(dev, non_blocking=True)
        logits = logits / knobs[:, 0:1].float()
        # min_p before top-k/top-p, as vLLM V1: top_p then measures what min_p left.
        # p < min_p * p_max  <=>  logit < max logit + log(min_p) (min_p 0: log is -inf, none)
        if any(r.params.min_p > 0 for r in rows):
            floor = logits.max(dim=-1, keepdim=True).values + knobs[:, 3:4].float().log()
            logits = logits.masked_fill(logits < floor, float("-inf"))
        if any(r.params.top_k > 0 or r.params.top_p < 1.0 for r in rows):
            logits = self._top_k_top_p(logits, knobs[:, 1], knobs[:, 2].float())
        probs = logits.softmax(dim=-1)
        q = uniforms(keys, probs.shape[1]).log_().neg_()  # [N, V] ~ Exp(1)
        return (probs / q).argmax(dim=-1)

    @staticmethod
    def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        """top_k: [N] (<= 0 = off), top_p: [N], both on the logits' device."""
        vocab = logits.shape[1]
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # [N, vocab]
        ks = torch.where(top_k > 0, top_k, vocab).long()
        ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
        drop = ranks >= ks.unsqueeze(1)
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # drop a token when the mass *before* it already reaches top_p (the top token always
        # stays); top_p = 1 drops nothing: the float32 cumsum reaches 1.0 before a long tail
        drop |= ((probs.cumsum(dim=-1) - probs) >= top_p.unsqueeze(1)) & (top_p < 1).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.empty_like(logits).scatter_(1, order, sorted_logits)

    @staticmethod
    def _logprobs(raw: torch.Tensor, rows: list[SampleRow], tokens: torch.Tensor):
        """Enqueue the logprob work on the device now; the returned function reads it back."""
        want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        out: list[TokenLogprobs | None] = [None] * len(rows)
        if not want:
            return lambda: out
        idx = torch.tensor(want).to(raw.device)
        lp = raw[idx].float().log_softmax(dim=-1)                   # [W, vocab], the model's own
        tok_lp = lp.gather(1, tokens[idx].unsqueeze(1))             # [W, 1]
        ranks = (lp > tok_lp).sum(dim=1) + 1                        # [W]
        k = max(max(rows[i].params.logprobs for i in want), 1)
        top_vals, top_ids = lp.topk(k, dim=-1)                      # [W, k]

        def read() -> list[TokenLogprobs | None]:
            for i, tok, lpv, rank, ids, vals in zip(want, tokens[idx].tolist(),
                                                    tok_lp[:, 0].tolist(), ranks.tolist(),
                                                    top_ids.tolist(), top_vals.tolist()):
                n = rows[i].params.logprobs
                out[i] = TokenLogprobs(token_id=tok, logprob=lpv, rank=rank,
                                       top=tuple(zip(ids[:n], vals[:n])))
            return out
        return read


def _padded(lists: list, pad: int) -> torch.Tensor:
    """Ragged int lists -> [len(lists), max len] int64, padded with `pad` (one host tensor)."""
    width = max((len(x) for x in lists), default=0)
    return torch.tensor([[*x, *([pad] * (width - len(x)))] for x in lists], dtype=torch.long)
