"""`raypaged serve` flags: they map onto the application's arguments, and a configuration that
cannot work is refused before any Ray cluster starts."""
from __future__ import annotations

import argparse
import socket
import subprocess
import sys

from raypaged.config import EngineArgs
from raypaged.serve.cli import add_serve_parser, serve_args_from
from serve_testing import ROOT


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def test_defaults_bind_localhost_and_route_by_prefix():
    ns = parse()
    assert (ns.host, ns.port, ns.workers, ns.routing) == ("127.0.0.1", 8000, 1, "cache_aware")
    options, _ = serve_args_from(ns).split()
    assert (options.route_load_factor, options.route_cache_slack, options.route_recompute_weight,
            options.workers) == (1.25, 2048, 1.75, 1)


def test_flags_map_onto_the_application_arguments():
    ns = parse("--workers", "3", "--routing", "round_robin", "--route-prefix-blocks", "2",
               "--route-load-factor", "1.5", "--api-key", "k", "--kv-memory-mb", "64",
               "--max-model-len", "512", "--no-enable-prefix-caching", "--cpus-per-worker", "2",
               "--router-replicas", "2", "--max-queued-requests", "7",
               "--onednn-cache-capacity", "64", "--route-recompute-weight", "2")
    options, engine = serve_args_from(ns).split()
    assert options.workers == 3 and options.cpus_per_worker == 2
    assert options.max_queued_requests == 7 and options.router_replicas == 2
    assert (options.routing, options.route_prefix_blocks, options.route_load_factor) == (
        "round_robin", 2, 1.5)
    assert options.api_key == "k" and options.route_recompute_weight == 2
    # the frozen config the workers' engines are built from; every other setting its default
    assert engine == EngineArgs(kv_memory_mb=64.0, enable_prefix_caching=False, max_model_len=512,
                                onednn_cache_capacity=64)


def test_a_kv_budget_that_cannot_hold_one_sequence_is_refused_before_ray_starts():
    run = subprocess.run(
        [sys.executable, "-c", "import sys; from raypaged.cli import main; sys.exit(main())",
         "serve", "--kv-memory-mb", "1", "--max-model-len", "1024"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert "max_model_len" in run.stderr and "Started a local Ray" not in run.stderr


def test_a_local_cluster_gets_a_slower_serve_control_loop_unless_the_user_set_one():
    from raypaged.serve.cli import local_cluster_env
    env = {}
    local_cluster_env(env)
    assert env == {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
                   "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
                   "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2"}
    mine = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.1", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1",
            "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "30"}
    local_cluster_env(mine)
    assert mine == {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.1",
                    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1",
                    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "30"}


def test_a_failed_deployment_is_reported_as_its_last_error_line_not_the_traceback():
    from raypaged.serve.cli import startup_failure
    serve_message = (
        "Deploying application raypaged failed: Failed to update the deployments "
        "['OpenAIRouter'].\nThe deployment failed to start 3 times in a row. Error:\n"
        "RuntimeError: Traceback (most recent call last):\n"
        '  File "raypaged/serve/ray_fleet.py", line 57, in start\n'
        "    raise RuntimeError(f\"every worker failed to start: {causes}\")\n"
        "RuntimeError: every worker failed to start: safetensors._safetensors_rust."
        "SafetensorError: Error while deserializing header: header too large\n")
    line = startup_failure(serve_message)
    assert "\n" not in line
    assert line == ("every worker failed to start: safetensors._safetensors_rust."
                    "SafetensorError: Error while deserializing header: header too large")


def test_a_port_another_server_holds_is_refused_in_one_line_before_ray_starts():
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        run = subprocess.run(
            [sys.executable, "-c", "import sys; from raypaged.cli import main; sys.exit(main())",
             "serve", "--port", str(port)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert run.stderr == (f"raypaged: cannot listen on 127.0.0.1:{port}: Address already in use "
                          "(another server there? stop it, or pick a free port with --port)\n")
