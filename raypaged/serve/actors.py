"""Ray shells around Worker and Controller: resources, restarts, and engine construction.

Workers are owned by the controller (they go when it goes); the controller is a Serve
deployment-scoped actor, created once per application and removed with it.
"""
from __future__ import annotations

import importlib
import logging
import re

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError

from raypaged.serve.allocator import worker_env_vars
from raypaged.serve.config import FleetConfig, ServeArgs
from raypaged.serve.controller import Controller, WorkerDown
from raypaged.serve.fleet import DEAD, RESTARTING
from raypaged.serve.worker import Worker, WorkerStats

logger = logging.getLogger(__name__)

DEFAULT_ENGINE_FACTORY = "raypaged.engine:build_engine"


def build_engine_from(engine_kwargs: dict, factory: str | None, num_threads: int | None):
    """Import and call the engine factory: `raypaged.engine:build_engine(EngineArgs(...))` by
    default; tests pass their own `module:function` taking the kwargs dict."""
    if factory and factory != DEFAULT_ENGINE_FACTORY:
        module, _, name = factory.partition(":")
        return getattr(importlib.import_module(module), name)(engine_kwargs)
    from raypaged.engine import EngineArgs, build_engine
    return build_engine(EngineArgs(**engine_kwargs, num_threads=num_threads))


@ray.remote
class WorkerActor(Worker):
    def __init__(self, engine_kwargs: dict, worker_id: str, num_threads: int | None,
                 max_queued: int, engine_factory: str | None = None):
        if num_threads:
            import torch  # only workers pay for torch; routers and the controller never do
            torch.set_num_threads(num_threads)
        super().__init__(build_engine_from(engine_kwargs, engine_factory, num_threads),
                         worker_id, max_queued)


async def probe_worker(handle) -> WorkerStats:
    try:
        return await handle.stats.remote()
    except ActorUnavailableError as exc:
        raise WorkerDown(RESTARTING) from exc
    except ActorDiedError as exc:
        raise WorkerDown(DEAD, last_error_line(str(exc))) from exc


def last_error_line(text: str) -> str:
    """`ValueError: ...` out of a remote traceback: the line a person needs to read."""
    lines = [ln.strip() for ln in text.splitlines()]
    errors = [ln for ln in lines if re.match(r"^[A-Za-z_.]*(Error|Exception)\b.*:", ln)]
    return errors[-1] if errors else (lines[0] if lines else text)


def worker_resources(fleet: FleetConfig) -> tuple[float, float]:
    """(num_cpus, num_gpus) per worker: one GPU each when the cluster has GPUs, else its CPUs
    shared evenly (at least one each)."""
    total = ray.cluster_resources()
    gpus = fleet.gpus_per_worker
    if gpus is None:
        gpus = 1.0 if total.get("GPU", 0) >= 1 else 0.0
    cpus = fleet.cpus_per_worker
    if cpus is None:
        cpus = 1.0 if gpus else max(1.0, float(int(total.get("CPU", 1) // fleet.num_workers)))
    return cpus, gpus


@ray.remote
class ControllerActor(Controller):
    def __init__(self, args: dict):
        config = ServeArgs(**args).to_config()
        fleet = config.fleet
        cpus, gpus = worker_resources(fleet)
        threads = fleet.num_threads or (None if gpus else max(1, int(cpus)))
        runtime_env = {"env_vars": worker_env_vars(fleet.allocator)}
        workers = []
        for i in range(fleet.num_workers):
            worker_id = f"worker-{i}"
            handle = WorkerActor.options(
                num_cpus=cpus, num_gpus=gpus, max_restarts=-1, max_task_retries=0,
                scheduling_strategy="SPREAD", runtime_env=runtime_env,
            ).remote(fleet.engine, worker_id, threads, fleet.max_queued_per_worker,
                     fleet.engine_factory)
            workers.append((worker_id, handle))
        logger.info("started %d workers (%s CPU, %s GPU each)", fleet.num_workers, cpus, gpus)
        super().__init__(workers, probe_worker, fleet.poll_interval_s, fleet.poll_timeout_s)
