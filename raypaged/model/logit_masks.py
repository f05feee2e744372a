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
from __future__ import annotations

from dataclasses import dataclass

import torch

from raypaged.model.grammar import GrammarCache


@dataclass
class _State:
    matcher: object   # xgrammar.GrammarMatcher
    accepted: int = 0  # output tokens fed to it so far


class LogitMasks:
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
