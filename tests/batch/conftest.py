"""A local Ray for the batch tests that run jobs in this process (package scope: it is gone
before tests/serve starts its own), and the small engine every batch test uses."""
from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# fp32: greedy tokens must not depend on which rows share a step (bf16 can flip a token).
ENGINE = dict(dtype="float32", kv_memory_mb=32, max_model_len=512, max_num_seqs=16)


@pytest.fixture(scope="package")
def local_ray():
    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False, namespace="raypaged-batch-tests",
             _node_ip_address="127.0.0.1", log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    yield
    ray.shutdown()
