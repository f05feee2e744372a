"""What the chart's Ray token authentication buys, shown on a real head started the way KubeRay
starts it (RAY_AUTH_MODE=token, the token in RAY_AUTH_TOKEN): a caller without the token, as any
other pod in the cluster would be, cannot submit a job, cannot use the Ray client, cannot talk
to the GCS. The token's holder can."""
from __future__ import annotations

import subprocess

import grpc
import httpx
import pytest

from ray_head import BIN, start_ray_head, stop, without_token


@pytest.fixture(scope="module")
def head():
    proc, ray_head = start_ray_head()
    try:
        yield ray_head
    finally:
        stop(proc)


def bearer(token: str | None) -> dict:
    return {"Authorization": f"Bearer {token}"} if token else {}


def jobs(head) -> list:
    r = httpx.get(f"{head.dashboard}/api/jobs/", headers=bearer(head.token), timeout=10)
    assert r.status_code == 200
    return r.json()


def grpc_call(target: str, method: str, token: str | None) -> grpc.StatusCode:
    """An empty request; Ray's authentication interceptor answers before the method runs."""
    metadata = [("authorization", f"Bearer {token}")] if token else None
    with grpc.insecure_channel(target) as channel:
        try:
            channel.unary_unary(method)(b"", timeout=10, metadata=metadata)
            return grpc.StatusCode.OK
        except grpc.RpcError as exc:
            return exc.code()


def test_the_jobs_api_refuses_a_caller_without_the_token(head):
    submit = {"entrypoint": "env"}  # would print RAYPAGED_API_KEY and Ray's token
    for token, status in ((None, 401), ("not-the-token", 403)):
        assert httpx.post(f"{head.dashboard}/api/jobs/", json=submit, headers=bearer(token),
                          timeout=10).status_code == status
        assert httpx.get(f"{head.dashboard}/api/jobs/", headers=bearer(token),
                         timeout=10).status_code == status
    assert jobs(head) == []  # nothing was submitted


def test_ray_job_submit_without_the_token_is_refused(head, tmp_path):
    done = subprocess.run(
        [str(BIN / "ray"), "job", "submit", "--address", head.dashboard, "--", "env"],
        env=without_token(head.env, tmp_path), capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "no authentication token was found" in done.stderr
    assert jobs(head) == []


@pytest.mark.parametrize("port, method", [
    ("client", "/ray.rpc.RayletDriver/Init"),                 # the Ray client (ray://)
    ("gcs", "/ray.rpc.NodeInfoGcsService/GetAllNodeInfo"),    # what every driver and node joins
])
def test_ray_client_and_gcs_refuse_a_caller_without_the_token(head, port, method):
    target = getattr(head, port).removeprefix("ray://")
    assert grpc_call(target, method, None) == grpc.StatusCode.UNAUTHENTICATED
    assert grpc_call(target, method, "not-the-token") == grpc.StatusCode.UNAUTHENTICATED
    assert grpc_call(target, method, head.token) != grpc.StatusCode.UNAUTHENTICATED
