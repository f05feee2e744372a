"""How the scheduler admits waiting requests and whom it preempts: one frozen set of settings.

Declared once with `setting(...)` (raypaged.settings): `EngineArgs` takes the same fields with
`same_setting`, so `raypaged serve --admission-policy fits`, the Serve YAML and `LLM(...)` all
reach this one definition. The defaults are the rules of docs/scheduling.md; `fits` + `newest`
restore the scheduler's first rules (admit whatever fits now, preempt the newest) for
comparison (benchmarks/kv_waste.py runs both).
"""
from __future__ import annotations

from dataclasses import dataclass

from raypaged.settings import setting, validate

SCHEDULING = "scheduler and execution"

HEADROOM = "headroom"  # admit only while the running set's projected growth still fits
FITS = "fits"          # admit whatever fits now (the first rule)
BOUNDED = "bounded"    # victim: least computed work among those preempted fewer times
NEWEST = "newest"      # victim: the newest running request (the first rule)


@dataclass(frozen=True)
class SchedulingPolicy:
    admission_policy: str = setting(
        HEADROOM, "headroom: admit a waiting request only while the free KV blocks cover a "
        "watermark plus the projected decode growth of everything running (from max_tokens, or "
        "the mean output length seen when max_tokens is open); fits: admit whatever fits now "
        "(more preemptions)", group=SCHEDULING, choices=(HEADROOM, FITS))
    preemption_policy: str = setting(
        BOUNDED, "when blocks run out: bounded: preempt the request with the least computed "
        "work among those preempted fewer than --protect-after-preemptions times, and resume "
        "preempted requests in arrival order; newest: preempt the newest", group=SCHEDULING,
        choices=(BOUNDED, NEWEST))
    kv_watermark: float = setting(
        0.01, "headroom admission: fraction of KV blocks kept free beyond the projection",
        group=SCHEDULING, ge=0, le=0.5)
    decode_reserve: float = setting(
        1.0, "headroom admission: fraction of each running request's projected remaining "
        "output reserved (below 1 admits more and risks preemptions)", group=SCHEDULING,
        ge=0, le=1)
    protect_after_preemptions: int = setting(
        1, "bounded preemption: a request preempted this many times is not chosen again while "
        "another running request can be", group=SCHEDULING, ge=1)

    def __post_init__(self) -> None:
        validate(self)

    @property
    def headroom(self) -> bool:
        return self.admission_policy == HEADROOM

    @property
    def bounded(self) -> bool:
        return self.preemption_policy == BOUNDED


FIRST_RULES = SchedulingPolicy(admission_policy=FITS, preemption_policy=NEWEST)
