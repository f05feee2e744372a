"""The fleet view: what the controller knows about every worker, as frozen, picklable values.

Routers read it (ready workers, their load), /metrics renders it, and `totals()` adds it up into
the fleet's memory budget.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import zip_longest
from typing import Any

from raypaged.core.contracts import PreemptionStats
from raypaged.serve.messages import WorkerStats

STARTING = "starting"          # created, never answered yet (loading the model)
READY = "ready"
UNRESPONSIVE = "unresponsive"  # alive as far as Ray knows, but the last poll timed out
RESTARTING = "restarting"      # Ray is restarting the actor after a crash
DEAD = "dead"                  # gone for good (killed without restart)

# The KV plan's figures as /fleet shows them per worker.
BUDGET_FIELDS = ("kv_budget_bytes", "bytes_per_token", "bytes_per_block", "num_blocks",
                 "num_tokens", "max_seqs_at_max_model_len")


@dataclass(frozen=True)
class WorkerView:
    worker_id: str
    state: str
    handle: Any = field(repr=False, compare=False)
    stats: WorkerStats | None = None  # the last good poll (kept while unresponsive)
    restarts: int = 0                 # times a new incarnation answered
    since: float = 0.0                # when the state last changed
    error: str | None = None          # why it is restarting / dead, when known
    draining_since: float | None = None  # scale-in: takes no new requests, finishes its own
    kills: int = 0                    # times the controller killed it for being unresponsive
    killed_at: float | None = None    # the last of those
    drain_tokens_per_s: float | None = None  # queue drain rate (core/ttft_slo.py); None: not yet
    node_lost: bool = False           # down, and the node it last ran on is dead (controller)

    @property
    def ready(self) -> bool:
        """Takes new requests."""
        return self.state == READY and self.draining_since is None

    @property
    def load(self) -> int:
        return self.stats.num_active if self.stats is not None else 0


@dataclass(frozen=True)
class FleetSnapshot:
    version: int = 0
    workers: tuple[WorkerView, ...] = ()
    # router replica id -> its request metrics (RequestMetrics.snapshot()), for /metrics
    router_metrics: dict = field(default_factory=dict)
    # worker id -> CacheView of its prefix cache: kept by each router's fleet client (the
    # controller sends deltas), attached to the snapshot it hands out; not sent by the controller
    caches: dict = field(default_factory=dict, compare=False)
    # the autoscaler's state for /fleet and /metrics (serve/autoscaler.py); {} when not scaling
    scaling: dict = field(default_factory=dict, compare=False)
    epoch: str = ""  # the controller's (Controller.snapshot): versions count within one

    def ready(self) -> list[WorkerView]:
        return [w for w in self.workers if w.ready]

    def all_dead(self) -> bool:
        return bool(self.workers) and all(w.state == DEAD for w in self.workers)

    def worker(self, worker_id: str) -> WorkerView | None:
        return next((w for w in self.workers if w.worker_id == worker_id), None)

    def renewed(self, worker_id: str, incarnation: str | None) -> bool:
        """Ready again as another process than `incarnation` (one that failed)."""
        view = self.worker(worker_id)
        return (incarnation is not None and view is not None and view.ready
                and view.stats is not None and view.stats.incarnation != incarnation)

    def totals(self) -> dict:
        """The fleet's memory budget and cache counters, summed over workers with stats."""
        with_stats = [w.stats for w in self.workers if w.ready and w.stats is not None]
        keys = ("kv_budget_bytes", "num_blocks", "num_tokens", "max_seqs_at_max_model_len")
        out = {k: sum(getattr(s.budget, k) for s in with_stats) for k in keys}
        mem = ("blocks_used", "blocks_cached", "blocks_free", "prefix_queries", "prefix_hits",
               "evictions", "cow_copies")
        out.update({k: sum(getattr(s.engine.memory, k) for s in with_stats) for k in mem})
        engine = ("num_running", "num_waiting", "num_preemptions")
        out.update({k: sum(getattr(s.engine, k) for s in with_stats) for k in engine})
        out.update(
            bytes_per_token=with_stats[0].budget.bytes_per_token if with_stats else 0,
            preemption=_sum_preemption([s.engine.preemption for s in with_stats]),
            workers_ready=len(with_stats), workers_total=len(self.workers))
        out["kv_cache_usage"] = out["blocks_used"] / out["num_blocks"] if out["num_blocks"] else 0.0
        out["prefix_hit_rate"] = (out["prefix_hits"] / out["prefix_queries"]
                                  if out["prefix_queries"] else 0.0)
        return out

    def to_json(self) -> dict:
        """For GET /fleet: per worker and in total."""
        workers = []
        for w in self.workers:
            item = {"worker_id": w.worker_id, "state": w.state, "restarts": w.restarts,
                    "kills": w.kills}
            if w.draining_since is not None:
                item["draining_since"] = w.draining_since
            if w.error:
                item["error"] = w.error
            if w.node_lost:
                item["node_lost"] = True
            if w.stats is not None:
                s = w.stats
                item.update(
                    pid=s.pid, load=s.num_active, kv_cache_usage=s.engine.kv_cache_usage,
                    budget={k: getattr(s.budget, k) for k in BUDGET_FIELDS},
                    memory=vars(s.engine.memory),
                    num_running=s.engine.num_running, num_waiting=s.engine.num_waiting,
                    num_preemptions=s.engine.num_preemptions, num_steps=s.engine.num_steps,
                    preemption=_preemption_json(s.engine.preemption),
                    graph_steps=s.graph_steps, eager_steps=s.eager_steps,
                    queued_tokens=s.engine.num_queued_tokens,
                    drain_tokens_per_s=w.drain_tokens_per_s)
            workers.append(item)
        from raypaged.serve.metrics import merge  # (metrics.py imports this module)
        counters = merge(self.router_metrics.values())["counters"]  # every router replica's
        out = {"workers": workers, "total": self.totals(),
               "suspected_poison_requests": counters["suspected_poison_requests"],
               "shed_requests": counters["shed_requests"]}
        if self.scaling:
            out["scaling"] = self.scaling
        return out


def _preemption_json(p) -> dict:
    """PreemptionStats for /fleet: the counters, and the recomputed share of computed tokens."""
    return {"computed_tokens": p.computed_tokens, "recomputed_tokens": p.recomputed_tokens,
            "recomputed_fraction": p.recomputed_tokens / p.computed_tokens if p.computed_tokens
            else 0.0, "preempted_seconds": p.preempted_seconds,
            "preempted_per_request": list(p.preempted_per_request)}


def _sum_preemption(stats: list) -> dict:
    per_request = zip_longest(*(p.preempted_per_request for p in stats), fillvalue=0)
    return _preemption_json(PreemptionStats(
        sum(p.computed_tokens for p in stats), sum(p.recomputed_tokens for p in stats),
        sum(p.preempted_seconds for p in stats), tuple(map(sum, per_request))))
