"""A local Ray for the batch tests that run jobs in this process (package scope: it is gone
before tests/serve starts its own), and the small engine every batch test uses."""
from __future__ import annotations

import pytest

from batch_testing import ROOT
from tests.serve.fake_engine import SETUP_HOOK


@pytest.fixture(scope="package")
def local_ray():
    import ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=4, include_dashboard=False, namespace="raypaged-batch-tests",
             _node_ip_address="127.0.0.1", log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)},
                          "worker_process_setup_hook": SETUP_HOOK})
    yield
    ray.shutdown()
