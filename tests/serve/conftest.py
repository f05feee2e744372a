"""One local Ray cluster and one deployed raypaged application for the whole serve test session.

The application runs the real engine with the default model: 2 workers of 1 CPU each, a 64 MiB
KV budget and max_model_len 1024, so every test stays within a few seconds on 2 cores. Tests
that break things (kill workers) either restore the fleet before they end or deploy their own
small application beside it.
"""
from __future__ import annotations

import httpx
import openai
import pytest

from fake_engine import SETUP_HOOK, SLOW_FAKE_MODEL
from serve_testing import API_KEY, MAX_REQUEST_BYTES, ROOT, ServedApp, deploy, free_port


@pytest.fixture(scope="session")
def ray_serve():
    import ray
    from ray import serve

    # 4 logical CPUs on 2 cores: the shared app's 2 workers take 1 each, and a test may deploy
    # a small extra application beside it.
    # address="local": our own cluster, never one another process left in ray_current_cluster
    if ray.is_initialized():  # another folder's tests (tests/batch) left their Ray up
        ray.shutdown()
    ray.init(address="local", num_cpus=4, include_dashboard=False, namespace="raypaged-tests",
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)},
                          "worker_process_setup_hook": SETUP_HOOK}, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="session")
def app(ray_serve, default_model_dir) -> ServedApp:
    served = deploy("raypaged-test", "/", ray_serve, API_KEY, workers=2, cpus_per_worker=1,
                    kv_memory_mb=64, max_model_len=1024, max_request_bytes=MAX_REQUEST_BYTES)
    served.wait_ready(2)
    return served


@pytest.fixture
def client(app) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{app.url}/v1", api_key=app.api_key, max_retries=0,
                         timeout=120)


@pytest.fixture
def async_client(app):
    """Makes an AsyncOpenAI client; make it inside the event loop that uses it."""
    return lambda: openai.AsyncOpenAI(base_url=f"{app.url}/v1", api_key=app.api_key,
                                      max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def model_name(app) -> str:
    return httpx.get(f"{app.url}/v1/models", headers=app.headers).json()["data"][0]["id"]


@pytest.fixture(scope="module")
def fake_fleet(ray_serve) -> ServedApp:
    """Two workers on the fake engine at 20 ms a step, ours to break (one test module at a time:
    with the shared app they fill the cluster's 4 CPUs)."""
    from ray import serve

    served = deploy("raypaged-fake", "/fake", ray_serve, None, workers=2, cpus_per_worker=1,
                    max_model_len=256,
                    model=SLOW_FAKE_MODEL)
    served.wait_ready(2)
    yield served
    serve.delete(served.name)
