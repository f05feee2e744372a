"""Preemption counters reach /metrics (names mappable to vLLM's num_preemptions) and /fleet,
per worker and summed, from constructed snapshots (no Ray)."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from raypaged.config import KVPlan
from raypaged.core.contracts import EngineStats, MemoryStats, PreemptionStats
from raypaged.serve.fleet import READY, FleetSnapshot, WorkerView
from raypaged.serve.messages import WorkerStats
from raypaged.serve.metrics import RequestMetrics, render


def worker(wid: str, preemptions: int, p: PreemptionStats) -> WorkerView:
    memory = MemoryStats(64, 16, 10, 4, 50, 0, 0, 0, 0)
    engine = EngineStats(memory, 2, 1, preemptions, 9, 100, preemption=p)
    budget = KVPlan(1 << 20, 1024, block_size=16, num_blocks=64, max_model_len=1024)
    stats = WorkerStats(wid, "inc", 1, "m", 1024, 16, budget, engine, num_active=3)
    return WorkerView(wid, READY, handle=None, stats=stats)


FLEET = FleetSnapshot(workers=(
    worker("w0", 3, PreemptionStats(1000, 40, 1.5, (5, 2, 0, 1))),  # one sequence 3 times
    worker("w1", 1, PreemptionStats(600, 10, 0.25, (4, 1))),
))


def samples() -> dict:
    text = render(FLEET, RequestMetrics().snapshot(), "m").decode()
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))):
            s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_prometheus_has_the_preemption_counters_and_histogram_per_worker():
    m = samples()
    w0 = (("worker", "w0"),)
    assert m[("raypaged:num_preemptions_total", w0)] == 3
    assert m[("raypaged:computed_tokens_total", w0)] == 1000
    assert m[("raypaged:recomputed_tokens_total", w0)] == 40
    assert m[("raypaged:preempted_seconds_total", w0)] == 1.5
    hist = "raypaged:request_preemptions"
    buckets = {le: m[(f"{hist}_bucket", (("le", le), *w0))]
               for le in ("0.0", "1.0", "2.0", "3.0", "4.0", "8.0", "+Inf")}
    assert buckets == {"0.0": 5, "1.0": 7, "2.0": 7, "3.0": 8, "4.0": 8, "8.0": 8, "+Inf": 8}
    assert m[(f"{hist}_count", w0)] == 8
    assert m[(f"{hist}_sum", w0)] == 2 * 1 + 1 * 3  # = the worker's preemptions of finished ones
    assert m[(f"{hist}_bucket", (("le", "0.0"), ("worker", "w1")))] == 4


def test_fleet_json_has_them_per_worker_and_in_total():
    js = FLEET.to_json()
    assert js["workers"][1]["preemption"] == {
        "computed_tokens": 600, "recomputed_tokens": 10, "recomputed_fraction": 10 / 600,
        "preempted_seconds": 0.25, "preempted_per_request": [4, 1]}
    total = js["total"]
    assert total["num_preemptions"] == 4
    assert total["preemption"] == {
        "computed_tokens": 1600, "recomputed_tokens": 50, "recomputed_fraction": 50 / 1600,
        "preempted_seconds": 1.75, "preempted_per_request": [9, 3, 0, 1]}
