"""The Serve application: an OpenAI ingress (router replicas) and its fleet controller.

    build_app(args) ─> OpenAIRouter deployment (N replicas, FastAPI ingress, 0 CPUs)
                         └─ deployment-scoped actor "controller" (ControllerActor, one per app,
                            recreated by Serve when it dies, removed with the app)
                              ─> WorkerActors: detached and named, so they outlive a controller
                                 and the next one adopts them; each exits once the app is gone
                                 (detached_workers.py); Ray restarts one that crashes

`raypaged serve` and Serve config files (`import_path: raypaged.serve.app:build_app`) both go
through `build_app`, with the same arguments (ServeArgs), validated there once: the router, the
controller and its workers are handed the frozen ServeOptions and EngineArgs.
"""
from __future__ import annotations

import asyncio
import logging

from ray import serve
from ray.serve.config import BackpressureConfig, DeploymentActorConfig

from raypaged.serve.actors import ControllerActor
from raypaged.serve.api_key import resolve_api_key
from raypaged.serve.client_gate import ClientGate
from raypaged.serve.config import SNAPSHOT_INTERVAL_S, ServeArgs, ServeOptions
from raypaged.serve.frontend import ModelInfo, OpenAIFrontend
from raypaged.serve.dispatch import Dispatcher
from raypaged.serve.http_app import build_http_app
from raypaged.serve.ingress import behind_haproxy, haproxy_forwards_client
from raypaged.serve.limits import RequestLimits
from raypaged.serve.metrics import RequestMetrics, merge, render
from raypaged.serve.replica_bind import bind_replica_grpc_to_node_ip
from raypaged.serve.ray_fleet import RayFleetClient
from raypaged.serve.routing import Router
from raypaged.serve.ttft_shed import TTFTShedder

logger = logging.getLogger(__name__)

CONTROLLER = "controller"


async def resolve_controller():
    """The application's controller; Serve may still be creating (or recreating) it."""
    while True:
        try:  # a GCS lookup: off the event loop, which keeps serving meanwhile
            return await asyncio.to_thread(serve.get_deployment_actor, CONTROLLER)
        except ValueError:
            await asyncio.sleep(0.2)


@serve.ingress()
class OpenAIRouter:
    async def __init__(self, options: ServeOptions):
        bind_replica_grpc_to_node_ip()  # before Serve starts this replica's gRPC server
        self.config = options
        # A key in the arguments wins; else the replica's environment (the cluster's: a
        # Kubernetes Secret), so keys need not sit in config files. Set but empty: refused here,
        # before the fleet starts, and the deployment fails with the reason.
        self.api_key = resolve_api_key(self.config.api_key)
        self.metrics = RequestMetrics()
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.fleet = RayFleetClient(resolve_controller, self.replica_id, self.metrics,
                                    refresh_s=SNAPSHOT_INTERVAL_S)
        snapshot = await self.fleet.start()
        worker = snapshot.ready()[0]
        tokenizer = await worker.handle.get_tokenizer.remote()
        self.info = ModelInfo.of(worker.stats, tokenizer, self.config.served_model_name)
        # behind an HAProxy that does not forward the client's address every request comes
        # from its address: one client for all, whose cap would be everyone's (client_gate.py)
        clients = not behind_haproxy() or haproxy_forwards_client()
        if not clients:
            logger.warning("HAProxy ingress without the client's address: every request comes "
                           "from HAProxy's, so max_requests_per_client and fair_admission are off")
        gate = ClientGate(self.config.max_requests_per_client if clients else 0,
                          self.config.fair_admission and clients, self.fleet.snapshot,
                          self.metrics)
        dispatcher = Dispatcher(self.fleet, Router(self.config, worker.stats.block_size),
                                self.metrics, gate=gate)
        self.fleet.poison = dispatcher.poison  # shared with the other replicas (poison.py)
        self.fleet.held_tokens = lambda: gate.held_tokens  # demand for the autoscaler
        self.frontend = OpenAIFrontend(dispatcher, tokenizer, self.info,
                                       limits=RequestLimits.of(self.config),
                                       request_timeout_s=self.config.request_timeout_s,
                                       tool_call_parser=self.config.tool_call_parser,
                                       max_tool_calls=self.config.max_tool_calls)
        if self.config.ttft_slo_s is not None:
            self.frontend.shedder = TTFTShedder(self.config.ttft_slo_s, self.fleet.snapshot,
                                                self.metrics)
        logger.info("router %s ready: model %s, max_model_len %d, %d workers ready",
                    self.replica_id, self.info.name, self.info.max_model_len,
                    len(snapshot.ready()))

    def __serve_build_asgi_app__(self):
        return build_http_app(self.frontend, self.fleet.snapshot, self.metrics,
                              self._render_metrics, self.api_key, self.config.max_request_bytes,
                              body_timeout_s=self.config.body_timeout_s)

    def _render_metrics(self) -> bytes:
        """Fleet gauges plus request metrics summed over every router replica (this one live,
        the others as last reported to the controller)."""
        snap = self.fleet.snapshot()
        others = [m for rid, m in snap.router_metrics.items() if rid != self.replica_id]
        return render(snap, merge([self.metrics.snapshot(), *others]), self.info.name)

    async def __del__(self):
        await self.fleet.stop()


def deployment_failure(app_name: str) -> str:
    """Why the application's router failed to deploy, as Serve recorded it."""
    app = serve.status().applications.get(app_name)
    if app is None:
        return f"application {app_name!r} is not deployed"
    messages = [d.message for d in app.deployments.values() if d.message]
    return "\n".join(messages) or app.message


def build_app(args: dict | ServeArgs | None = None):
    """Serve application builder (also the target of `import_path` in Serve config files)."""
    sargs = args if isinstance(args, ServeArgs) else ServeArgs(**(args or {}))
    options, engine = sargs.split()
    deployment = serve.deployment(
        OpenAIRouter,
        name="OpenAIRouter",
        num_replicas=options.router_replicas,
        # Bounded at both ends: a replica serves this many at once, and each Serve proxy holds
        # at most router_max_queued_requests waiting for one; beyond, Serve answers 503 with
        # Retry-After itself, before the request costs the router anything.
        max_ongoing_requests=options.router_max_ongoing_requests,
        max_queued_requests=options.router_max_queued_requests,
        backpressure_config=BackpressureConfig(status_code=503, retry_after_s=1),
        ray_actor_options={"num_cpus": 0},
        deployment_actors=[DeploymentActorConfig(
            name=CONTROLLER, actor_class=ControllerActor,
            init_kwargs={"options": options, "engine": engine, "detached_workers": True},
            actor_options={"num_cpus": 0})],
    )
    return deployment.bind(options)
