"""A default `raypaged serve` is a locked-down local cluster: every socket its process tree
listens on (Serve HTTP, Ray's GCS, raylet, workers, agents, metrics, and each Serve replica's
inter-deployment gRPC server, which Ray binds to "[::]:0" and raypaged/serve/replica_bind.py
moves to the node IP) is bound to the loopback; and the GCS and the replicas, like every Ray
gRPC server, refuse a client without Ray's token."""
from __future__ import annotations

import os
import time

import grpc
import httpx
import pytest

from listening import listeners
from serve_testing import free_port, raypaged_serve_process


def ray_token() -> str:
    """Ray's cluster token, where Ray keeps it (the environment, else ~/.ray/auth_token)."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"]
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token")
    with open(path) as f:
        return f.read().strip()


@pytest.fixture(scope="module")
def served(default_model_dir, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("loopback") / "serve.log"
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_AUTH_MODE")}
    flags = ["--port", str(port), "--num-cpus", "1", "--kv-memory-mb", "32",
             "--max-model-len", "256", "--model", str(default_model_dir)]
    with raypaged_serve_process(flags, log, env) as proc:
        time.sleep(2)  # let Ray's agents and exporters finish starting
        yield proc, port


def replica_call(port: int, token: str | None) -> grpc.StatusCode:
    """An empty request to a Serve replica's inter-deployment gRPC method. Ray's authentication
    interceptor wraps each method and runs before it: without the token the answer is
    UNAUTHENTICATED; with it the method runs (and fails on the empty request)."""
    metadata = [("authorization", f"Bearer {token}")] if token else None
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            channel.unary_unary("/ray.serve.ASGIService/HandleRequest")(
                b"", timeout=10, metadata=metadata)
            return grpc.StatusCode.OK
        except grpc.RpcError as exc:
            return exc.code()


def _speaks_http(port: int) -> bool:
    try:
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)
        return True
    except httpx.HTTPError:
        return False


def test_nothing_listens_beyond_the_loopback(served):
    proc, port = served
    found = listeners(proc.pid)
    assert any(s.port == port and s.loopback for s in found)  # Serve HTTP, in the tree read
    assert {"gcs_server", "raylet", "ray::ServeRepli"} <= {s.process for s in found}
    assert [s for s in found if not s.loopback] == []


def test_the_serve_replica_grpc_server_refuses_a_client_without_the_token(served):
    proc, _ = served
    # The replica process also holds its Ray worker's gRPC server (no such method there) and,
    # behind HAProxy, its own HTTP server (the API, HAProxy's backend); the inter-deployment
    # server is the one that runs the method for the token's holder.
    sockets = [s for s in listeners(proc.pid)
               if s.process == "ray::ServeRepli" and not _speaks_http(s.port)]
    (asgi,) = [s for s in sockets if replica_call(s.port, ray_token()) not in (
        grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNIMPLEMENTED)]
    assert replica_call(asgi.port, None) == grpc.StatusCode.UNAUTHENTICATED
    assert replica_call(asgi.port, "not-the-token") == grpc.StatusCode.UNAUTHENTICATED


def test_the_gcs_refuses_a_client_without_the_token(served):
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    proc, _ = served
    gcs = [s for s in listeners(proc.pid) if s.process == "gcs_server"]
    assert len(gcs) == 1

    def ask(metadata):
        with grpc.insecure_channel(f"127.0.0.1:{gcs[0].port}") as channel:
            stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
            return stub.GetAllNodeInfo(gcs_service_pb2.GetAllNodeInfoRequest(), timeout=10,
                                       metadata=metadata)

    with pytest.raises(grpc.RpcError) as refused:
        ask(None)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as wrong:
        ask([("authorization", "Bearer not-the-token")])
    assert wrong.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert len(ask([("authorization", f"Bearer {ray_token()}")]).node_info_list) == 1
