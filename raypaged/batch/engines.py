"""The engine pool of a batch job: the serving fleet without HTTP.

    the driver ─> WorkerActors (create_workers), built by raypaged.engine.Engine.from_args, owned by
                  the driver: restarted by Ray when they die (max_restarts=-1), gone with the job
               ─> ControllerActor (0 CPUs) polling those workers; when it dies it is made again
                  over the same workers (Controllers)
    RayFleetClient (in the driver)        ─> the fleet snapshot; streams to the workers
    OpenAIFrontend + Dispatcher + Router  ─> each row exactly as the HTTP API serves a request

So a row is validated, tokenized, routed (prefix affinity), retried after a lost worker, and
answered by the same code as an HTTP request: one request model, one response builder.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import ray
from ray.exceptions import ActorDiedError

from raypaged.batch.options import BatchOptions
from raypaged.config import EngineArgs, absolute_model_path
from raypaged.serve.actors import ControllerActor, create_workers
from raypaged.serve.config import ServeArgs, ServeOptions
from raypaged.serve.frontend import ModelInfo, OpenAIFrontend
from raypaged.serve.dispatch import Dispatcher
from raypaged.serve.metrics import RequestMetrics
from raypaged.serve.ray_fleet import RayFleetClient
from raypaged.serve.routing import Router
from raypaged.settings import settings_of


class FleetFailed(RuntimeError):
    """The engines cannot serve: every one failed (to start, or for good)."""


def fleet_args(engine: EngineArgs, options: BatchOptions) -> ServeArgs:
    """The serving application's arguments for this job's engines and routing."""
    values = {f.name: getattr(engine, f.name) for f in settings_of(EngineArgs)
              if f.metadata["serve"] and getattr(engine, f.name) is not None}
    values["model"] = absolute_model_path(values.get("model"))
    return ServeArgs(
        app_name="raypaged-batch", workers=options.workers,
        cpus_per_worker=options.cpus_per_worker, gpus_per_worker=options.gpus_per_worker,
        # the job bounds what it sends (max_inflight); a worker never needs to refuse a row
        max_queued_requests=options.max_inflight,
        routing="hash" if options.prefix_grouping else "round_robin",
        route_prefix_blocks=options.group_prefix_blocks, **values)


class Controllers:
    """The job's controller, made again over the same workers when it is found dead.

    RayFleetClient calls resolve() when it starts and after a call to the controller failed;
    meanwhile it routes from its last snapshot, and streams (driver -> worker) go on. Not a
    Ray-restarted actor: a restart is asynchronous and fails calls meanwhile, a new actor is
    ready when created."""

    def __init__(self, options: ServeOptions, engine: EngineArgs,
                 workers: list[tuple[str, object]]):
        self.options, self.engine, self.workers = options, engine, workers
        self.handle = self._new()

    def _new(self):
        return ControllerActor.options(num_cpus=0).remote(self.options, self.engine,
                                                          workers=self.workers)

    async def resolve(self):
        try:
            await self.handle.__ray_ready__.remote()
        except ActorDiedError as exc:
            print(f"raypaged batch: the controller died ({type(exc).__name__}); starting a new "
                  "one over the same engines", flush=True)
            self.handle = self._new()
        return self.handle

    def kill(self) -> None:
        """The controller and every engine: the job is over."""
        ray.kill(self.handle)
        for _, worker in self.workers:
            ray.kill(worker, no_restart=True)


@dataclass
class EnginePool:
    controllers: Controllers
    fleet: RayFleetClient
    frontend: OpenAIFrontend
    block_size: int

    @classmethod
    async def start(cls, args: ServeArgs) -> "EnginePool":
        options, engine = args.split()
        workers = create_workers(options, engine, detached=False)
        controllers = Controllers(options, engine, workers)
        fleet = RayFleetClient(controllers.resolve, "batch", RequestMetrics())
        try:
            await fleet.start()
            snap = await _all_ready(fleet, options.workers)
        except RuntimeError as exc:  # every worker failed to start: the engine's own reason
            await fleet.stop()
            controllers.kill()
            raise FleetFailed(str(exc)) from None
        worker = snap.ready()[0]
        tokenizer = await worker.handle.get_tokenizer.remote()
        block_size = worker.stats.block_size
        dispatcher = Dispatcher(fleet, Router(options, block_size), fleet.metrics)
        frontend = OpenAIFrontend(dispatcher, tokenizer, ModelInfo.of(worker.stats, tokenizer))
        return cls(controllers, fleet, frontend, block_size)

    def check_alive(self) -> None:
        snap = self.fleet.snapshot()
        if snap.all_dead():
            causes = sorted({w.error or "unknown" for w in snap.workers})
            raise FleetFailed(f"every engine failed: {'; '.join(causes)}")

    async def stop(self) -> None:
        await self.fleet.stop()
        self.controllers.kill()


async def _all_ready(fleet: RayFleetClient, workers: int):
    """Start only when every engine is up: rendezvous order over a fleet that is still growing
    would send a prefix group to one engine, then to another."""
    last_log = time.monotonic()
    while True:
        snap = fleet.snapshot()
        if len(snap.ready()) == workers:
            return snap
        dead = [w for w in snap.workers if w.state == "dead"]
        if dead:
            causes = sorted({w.error or "unknown" for w in dead})
            raise RuntimeError(f"{len(dead)} of {workers} engines failed to start: "
                               f"{'; '.join(causes)}")
        if time.monotonic() - last_log > 10:
            last_log = time.monotonic()
            print(f"raypaged batch: waiting for engines, {len(snap.ready())} of {workers} ready",
                  flush=True)
        await asyncio.sleep(0.2)
