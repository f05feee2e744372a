"""Prometheus metrics: request metrics kept by each router replica, and the controller's fleet view.

Names live under `raypaged:` and follow vLLM's one-to-one where vLLM has the metric (the table is
in docs/serving.md, "Metrics"): e.g. raypaged:kv_cache_usage_perc <-> vllm:kv_cache_usage_perc. Request metrics
are plain counters and bucket counts (`RequestMetrics`), so a replica can ship a snapshot to the
controller and any replica's /metrics can render the sum over all of them.
"""
from __future__ import annotations

import bisect
from itertools import accumulate
from operator import attrgetter
from types import SimpleNamespace
from typing import Iterable

from prometheus_client import generate_latest
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily)

from raypaged.core.autoscale_policy import (LOW_LOAD, MAX_WORKERS, MIN_WORKERS, PREEMPTIONS,
                                            QUEUE_WAIT)
from raypaged.serve.fleet import READY, FleetSnapshot

P = "raypaged:"

# Bucket bounds as in vLLM, so dashboards' quantile queries read alike.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
# Times a finished sequence was preempted (docs/scheduling.md: a healthy run preempts once, if at all)
PREEMPTION_BUCKETS = (0, 1, 2, 3, 4, 8)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

HISTOGRAMS = {
    "time_to_first_token_seconds": ("Time to first token.", TTFT_BUCKETS),
    "time_per_output_token_seconds": ("Mean time per output token after the first, per request.",
                                      TPOT_BUCKETS),
    "inter_token_latency_seconds": ("Time between output tokens.", TPOT_BUCKETS),
    "e2e_request_latency_seconds": ("End-to-end request latency.", E2E_BUCKETS),
}
COUNTERS = {  # name -> (help, label name or None)
    "prompt_tokens": ("Prompt tokens processed.", None),
    "generation_tokens": ("Generated tokens.", None),
    "request_success": ("Finished requests by finish reason.", "finished_reason"),
    "routing_decisions": ("Routing decisions by reason.", "reason"),
    "request_retries": ("Requests retried on another worker after a worker failure.", None),
    "suspected_poison_requests": (
        "Requests refused because two workers died serving them (refused), and the same "
        "requests sent again (refused_again).", "outcome"),
    "request_errors": ("Requests answered with an error, by HTTP status.", "status"),
    "shed_requests": ("Requests refused at the edge before any work was queued, by reason "
                      "(ttft_slo: a time to first token predicted over --ttft-slo-s; client_cap: 429, a client "
                      "at --max-requests-per-client).", "reason"),
}


# A ready worker's series: (family, name, its WorkerStats attribute, help).
GAUGE, COUNTER = GaugeMetricFamily, CounterMetricFamily
WORKER_SERIES = (
    (GAUGE, "num_requests_running", "engine.num_running",
     "Sequences running in the worker's engine."),
    (GAUGE, "num_requests_waiting", "engine.num_waiting",
     "Requests waiting in the worker's engine."),
    (GAUGE, "kv_cache_usage_perc", "engine.kv_cache_usage",
     "KV-cache usage: blocks in use / blocks (0..1)."),
    (GAUGE, "kv_cache_budget_bytes", "budget.kv_budget_bytes", "Bytes of the KV-cache budget."),
    (GAUGE, "kv_cache_bytes_per_token", "budget.bytes_per_token", "KV-cache bytes per token."),
    (GAUGE, "kv_cache_max_tokens", "budget.num_tokens", "Tokens that fit in the KV cache."),
    (GAUGE, "kv_cache_max_concurrency", "budget.max_seqs_at_max_model_len",
     "Sequences of max_model_len that fit in the KV cache at once."),
    (COUNTER, "prefix_cache_queries", "engine.memory.prefix_queries",
     "Prompt tokens looked up in the prefix cache."),
    (COUNTER, "prefix_cache_hits", "engine.memory.prefix_hits",
     "Prompt tokens served from the prefix cache."),
    (COUNTER, "prefix_cache_evictions", "engine.memory.evictions",
     "Cached blocks evicted for new data."),
    (COUNTER, "num_preemptions", "engine.num_preemptions",
     "Requests preempted (recomputed) for lack of blocks."),
    (COUNTER, "computed_tokens", "engine.preemption.computed_tokens",
     "Tokens fed to the model: prefill, decode and recompute."),
    (COUNTER, "recomputed_tokens", "engine.preemption.recomputed_tokens",
     "Tokens computed again after a preemption (prefix cache hits on resume excluded)."),
    (COUNTER, "preempted_seconds", "engine.preemption.preempted_seconds",
     "Seconds requests spent preempted, summed."),
    (COUNTER, "kv_cache_cow_copies", "engine.memory.cow_copies",
     "Copy-on-write block copies (n > 1 sampling)."),
)
# (direction, reason) of every decision the policy makes (core/autoscale_policy.py)
DECISION_KINDS = (("out", QUEUE_WAIT), ("out", PREEMPTIONS), ("out", MIN_WORKERS),
                  ("in", LOW_LOAD), ("in", MAX_WORKERS))


