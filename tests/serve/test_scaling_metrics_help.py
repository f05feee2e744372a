"""The autoscaler's families say what they count: a count of drains or cold starts is not
described as seconds (no Ray)."""
from __future__ import annotations

from raypaged.serve.metrics import scaling_families

SCALING = {"desired": 1, "serving": 1, "starting": 0, "draining": 0, "min_workers": 1,
           "max_workers": 2, "decisions_total": [], "predicted_wait_s": 0.0,
           "capacity_tokens_per_s": 0.0,
           "drains": {"seconds_sum": 3.0, "count": 2, "streams_moved": 0},
           "cold_starts": {"seconds_sum": 9.0, "count": 1}}


def test_count_counters_are_not_described_as_seconds():
    docs = {f.name: f.documentation for f in scaling_families(SCALING, "m")}
    for name in ("raypaged:autoscaler_drain_seconds", "raypaged:autoscaler_cold_start_seconds"):
        assert docs[name].startswith("Seconds")
    for name in ("raypaged:autoscaler_drains", "raypaged:autoscaler_cold_starts"):
        assert not docs[name].startswith("Seconds"), docs[name]
