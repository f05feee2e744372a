"""Prometheus families of the autoscaler's state (FleetSnapshot.scaling, serve/autoscaler.py):
desired against actual workers, scale decisions by direction and reason, drain and cold-start
times. Nothing is rendered for a fleet of fixed size."""
from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from raypaged.core.autoscale_policy import (LOW_LOAD, MAX_WORKERS, MIN_WORKERS, PREEMPTIONS,
                                            QUEUE_WAIT)

P = "raypaged:"
# (direction, reason) of every decision the policy makes (core/autoscale_policy.py)
DECISION_KINDS = (("out", QUEUE_WAIT), ("out", PREEMPTIONS), ("out", MIN_WORKERS),
                  ("in", LOW_LOAD), ("in", MAX_WORKERS))


def scaling_families(scaling: dict, model_name: str):
    if not scaling:
        return
    lv = [model_name]

    def single(kind, name: str, doc: str, value: float):
        family = kind(P + name, doc, labels=["model_name"])
        family.add_metric(lv, value)
        return family

    workers = GaugeMetricFamily(P + "autoscaler_workers", "Workers by autoscaler state: desired "
                                "(the policy's count), serving, starting, draining; min/max: its "
                                "bounds.", labels=["model_name", "state"])
    for state in ("desired", "serving", "starting", "draining", "min_workers", "max_workers"):
        workers.add_metric(lv + [state], scaling[state])
    decisions = CounterMetricFamily(P + "autoscaler_decisions", "Scale decisions by direction "
                                    "(out, in) and reason.",
                                    labels=["model_name", "direction", "reason"])
    counts = {pair: 0 for pair in DECISION_KINDS}  # every series exists from the start
    counts.update({(d["direction"], d["reason"]): d["count"] for d in scaling["decisions_total"]})
    for (direction, reason), n in sorted(counts.items()):
        decisions.add_metric(lv + [direction, reason], n)
    yield workers
    yield single(GaugeMetricFamily, "autoscaler_predicted_wait_seconds", "Queued tokens / "
                 "(serving workers x capacity): the queue wait the policy scales out on.",
                 scaling["predicted_wait_s"])
    yield single(GaugeMetricFamily, "autoscaler_worker_capacity_tokens_per_second", "One "
                 "worker's tokens per second, measured while it was saturated.",
                 scaling["capacity_tokens_per_s"])
    yield decisions
    for name, key, doc, count_doc in (
            ("autoscaler_drain_seconds", "drains", "Seconds from a worker's drain to its leaving "
             "the fleet, summed over drains.", "Drained workers that left the fleet."),
            ("autoscaler_cold_start_seconds", "cold_starts", "Seconds from a new worker's "
             "spawn to its first answer (model load included), summed over cold starts.",
             "New workers that gave their first answer (cold starts).")):
        yield single(CounterMetricFamily, name, doc, scaling[key]["seconds_sum"])
        # the count alone: its help says what it counts, not the seconds of the sum above
        yield single(CounterMetricFamily, name.replace("_seconds", "s"), count_doc,
                     scaling[key]["count"])
    yield single(CounterMetricFamily, "autoscaler_drain_streams_moved", "Streams a draining "
                 "worker still ran at its drain deadline, continued elsewhere.",
                 scaling["drains"]["streams_moved"])
