"""`raypaged serve`: bring up the OpenAI endpoint on Ray, and take it down on Ctrl-C / SIGTERM.

Joins the Ray cluster at --address / RAY_ADDRESS, else starts a local one sized to this machine;
deploys the application (router, controller, workers) through `build_app`, prints the URL once
the first worker is ready, and on exit removes what it started: the application, and the local
Ray cluster when it started one.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import sys
import time

from raypaged.config import EngineArgs, absolute_model_path
from raypaged.serve.api_key import resolve_api_key
from raypaged.serve.config import ServeArgs, ServeOptions
from raypaged.serve.ingress import (IngressUnavailable, default_ingress, ingress_env,
                                    new_run_dir, refuse_when_joining)
from raypaged.settings import add_cli_args


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve", help="serve an OpenAI-compatible API from a fleet of workers on Ray",
        description="Serve an OpenAI-compatible API (/v1/completions, /v1/chat/completions, "
                    "/v1/models, /health, /metrics) from a fleet of workers on Ray, routing "
                    "requests that share a prompt prefix to the worker that caches it.")
    # Flags of this command alone: where to listen and which cluster to use. Everything else is
    # an application argument (ServeOptions, EngineArgs), the same as in a Serve config file.
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s)")
    g.add_argument("--port", type=int, default=8000)
    r = p.add_argument_group("Ray and the fleet")
    r.add_argument("--address", default=os.environ.get("RAY_ADDRESS"),
                   help="Ray cluster to join (default: $RAY_ADDRESS, else start a local one)")
    r.add_argument("--num-cpus", type=int, help="CPUs of a local Ray cluster (default: all)")
    add_cli_args(p, ServeOptions)
    add_cli_args(p, EngineArgs)
    p.set_defaults(func=run_serve)
    return p


def serve_args_from(ns: argparse.Namespace) -> ServeArgs:
    values = {name: getattr(ns, name) for name in ServeArgs.model_fields if hasattr(ns, name)}
    values["model"] = absolute_model_path(values.get("model"))
    values["api_key"] = resolve_api_key(values.get("api_key"))  # refuses an empty key
    return ServeArgs(**values)


def startup_failure(serve_message: str) -> str:
    """The one line a failed start prints: the last error of Serve's report (its traceback is in
    Ray's logs above), e.g. the engine's own reason a worker could not start."""
    from raypaged.serve.actors import last_error_line
    return last_error_line(serve_message).removeprefix("RuntimeError: ")


def local_worker_resources(args: ServeArgs, num_cpus: int, num_gpus: int) -> ServeArgs:
    """Unset per-worker resources when this machine is the whole cluster: one GPU each when it
    has GPUs, else its CPUs shared evenly (whole CPUs each while there are enough). Workers
    that would not fit are refused here: on a cluster of one machine they would wait for
    resources that never come, the fleet short of them for good."""
    gpus = float(num_gpus >= 1) if args.gpus_per_worker is None else args.gpus_per_worker
    cpus = args.cpus_per_worker
    if cpus is None:
        cpus = 1.0 if gpus else float(num_cpus // args.workers or num_cpus / args.workers)
    for each, have, flag, kind in ((cpus, num_cpus, "--cpus-per-worker", "CPUs"),
                                   (gpus, num_gpus, "--gpus-per-worker", "GPUs")):
        if args.workers * each > have + 1e-9:
            raise ValueError(f"--workers {args.workers} x {flag} {each:g} needs "
                             f"{args.workers * each:g} {kind}, and this machine has {have} "
                             f"(--num-cpus sets the CPUs Ray may use): lower one of them")
    return args.model_copy(update={"cpus_per_worker": cpus, "gpus_per_worker": gpus})


# Ray binds its servers (GCS, raylets, every worker's gRPC port, agents, metrics exporters) to
# the node's IP, which on Linux is the machine's outward address; with this variable (meant for
# macOS and Windows laptops) the node IP is the loopback, and every one of them binds 127.0.0.1.
# A cluster this command starts is its own alone, so nothing of it needs to be reachable; set
# the variable to 1 to opt out, or start Ray yourself and pass --address (docs/security.md).
LOOPBACK_RAY = ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

# Serve's controller runs its control loop every 0.1 s by default, the largest standing CPU cost
# of an idle local server (docs/performance.md "What the 2-core stack costs"); what 0.5 s delays
# (deploys, replica restarts) is not on the token path, and our fleet's own controller does the
# autoscaling. Set the variable to override.
SERVE_CONTROL_LOOP = ("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "0.5")

# Behind HAProxy a router replica that stops keeps taking requests for 30 s by default (Serve's
# minimum draining period, for external load balancers to deregister it), and stopping waits
# for it. The HAProxy of a local cluster drops the replica at its reload, ~0.5 s after the
# replica is removed (its log); 2 s covers that.
DIRECT_INGRESS_DRAIN = ("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "2")


def local_cluster_env(environ: dict) -> None:
    """The defaults `raypaged serve` gives a local cluster it starts; the caller's own values
    of these variables win (so each is also the switch back)."""
    for name, value in (LOOPBACK_RAY, SERVE_CONTROL_LOOP, DIRECT_INGRESS_DRAIN):
        environ.setdefault(name, value)


def port_taken(host: str, port: int) -> str | None:
    """Why nothing could listen on host:port (the OS's reason), or None. Checked before a local
    cluster starts: the ingress would find out only after it, in a traceback."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        # as servers bind: a port in TIME_WAIT is free to them
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def run_serve(ns: argparse.Namespace) -> int:
    ingress_dir = None
    try:  # Ray and Ray Serve read these when imported: set them first
        if ns.address:
            refuse_when_joining(ns.ingress)
        else:
            if taken := port_taken(ns.host, ns.port):
                print(f"raypaged: cannot listen on {ns.host}:{ns.port}: {taken} (another server "
                      "there? stop it, or pick a free port with --port)", file=sys.stderr)
                return 2
            local_cluster_env(os.environ)
            ingress_dir = new_run_dir()
            ingress = ns.ingress
            if ingress is None:
                ingress, why_not = default_ingress()
                if why_not:
                    print(f"raypaged: note: Serve's Python proxy in front of the routers, not "
                          f"HAProxy: {why_not}", file=sys.stderr)
            os.environ.update(ingress_env(ingress, ingress_dir, ns.body_timeout_s))
    except IngressUnavailable as exc:
        print(f"raypaged: {exc}", file=sys.stderr)
        return 2
    try:
        return _serve(ns)
    finally:
        if ingress_dir is not None:
            shutil.rmtree(ingress_dir, ignore_errors=True)


def _serve(ns: argparse.Namespace) -> int:
    import ray
    from ray import serve

    from raypaged.serve.app import build_app, deployment_failure

    args = serve_args_from(ns)
    started_ray = not ns.address
    if started_ray:
        # Size the KV cache here first: a budget or max_model_len that cannot work fails now,
        # with the engine's reason, instead of in every worker.
        from raypaged.model.setup import plan_for
        plan_for(args.split()[1])
        import torch
        num_cpus = ns.num_cpus or os.cpu_count()
        args = local_worker_resources(args, num_cpus, torch.cuda.device_count())
        # address="local": a new cluster of our own, never one that `ray start` left in
        # /tmp/ray/ray_current_cluster (another user's, on a shared machine)
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
                 namespace="raypaged")
    else:
        ray.init(address=ns.address, namespace="raypaged")
    # SIGTERM takes the same way out as Ctrl-C (the handler raises KeyboardInterrupt)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        serve.start(http_options={"host": ns.host, "port": ns.port})
        print(f"raypaged: starting {args.workers} worker(s); the first model load can take a "
              "while", file=sys.stderr, flush=True)
        try:
            serve.run(build_app(args), name=args.app_name, route_prefix="/")
        except RuntimeError as exc:
            why = startup_failure(f"{exc}\n{deployment_failure(args.app_name)}")
            print(f"raypaged: could not start: {why}", file=sys.stderr)
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
