"""Ray shells around Worker and Controller: resources, restarts, and engine construction.

A serving application's controller is a Serve deployment-scoped actor (recreated by Serve when
it dies, removed with the application); its workers are detached, named actors that outlive it
and are adopted by the next one (detached_workers.py). A batch job's workers are its driver's
(create_workers): they outlive a controller that dies, and go with the job.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import re
import time

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError

from raypaged.config import EngineArgs
from raypaged.serve.allocator import worker_env_vars
from raypaged.serve.autoscaler import Autoscaler, policy_of, worker_id_of, worker_index
from raypaged.serve.config import POLL_INTERVAL_S, POLL_TIMEOUT_S, STEP_STALL_S, ServeOptions
from raypaged.serve.controller import Controller, WorkerDown, next_start
from raypaged.serve.detached_workers import (WORKER_NAMESPACE, fingerprint, kill_workers,
                                             named_workers, watch_application, worker_name)
from raypaged.serve.fleet import DEAD, RESTARTING, UNRESPONSIVE
from raypaged.serve.messages import WorkerStats
from raypaged.serve.worker import Worker

logger = logging.getLogger(__name__)


CONTROL = "control"  # the worker's concurrency group for the controller's calls
CONTROL_CONCURRENCY = 8
# router calls a worker runs at once beyond the requests it can hold (queued + running): enough
# that a burst of submits over its queue bound is answered "queue full" at once (a Rejected)
# instead of waiting in Ray's queue for the actor.
SUBMIT_HEADROOM = 64


@ray.remote(concurrency_groups={CONTROL: CONTROL_CONCURRENCY})
class WorkerActor(Worker):
    """Concurrency, explicitly: the routers' calls (submit, cancel, and each router's one
    outputs() stream) share the default group (max_concurrency, set from the queue bound and
    max_num_seqs); stats and health have their own group, so a worker holding its full load
    still answers the controller at once, and only a frozen one stays silent."""

    def __init__(self, engine: EngineArgs, worker_id: str, max_queued: int,
                 watch_app: str | None = None):
        from raypaged.engine import Engine

        if watch_app is not None:  # a detached worker: nothing else removes it
            watch_application(watch_app)
        back_off_restart()
        super().__init__(Engine.from_args(engine), worker_id, max_queued,
                         ray.get_runtime_context().get_node_id())

    # Worker's own methods, marked for Ray (a plain Worker ignores the mark)
    stats = ray.method(concurrency_group=CONTROL)(Worker.stats)
    health = ray.method(concurrency_group=CONTROL)(Worker.health)


def back_off_restart() -> None:
    """A worker process restarted after a crash waits before loading the model again, longer
    each crash in a row (controller.next_start). What the last incarnation of this actor kept lives in
    the GCS's key-value store under the actor's id, which stays the same across restarts."""
    from ray.experimental import internal_kv

    key = f"raypaged:restarts:{ray.get_runtime_context().get_actor_id()}"
    raw = internal_kv._internal_kv_get(key)
    delay, ledger = next_start(json.loads(raw) if raw else None, time.time())
    internal_kv._internal_kv_put(key, json.dumps(ledger))
    if delay:
        logger.warning("worker restarted after %d crashes in a row: waiting %.0f s before "
                       "loading the model", ledger["crashes"], delay)
        time.sleep(delay)


async def probe_worker(handle, cache_since: int) -> WorkerStats:
    """Liveness first (a hung engine step counts as unresponsive), then the stats, with the
    prefix cache's changes since `cache_since`."""
    try:
        health = await handle.health.remote()
        if health.stalled_s > STEP_STALL_S:
            raise WorkerDown(UNRESPONSIVE, f"no engine step has finished for "
                                           f"{health.stalled_s:.0f} s")
        return await handle.stats.remote(cache_since)
    except ActorUnavailableError as exc:
        raise WorkerDown(RESTARTING) from exc
    except ActorDiedError as exc:
        raise WorkerDown(DEAD, last_error_line(str(exc))) from exc


async def live_nodes() -> set[str]:
    """The ids of the cluster's live nodes, as the GCS sees them (ray.nodes() is a blocking
    call: off the controller's event loop)."""
    return {n["NodeID"] for n in await asyncio.to_thread(ray.nodes) if n["Alive"]}


def last_error_line(text: str) -> str:
    """`ValueError: ...` out of a remote traceback: the line a person needs to read."""
    lines = [ln.strip() for ln in text.splitlines()]
    errors = [ln for ln in lines if re.match(r"^[A-Za-z_.]*(Error|Exception)\b.*:", ln)]
    return errors[-1] if errors else (lines[0] if lines else text)


def worker_resources(fleet: ServeOptions) -> tuple[float, float]:
    """(num_cpus, num_gpus) per worker, from the configuration alone: unset is 1 CPU, no GPU.

    Never from a look at the cluster: KubeRay deploys the application as soon as the head is up,
    before worker pods (and their GPUs) join, so a look then would start GPU-less workers."""
    return (1.0 if fleet.cpus_per_worker is None else fleet.cpus_per_worker,
            0.0 if fleet.gpus_per_worker is None else fleet.gpus_per_worker)


def worker_threads(engine: EngineArgs, cpus: float, gpus: float, serving: bool) -> EngineArgs:
    """The engine settings with the worker's torch threads filled in: its CPUs, unless set. A
    serving worker's decode-only steps leave one of them to what runs around the model (its
    event loop, Ray, the router replica, Serve's proxy: docs/serving.md); prefill keeps all."""
    threads = engine.num_threads or (None if gpus else max(1, int(cpus)))
    if not threads:
        return engine
    decode = engine.decode_threads
    if serving and threads >= 2 and decode is None:
        decode = threads - 1
    return dataclasses.replace(engine, num_threads=threads, decode_threads=decode)


class WorkerFactory:
    """Starts the fleet's workers, all alike: one resource request (so a pending one is what
    Ray's autoscaler sees and provides a node for), one engine spec. `detached` (a Serve
    application): named and detached, and the running workers of the same spec are adopted."""

    def __init__(self, fleet: ServeOptions, engine: EngineArgs, detached: bool):
        self.fleet = fleet
        self.cpus, self.gpus = worker_resources(self.fleet)
        # detached workers serve HTTP (a Serve application); a batch job's workers do not
        self.engine = worker_threads(engine, self.cpus, self.gpus, serving=detached)
        self.detached = detached
        self.options = dict(
            num_cpus=self.cpus, num_gpus=self.gpus, max_restarts=-1, max_task_retries=0,
            scheduling_strategy="SPREAD",
            runtime_env={"env_vars": worker_env_vars(self.fleet.worker_allocator)},
            max_concurrency=self.fleet.max_queued_requests + self.engine.max_num_seqs
            + SUBMIT_HEADROOM)
        self.spec = fingerprint({"engine": dataclasses.asdict(self.engine),
                                 "max_queued": self.fleet.max_queued_requests,
                                 "options": self.options})
        self._next = 0

    def initial(self) -> list[tuple[str, object]]:
        """min_workers workers, or every running worker of this spec (up to max_workers): a
        restarted controller keeps the fleet the last one had scaled to."""
        low, high = self.fleet.worker_bounds
        indexes = list(range(low))
        if self.detached:
            existing = named_workers(self.fleet.app_name)
            indexes = sorted(worker_index(n.split(":")[-2]) for n in existing
                             if n.endswith(":" + self.spec))[:high]
            free = (i for i in range(low + high) if i not in indexes)
            indexes = sorted(indexes + [next(free) for _ in range(low - len(indexes))])
            keep = {worker_name(self.fleet.app_name, i, self.spec) for i in indexes}
            kill_workers([n for n in existing if n not in keep])  # other configs, surplus
            logger.info("adopting %d running workers, starting %d",
                        sum(n in keep for n in existing), len(keep) - len(set(existing) & keep))
        self._next = max(indexes, default=-1) + 1
        workers = [self.start(i) for i in indexes]
        logger.info("%d workers (%s CPU, %s GPU each)", len(workers), self.cpus, self.gpus)
        return workers

    def start(self, index: int | None = None) -> tuple[str, object]:
        """One worker (a new index unless given); created or, if running, adopted."""
        if index is None:
            index, self._next = self._next, self._next + 1
        named = dict(name=worker_name(self.fleet.app_name, index, self.spec),
                     namespace=WORKER_NAMESPACE, lifetime="detached",
                     get_if_exists=True) if self.detached else {}
        handle = WorkerActor.options(**self.options, **named).remote(
            self.engine, worker_id_of(index), self.fleet.max_queued_requests,
            self.fleet.app_name if self.detached else None)
        return worker_id_of(index), handle


def create_workers(fleet: ServeOptions, engine: EngineArgs,
                   detached: bool) -> list[tuple[str, object]]:
    """The fleet's worker actors, (worker id, handle) each, owned by the caller."""
    return WorkerFactory(fleet, engine, detached).initial()


@ray.remote
class ControllerActor(Controller):
    """`detached_workers`: the workers outlive this actor and the next one adopts them (a Serve
    application). `workers`: (id, handle) pairs its creator made with create_workers (a batch
    job's driver: they outlive this actor, and a new controller takes them over). Else this
    actor creates and owns them: they go when it goes."""

    def __init__(self, options: ServeOptions, engine: EngineArgs, detached_workers: bool = False,
                 workers: list[tuple[str, object]] | None = None):
        factory = None
        if workers is None:
            factory = WorkerFactory(options, engine, detached_workers)
            workers = factory.initial()
        # an unresponsive worker's process is killed, and Ray starts a new one (max_restarts)
        super().__init__(workers, probe_worker, POLL_INTERVAL_S, POLL_TIMEOUT_S,
                         options.route_cache_sample,
                         kill=functools.partial(ray.kill, no_restart=False),
                         unresponsive_timeout_s=options.worker_unresponsive_timeout_s,
                         live_nodes=live_nodes)
        if factory is not None and options.autoscaling:  # a drained worker goes for good
            self.autoscaler = Autoscaler(policy_of(options), factory.start,
                                         functools.partial(ray.kill, no_restart=True),
                                         options.drain_timeout_s, time.time(), len(workers))