class RequestMetrics:
    """Counters and histograms of one router replica, as plain numbers."""

    def __init__(self) -> None:
        self.counters: dict[str, dict[str, float]] = {name: {} for name in COUNTERS}
        # name -> [bucket counts (one per bound, +Inf last), sum]
        self.histograms = {name: [[0] * (len(b) + 1), 0.0] for name, (_, b) in HISTOGRAMS.items()}

    def inc(self, name: str, label: str = "", value: float = 1.0) -> None:
        series = self.counters[name]
        series[label] = series.get(label, 0.0) + value

    def observe(self, name: str, value: float) -> None:
        hist = self.histograms[name]
        hist[0][bisect.bisect_left(HISTOGRAMS[name][1], value)] += 1
        hist[1] += value

    def snapshot(self) -> dict:
        return {"counters": {k: dict(v) for k, v in self.counters.items()},
                "histograms": {k: [list(c), s] for k, (c, s) in self.histograms.items()}}


def merge(snapshots: Iterable[dict]) -> dict:
    total = RequestMetrics().snapshot()
    for snap in snapshots:
        for name, series in snap["counters"].items():
            for label, value in series.items():
                total["counters"][name][label] = total["counters"][name].get(label, 0.0) + value
        for name, (counts, s) in snap["histograms"].items():
            hist = total["histograms"][name]
            hist[0] = [a + b for a, b in zip(hist[0], counts)]
            hist[1] += s
    return total


def render(fleet: FleetSnapshot, requests: dict, model_name: str) -> bytes:
    families = [*fleet_families(fleet, model_name), *scaling_families(fleet.scaling, model_name),
                *request_families(requests, model_name)]
    # generate_latest reads any collector; a registry would only hold this one
    return generate_latest(SimpleNamespace(collect=lambda: families))


def request_families(snap: dict, model_name: str):
    for name, (doc, label) in COUNTERS.items():
        fam = CounterMetricFamily(P + name, doc, labels=["model_name"] + ([label] if label else []))
        # an unlabelled counter has its one series, 0 before its first count
        series = snap["counters"][name] or ({} if label else {"": 0.0})
        for key, value in sorted(series.items()):
            fam.add_metric([model_name] + ([key] if label else []), value)
        yield fam
    for name, (doc, bounds) in HISTOGRAMS.items():
        counts, total = snap["histograms"][name]
        les = [repr(float(bound)) for bound in bounds] + ["+Inf"]
        fam = HistogramMetricFamily(P + name, doc, labels=["model_name"])
        fam.add_metric([model_name], list(zip(les, accumulate(counts))), sum_value=total)
        yield fam


def fleet_families(fleet: FleetSnapshot, model_name: str):
    labels = ["model_name", "worker"]
    up = GaugeMetricFamily(P + "worker_up", "1 when the worker is ready to take requests.",
                           labels=labels)
    restarts = CounterMetricFamily(P + "worker_restarts",
                                   "Times the worker process came back after a crash.",
                                   labels=labels)
    series = [(kind(P + name, doc, labels=labels), attrgetter(path))
              for kind, name, path, doc in WORKER_SERIES]
    blocks = GaugeMetricFamily(P + "kv_cache_blocks", "KV-cache blocks by state.",
                               labels=labels + ["state"])
    per_request = HistogramMetricFamily(P + "request_preemptions", "Times each finished sequence "
                                        "was preempted.", labels=labels)
    steps = CounterMetricFamily(P + "engine_steps", "Model steps run, by mode (cuda_graph, eager).",
                                labels=labels + ["mode"])
    for w in fleet.workers:
        lv = [model_name, w.worker_id]
        up.add_metric(lv, 1.0 if w.ready else 0.0)  # draining: 0 (it takes no new requests)
        restarts.add_metric(lv, w.restarts)
        s = w.stats
        if s is None or w.state != READY:
            continue
        for family, value in series:
            family.add_metric(lv, value(s))
        for state in ("used", "cached", "free"):
            blocks.add_metric(lv + [state], getattr(s.engine.memory, "blocks_" + state))
        times = s.engine.preemption.preempted_per_request
        # cumulative counts of sequences preempted at most b times, b in PREEMPTION_BUCKETS
        buckets = [(repr(float(b)), sum(times[:b + 1])) for b in PREEMPTION_BUCKETS]
        per_request.add_metric(lv, buckets + [("+Inf", sum(times))],
                               sum_value=sum(k * n for k, n in enumerate(times)))
        steps.add_metric(lv + ["cuda_graph"], s.graph_steps)
        steps.add_metric(lv + ["eager"], s.eager_steps)
    yield from (up, restarts, *(family for family, _ in series), blocks, per_request, steps)


def scaling_families(scaling: dict, model_name: str):
    """The autoscaler's state (FleetSnapshot.scaling, serve/autoscaler.py): desired against
    actual workers, scale decisions by direction and reason, drain and cold-start times.
    Nothing is rendered for a fleet of fixed size."""
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
