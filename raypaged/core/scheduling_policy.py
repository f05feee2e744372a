"""How the scheduler admits waiting requests and whom it preempts: one frozen set of rules.

The settings are `EngineArgs`' (raypaged/config.py: `raypaged serve --admission-policy fits`,
the Serve YAML and `LLM(...)` all reach that one definition); this is the scheduler's view of
them, so that core and the fleet simulator build a Scheduler without an EngineArgs. The defaults
are the rules of docs/scheduling.md; FIRST_RULES (admit whatever fits now, preempt the newest)
restores the scheduler's first behaviour for comparison (benchmarks/kv_waste.py runs both).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from raypaged.config import BOUNDED, FITS, HEADROOM, NEWEST, SCHEDULER, EngineArgs
from raypaged.settings import same_setting, validate

__all__ = ["SchedulingPolicy", "FIRST_RULES", "policy_of", "HEADROOM", "FITS", "BOUNDED", "NEWEST"]


@dataclass(frozen=True)
class SchedulingPolicy:
    admission_policy: str = same_setting(EngineArgs, "admission_policy", group=SCHEDULER)
    preemption_policy: str = same_setting(EngineArgs, "preemption_policy", group=SCHEDULER)
    kv_watermark: float = same_setting(EngineArgs, "kv_watermark", group=SCHEDULER)
    decode_reserve: float = same_setting(EngineArgs, "decode_reserve", group=SCHEDULER)
    protect_after_preemptions: int = same_setting(EngineArgs, "protect_after_preemptions",
                                                  group=SCHEDULER)

    def __post_init__(self) -> None:
        validate(self)

    @property
    def headroom(self) -> bool:
        return self.admission_policy == HEADROOM

    @property
    def bounded(self) -> bool:
        return self.preemption_policy == BOUNDED


def policy_of(args) -> SchedulingPolicy:
    """The scheduling rules set in an EngineArgs (or anything with the same attributes)."""
    return SchedulingPolicy(**{f.name: getattr(args, f.name) for f in fields(SchedulingPolicy)})


FIRST_RULES = SchedulingPolicy(admission_policy=FITS, preemption_policy=NEWEST)
