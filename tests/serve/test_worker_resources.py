"""Workers' resources come from the configuration, never from a look at the cluster: KubeRay
deploys the application before GPU pods join, and a look then started GPU-less workers."""
from __future__ import annotations

import pytest

from raypaged.serve import actors
from raypaged.serve.cli import local_worker_resources
from raypaged.serve.config import ServeArgs, ServeOptions


@pytest.fixture
def cluster_unreadable(monkeypatch):
    def refuse():
        raise AssertionError("worker resources must not come from ray.cluster_resources()")
    monkeypatch.setattr(actors.ray, "cluster_resources", refuse)


def test_explicit_resources_are_used_as_given(cluster_unreadable):
    fleet, _ = ServeArgs(workers=2, cpus_per_worker=4, gpus_per_worker=1).split()
    assert actors.worker_resources(fleet) == (4.0, 1.0)


def test_unset_resources_are_one_cpu_and_no_gpu(cluster_unreadable):
    assert actors.worker_resources(ServeOptions(workers=3)) == (1.0, 0.0)


def test_a_local_cluster_shares_its_cpus_or_gives_each_worker_a_gpu():
    two = ServeArgs(workers=2)
    assert (local_worker_resources(two, num_cpus=8, num_gpus=0).cpus_per_worker,
            local_worker_resources(two, num_cpus=8, num_gpus=0).gpus_per_worker) == (4.0, 0.0)
    on_gpus = local_worker_resources(two, num_cpus=8, num_gpus=2)
    assert (on_gpus.cpus_per_worker, on_gpus.gpus_per_worker) == (1.0, 1.0)
    assert local_worker_resources(ServeArgs(workers=3), num_cpus=2, num_gpus=0).cpus_per_worker == 1.0


def test_a_local_cluster_keeps_what_was_set():
    args = ServeArgs(workers=2, cpus_per_worker=3, gpus_per_worker=0.5)
    got = local_worker_resources(args, num_cpus=64, num_gpus=8)
    assert (got.cpus_per_worker, got.gpus_per_worker) == (3.0, 0.5)


def test_serving_workers_leave_a_core_to_the_serving_path_in_decode_steps():
    assert actors.worker_threads({}, cpus=2, gpus=0, serving=True) == {
        "num_threads": 2, "decode_threads": 1}
    assert actors.worker_threads({}, cpus=8, gpus=0, serving=True) == {
        "num_threads": 8, "decode_threads": 7}
    # one CPU has none to spare; a batch job's workers serve no HTTP; what was set is kept
    assert actors.worker_threads({}, cpus=1, gpus=0, serving=True) == {"num_threads": 1}
    assert actors.worker_threads({}, cpus=4, gpus=0, serving=False) == {"num_threads": 4}
    assert actors.worker_threads({"decode_threads": 4}, cpus=4, gpus=0, serving=True) == {
        "num_threads": 4, "decode_threads": 4}
    assert actors.worker_threads({"num_threads": 3}, cpus=8, gpus=0, serving=True) == {
        "num_threads": 3, "decode_threads": 2}
    assert actors.worker_threads({}, cpus=1, gpus=1, serving=True) == {}  # GPU: torch's default
