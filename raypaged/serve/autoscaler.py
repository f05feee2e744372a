"""Autoscaler: the controller's hand on the fleet's size. After every poll round it turns the
workers' stats into a LoadSample, asks the policy (core/autoscale_policy.py) for the desired
count, and moves the fleet towards it:

    desired > serving + pending   spawn workers: new actors with the same resource request, so
                                  on an autoscaling cluster a pending actor brings up a node
    desired < serving + pending   drain the serving worker with the fewest requests: it leaves
                                  the routers' ready set at once (no new requests), finishes its
                                  streams, and leaves the fleet when it has none left or at
                                  drain_timeout_s; the routers then continue what it still ran
                                  on other workers (generation.py's continuation), and the actor
                                  is killed DRAIN_GRACE_S later, once they have moved on

No Ray here: the Ray shell (actors.py) passes `spawn` and `retire`.
"""
from __future__ import annotations

import collections
import logging
from typing import Any, Callable

from raypaged.core.autoscale_policy import LoadSample, ScalePolicy, ScaleRound, WorkerCounters
from raypaged.serve.config import ServeOptions
from raypaged.serve.fleet import DEAD, READY

logger = logging.getLogger(__name__)

# After a drained worker leaves the snapshot: routers see that within a refresh (0.25 s) and
# their streams move within a watch period (0.25 s); its actor is killed after this long.
DRAIN_GRACE_S = 3.0
DECISIONS_KEPT = 20


def policy_of(options: ServeOptions) -> ScalePolicy:
    return ScalePolicy(*options.worker_bounds, options.scale_target_wait_s, options.scale_in_load,
                       options.scale_window_s, options.scale_out_cooldown_s,
                       options.scale_in_cooldown_s)


class Autoscaler:
    def __init__(self, policy: ScalePolicy, spawn: Callable[[], tuple[str, Any]],
                 retire: Callable[[Any], None], drain_timeout_s: float, start_s: float,
                 desired: int):
        self.policy, self.spawn, self.retire = policy, spawn, retire
        self.drain_timeout_s = drain_timeout_s
        self.round = ScaleRound(policy, desired)  # samples, capacity, history: shared with sim
        self._last_s = start_s
        self._spawned_at: dict[str, float] = {}
        self._retiring: list[tuple[float, Any]] = []  # (kill at, handle)
        self.decisions: collections.deque[dict] = collections.deque(maxlen=DECISIONS_KEPT)
        self.decision_counts: collections.Counter[tuple[str, str]] = collections.Counter()
        self.drains = {"count": 0, "seconds_sum": 0.0, "last_s": None, "streams_moved": 0}
        self.cold_starts = {"count": 0, "seconds_sum": 0.0, "last_s": None}

    # -- one round, after each poll -------------------------------------------------------
    def step(self, controller, now: float) -> None:
        views = controller.views()
        self._cold_starts(views, now)
        sample = self._sample(views, now, controller.held_prompt_tokens())
        previous, decision = self.round.decide(sample)
        if decision.changed:
            direction = "out" if decision.desired > previous else "in"
            self.decision_counts[(direction, decision.reason)] += 1
            self.decisions.append({"time": now, "from": previous, "to": decision.desired,
                                   "reason": decision.reason, "wait_s": sample.wait_s})
            logger.info("autoscale %s: %d -> %d workers (%s; predicted wait %.2f s)",
                        direction, previous, decision.desired, decision.reason, sample.wait_s)
        self._converge(controller, views, now)
        self._finish_drains(controller, views, now)
        self._kill_retired(now)

    def _sample(self, views, now: float, held_tokens: int) -> LoadSample:
        interval = max(1e-6, now - self._last_s)
        self._last_s = now
        counters = {v.worker_id: WorkerCounters(
            v.stats.engine.preemption.computed_tokens, v.stats.engine.num_preemptions,
            v.stats.engine.num_queued_tokens, v.draining_since is not None, v.stats.incarnation)
            for v in views if v.state == READY and v.stats is not None}
        return self.round.sample(now, interval, counters, **_counts(views),
                                 held_tokens=held_tokens)

    def _converge(self, controller, views, now: float) -> None:
        current = [v for v in views if v.draining_since is None and v.state != DEAD]
        for _ in range(self.round.desired - len(current)):
            worker_id, handle = self.spawn()
            self._spawned_at[worker_id] = now
            controller.add_worker(worker_id, handle)
        surplus = len(current) - self.round.desired
        if surplus > 0:
            # the ready worker with the least to finish; the newest of equals
            ready = sorted((v for v in current if v.ready),
                           key=lambda v: (v.load, -worker_index(v.worker_id)))
            for v in ready[:surplus]:
                logger.info("draining %s (%d requests)", v.worker_id, v.load)
                controller.set_draining(v.worker_id, now)

    def _finish_drains(self, controller, views, now: float) -> None:
        for v in views:
            if v.draining_since is None:
                continue
            waited = now - v.draining_since
            if v.state == READY and v.load > 0 and waited < self.drain_timeout_s:
                continue
            moved = v.load if v.state == READY else 0
            logger.info("%s drained in %.1f s (%d streams continue elsewhere)", v.worker_id,
                        waited, moved)
            _tally(self.drains, waited)
            self.drains["streams_moved"] += moved
            controller.remove_worker(v.worker_id)
            self._retiring.append((now + DRAIN_GRACE_S, v.handle))

    def _kill_retired(self, now: float) -> None:
        due = [h for at, h in self._retiring if at <= now]
        self._retiring = [(at, h) for at, h in self._retiring if at > now]
        for handle in due:
            self.retire(handle)

    def _cold_starts(self, views, now: float) -> None:
        for v in views:
            started = self._spawned_at.get(v.worker_id)
            if started is not None and v.state == READY:
                del self._spawned_at[v.worker_id]
                _tally(self.cold_starts, now - started)

    # -- what /fleet and /metrics show ------------------------------------------------------
    def to_json(self, views) -> dict:
        samples = self.round.samples
        return {
            "min_workers": self.policy.min_workers, "max_workers": self.policy.max_workers,
            "desired": self.round.desired, **_counts(views),
            "capacity_tokens_per_s": self.round.capacity.tokens_per_s,
            "predicted_wait_s": samples[-1].wait_s if samples else 0.0,
            "queued_tokens": samples[-1].queued_tokens if samples else 0,
            "decisions": list(self.decisions),
            "decisions_total": [{"direction": d, "reason": r, "count": n}
                                for (d, r), n in sorted(self.decision_counts.items())],
            "drains": dict(self.drains), "cold_starts": dict(self.cold_starts)}


def _counts(views) -> dict[str, int]:
    """Workers serving, on their way to serving (starting, restarting, not answering) and
    draining."""
    return {"serving": sum(v.ready for v in views),
            "starting": sum(v.draining_since is None and v.state not in (READY, DEAD)
                            for v in views),
            "draining": sum(v.draining_since is not None for v in views)}


def _tally(times: dict, seconds: float) -> None:
    times["count"] += 1
    times["seconds_sum"] += seconds
    times["last_s"] = seconds


def worker_id_of(index: int) -> str:
    """The name `raypaged serve` gives its worker i. Routing's rendezvous order hashes it, so a
    replay of a real fleet (benchmarks/fleet_sim_calibrate.py) names its workers alike."""
    return f"worker-{index}"


def worker_index(worker_id: str) -> int:
    """`worker-<i>` -> i"""
    return int(worker_id.rsplit("-", 1)[1])
