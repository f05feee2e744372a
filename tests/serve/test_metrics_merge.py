"""Request metrics of several router replicas add up in one /metrics rendering (no Ray)."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from raypaged.serve.fleet import FleetSnapshot
from raypaged.serve.metrics import RequestMetrics, merge, render


def samples(text: str) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_replicas_counters_and_histograms_add_up():
    a, b = RequestMetrics(), RequestMetrics()
    a.inc("generation_tokens", value=5)
    b.inc("generation_tokens", value=7)
    a.inc("request_success", "stop")
    b.inc("request_success", "length")
    b.inc("request_success", "stop")
    a.observe("time_to_first_token_seconds", 0.03)
    b.observe("time_to_first_token_seconds", 3.0)
    m = samples(render(FleetSnapshot(), merge([a.snapshot(), b.snapshot()]), "m").decode())
    model = (("model_name", "m"),)
    assert m[("raypaged:generation_tokens_total", model)] == 12
    assert m[("raypaged:request_success_total", (("finished_reason", "stop"), *model))] == 2
    assert m[("raypaged:request_success_total", (("finished_reason", "length"), *model))] == 1
    ttft = "raypaged:time_to_first_token_seconds"
    assert m[(f"{ttft}_count", model)] == 2 and m[(f"{ttft}_sum", model)] == 3.03
    assert m[(f"{ttft}_bucket", (("le", "0.04"), *model))] == 1  # cumulative buckets
    assert m[(f"{ttft}_bucket", (("le", "5.0"), *model))] == 2
    assert m[(f"{ttft}_bucket", (("le", "+Inf"), *model))] == 2


def test_an_empty_fleet_still_renders_valid_text_with_zero_counters():
    m = samples(render(FleetSnapshot(), RequestMetrics().snapshot(), "m").decode())
    assert m[("raypaged:prompt_tokens_total", (("model_name", "m"),))] == 0
