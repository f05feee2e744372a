"""Per-request sampling settings, validated once at construction (pure Python)."""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

from raypaged.core.structured_outputs import StructuredOutputsParams
from raypaged.settings import is_finite, is_int

# Seeds and top-k travel into int64 tensors: larger values would overflow inside a step.
INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request; the field names and defaults follow vLLM's."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) = off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None = up to max_model_len
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k log-probabilities per generated token
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    # Special tokens are left out of the text (True) or kept (False); the token that ended the
    # sample (EOS, a stop_token_ids one) is left out either way unless
    # include_stop_str_in_output. The mistral tool-call parser needs its [TOOL_CALLS] kept.
    skip_special_tokens: bool = True
    # Constrained decoding (model/grammar.py applies it); a dict is taken as its fields.
    structured_outputs: StructuredOutputsParams | None = None
    # token id -> bias added to its logit before sampling (OpenAI's [-100, 100]); stored as
    # sorted (id, bias) pairs so the params stay hashable.
    logit_bias: tuple[tuple[int, float], ...] | dict | None = None
    # stop_token_ids as a set, built once: "is this token a stop?" is asked of every sampled
    # token, and must not cost more for a request that lists more ids.
    stop_token_set: frozenset = field(init=False, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        # Accept lists / single strings from callers, store tuples so the params stay hashable.
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        object.__setattr__(self, "stop", stop)
        try:  # operator.index: ints and numpy ints, never floats or strings
            ids = tuple(operator.index(t) for t in (self.stop_token_ids or ()))
        except TypeError:
            raise ValueError("stop_token_ids must be non-negative integers, got "
                             f"{self.stop_token_ids!r}") from None
        object.__setattr__(self, "stop_token_ids", ids)
        object.__setattr__(self, "stop_token_set", frozenset(ids))
        if self.top_k == 0:
            object.__setattr__(self, "top_k", -1)
        if isinstance(self.structured_outputs, dict):
            object.__setattr__(self, "structured_outputs",
                               StructuredOutputsParams(**self.structured_outputs))
        elif not isinstance(self.structured_outputs, (StructuredOutputsParams, type(None))):
            raise ValueError("structured_outputs must be StructuredOutputsParams or a dict of its "
                             f"fields, got {type(self.structured_outputs).__name__}")
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))

        # (field, whether its value is valid, what it must be), checked in this order. NaN
        # compares false both ways and inf passes every lower bound: floats are refused first.
        rules = [(name, is_finite, "a finite number") for name in (
            "temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
            "repetition_penalty")] + [
            ("n", lambda v: is_int(v) and v >= 1, "an integer >= 1"),
            ("temperature", lambda v: v >= 0, ">= 0 (0 means greedy)"),
            ("top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
            ("top_k", lambda v: is_int(v) and (v >= 1 or v == -1) and v <= INT64_MAX,
             f"-1 (off) or an integer in [1, {INT64_MAX}]"),
            ("min_p", lambda v: 0 <= v <= 1, "in [0, 1]"),
            ("max_tokens", lambda v: v is None or isinstance(v, int) and v >= 1,
             "an integer >= 1 (or None for up to max_model_len)"),
            ("min_tokens", lambda v: isinstance(v, int) and v >= 0, "an integer >= 0"),
            ("min_tokens", lambda v: self.max_tokens is None or v <= self.max_tokens,
             f"<= max_tokens ({self.max_tokens})"),
            ("logprobs", lambda v: v is None or isinstance(v, int) and 0 <= v <= 20,
             "an integer in [0, 20]"),
            ("presence_penalty", lambda v: -2 <= v <= 2, "in [-2, 2]"),
            ("frequency_penalty", lambda v: -2 <= v <= 2, "in [-2, 2]"),
            ("repetition_penalty", lambda v: v > 0, "> 0 (1 = off)"),
            ("stop", lambda v: all(v), "non-empty strings"),
            ("seed", lambda v: v is None or is_int(v) and INT64_MIN <= v <= INT64_MAX,
             f"an integer in [{INT64_MIN}, {INT64_MAX}]"),
            ("stop_token_ids", lambda v: all(is_int(t) and t >= 0 for t in v),
             "non-negative integers")]
        for name, valid, want in rules:
            value = getattr(self, name)
            if not valid(value):
                shown = list(value) if name == "stop_token_ids" else value
                raise ValueError(f"{name} must be {want}, got {shown!r}")

    def check_token_ids(self, vocab_size: int) -> None:
        """Token ids this request names must exist in the model's vocabulary; an id past it
        would fail inside a batched step (and take the batch with it) rather than here."""
        for what, ids in (("stop_token_ids", self.stop_token_ids),
                          ("logit_bias keys", [t for t, _ in self.logit_bias or ()])):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise ValueError(f"{what} must be token ids in [0, {vocab_size}), got {bad[0]}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


def _bias_pairs(bias) -> tuple[tuple[int, float], ...] | None:
    """{id: bias} (ids as ints or digit strings, as OpenAI's JSON has them) -> sorted pairs."""
    if not bias:
        return None
    items = bias.items() if isinstance(bias, dict) else bias
    pairs = []
    for t, b in items:
        try:
            tid = int(t) if isinstance(t, str) and t.strip().isdigit() else operator.index(t)
        except TypeError:
            raise ValueError(f"logit_bias keys must be token ids, got {t!r}") from None
        if not is_finite(b) or not -100 <= b <= 100:
            raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {b!r} for "
                             f"token {t}")
        if tid < 0:
            raise ValueError(f"logit_bias keys must be non-negative token ids, got {tid}")
        pairs.append((tid, float(b)))
    return tuple(sorted(pairs))

