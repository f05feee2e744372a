"""Per-request sampling settings, validated once at construction (pure Python)."""
from __future__ import annotations

from dataclasses import dataclass, field


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
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        # Accept lists / single strings from callers, store tuples so the params stay hashable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in (self.stop_token_ids or ())))
        if self.top_k == 0:
            object.__setattr__(self, "top_k", -1)
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, value, want: str) -> ValueError:
            return ValueError(f"{name} must be {want}, got {value!r}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", self.n, "an integer >= 1")
        if self.temperature < 0:
            raise bad("temperature", self.temperature, ">= 0 (0 means greedy)")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", self.top_p, "in (0, 1]")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k != -1):
            raise bad("top_k", self.top_k, "-1 (off) or an integer >= 1")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", self.min_p, "in [0, 1]")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", self.max_tokens, "an integer >= 1 (or None for up to max_model_len)")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", self.min_tokens, "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            raise bad("logprobs", self.logprobs, "an integer in [0, 20]")
        if not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", self.presence_penalty, "in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", self.frequency_penalty, "in [-2, 2]")
        if not self.repetition_penalty > 0:
            raise bad("repetition_penalty", self.repetition_penalty, "> 0 (1 = off)")
        if any(not s for s in self.stop):
            raise bad("stop", self.stop, "non-empty strings")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", self.seed, "an integer")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
