"""`raypaged serve`: bring up the OpenAI endpoint on Ray, and take it down on Ctrl-C / SIGTERM.

Joins the Ray cluster at --address / RAY_ADDRESS, else starts a local one sized to this machine;
deploys the application (router, controller, workers) through `build_app`, prints the URL once
the first worker is ready, and on exit removes what it started: the application, and the local
Ray cluster when it started one.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from raypaged.serve.config import DEFAULT_ROUTE_PREFIX_BLOCKS, ServeArgs


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    from raypaged.engine_cli_args import add_engine_args

    p = subparsers.add_parser(
        "serve", help="serve an OpenAI-compatible API from a fleet of workers on Ray",
        description="Serve an OpenAI-compatible API (/v1/completions, /v1/chat/completions, "
                    "/v1/models, /health, /metrics) from a fleet of workers on Ray, routing "
                    "requests that share a prompt prefix to the worker that caches it.")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=os.environ.get("RAYPAGED_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $RAYPAGED_API_KEY; "
                        "/health and /metrics stay open)")
    g.add_argument("--served-model-name", help="the model name clients send (default: the model's)")
    g.add_argument("--max-request-bytes", type=int, default=8 * 1024 * 1024,
                   help="larger request bodies get 413 (default: 8 MiB)")
    r = p.add_argument_group("Ray and the fleet")
    r.add_argument("--address", default=os.environ.get("RAY_ADDRESS"),
                   help="Ray cluster to join (default: $RAY_ADDRESS, else start a local one)")
    r.add_argument("--num-cpus", type=int, help="CPUs of a local Ray cluster (default: all)")
    r.add_argument("--app-name", default="raypaged", help="Serve application name")
    r.add_argument("--workers", type=int, default=1,
                   help="engine workers (one per GPU on a GPU cluster; default: %(default)s)")
    r.add_argument("--cpus-per-worker", type=float,
                   help="CPUs per worker, and its torch threads (default: CPUs / workers)")
    r.add_argument("--gpus-per-worker", type=float, help="default: 1 when the cluster has GPUs")
    r.add_argument("--router-replicas", type=int, default=1, help="HTTP router replicas")
    r.add_argument("--max-queued-requests", type=int, default=1024,
                   help="per worker, beyond the running ones; then 503 + Retry-After")
    r.add_argument("--worker-allocator", choices=["tcmalloc", "system"],
                   default=ServeArgs.model_fields["worker_allocator"].default,
                   help="workers' malloc: tcmalloc (LD_PRELOAD; keeps RSS flat under load) or "
                        "glibc's (default: %(default)s; falls back to glibc if not installed)")
    t = p.add_argument_group("routing")
    t.add_argument("--routing", choices=["prefix", "round_robin"], default="prefix",
                   help="prefix: rendezvous hashing on the prompt's first blocks (default)")
    t.add_argument("--route-prefix-blocks", type=int, default=DEFAULT_ROUTE_PREFIX_BLOCKS,
                   help="prompt blocks hashed into the routing key (default: %(default)s)")
    t.add_argument("--route-load-factor", type=float, default=1.25,
                   help="a worker above this x the mean load passes a request on (default: 1.25)")
    add_engine_args(p)
    p.set_defaults(func=run_serve)
    return p


def serve_args_from(ns: argparse.Namespace) -> ServeArgs:
    return ServeArgs(
        app_name=ns.app_name, workers=ns.workers, cpus_per_worker=ns.cpus_per_worker,
        gpus_per_worker=ns.gpus_per_worker, routing=ns.routing,
        route_prefix_blocks=ns.route_prefix_blocks, route_load_factor=ns.route_load_factor,
        router_replicas=ns.router_replicas, api_key=ns.api_key,
        served_model_name=ns.served_model_name, max_request_bytes=ns.max_request_bytes,
        max_queued_requests=ns.max_queued_requests, num_threads=ns.num_threads,
        worker_allocator=ns.worker_allocator,
        model=os.path.abspath(os.path.expanduser(ns.model)) if ns.model else None,
        dtype=ns.dtype, block_size=ns.block_size, kv_memory_mb=ns.kv_memory_mb,
        kv_memory_fraction=ns.kv_memory_fraction, kv_context_len=ns.kv_context_len,
        kv_dtype=ns.kv_dtype, enable_prefix_caching=not ns.no_prefix_caching,
        max_model_len=ns.max_model_len, max_num_seqs=ns.max_num_seqs,
        max_num_batched_tokens=ns.max_num_batched_tokens,
        attention_backend=ns.attention_backend, enforce_eager=ns.enforce_eager,
        onednn_cache_capacity=ns.onednn_cache_capacity)


def run_serve(ns: argparse.Namespace) -> int:
    import ray
    from ray import serve

    from raypaged.serve.app import build_app, deployment_failure

    args = serve_args_from(ns)
    started_ray = not ns.address
    if started_ray:
        # Size the KV cache here first: a budget or max_model_len that cannot work fails now,
        # with the engine's reason, instead of in every worker.
        from raypaged.engine import plan_for
        from raypaged.engine_cli_args import engine_args_from
        plan_for(engine_args_from(ns))
        ray.init(num_cpus=ns.num_cpus or os.cpu_count(), include_dashboard=False,
                 namespace="raypaged")
    else:
        ray.init(address=ns.address, namespace="raypaged")
    signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM takes the same way out as Ctrl-C
    try:
        serve.start(http_options={"host": ns.host, "port": ns.port})
        print(f"raypaged: starting {args.workers} worker(s); the first model load can take a "
              "while", file=sys.stderr, flush=True)
        try:
            serve.run(build_app(args), name=args.app_name, route_prefix="/")
        except RuntimeError as exc:
            print(f"raypaged: {exc}\n{deployment_failure(args.app_name)}", file=sys.stderr)
            return 1
        url = f"http://{ns.host}:{ns.port}"
        print(f"raypaged: serving at {url}  (OpenAI API: {url}/v1, metrics: {url}/metrics)",
              flush=True)
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        print("raypaged: stopping", file=sys.stderr, flush=True)
    finally:
        # A second signal (a process group's, or an impatient Ctrl-C) must not cut cleanup short.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            serve.delete(args.app_name)
            if started_ray:
                serve.shutdown()
        finally:
            if started_ray:
                ray.shutdown()
    return 0


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt
