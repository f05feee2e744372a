"""Workers' resources come from the configuration, never from a look at the cluster: KubeRay
deploys the application before GPU pods join, and a look then started GPU-less workers."""
from __future__ import annotations

import pytest

from raypaged.config import EngineArgs
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
    # more workers than CPUs: all of them start, sharing (one of 3 stayed pending for good)
    assert local_worker_resources(ServeArgs(workers=3), num_cpus=2, num_gpus=0).cpus_per_worker \
        == pytest.approx(2 / 3)


@pytest.mark.parametrize("args,num_gpus,words", [
    (ServeArgs(workers=3, cpus_per_worker=1), 0, ["--workers 3", "--cpus-per-worker 1", "3 CPUs",
                                                  "has 2"]),
    (ServeArgs(workers=3, cpus_per_worker=0.5), 2, ["--workers 3", "--gpus-per-worker 1",
                                                    "3 GPUs", "has 2"]),
    (ServeArgs(workers=2, gpus_per_worker=0.5, cpus_per_worker=2), 1, ["--cpus-per-worker 2",
                                                                       "4 CPUs"]),
])
def test_a_local_cluster_refuses_workers_it_cannot_start_and_names_the_flags(args, num_gpus, words):
    with pytest.raises(ValueError) as info:
        local_worker_resources(args, num_cpus=2, num_gpus=num_gpus)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_a_local_cluster_keeps_what_was_set():
    args = ServeArgs(workers=2, cpus_per_worker=3, gpus_per_worker=0.5)
    got = local_worker_resources(args, num_cpus=64, num_gpus=8)
    assert (got.cpus_per_worker, got.gpus_per_worker) == (3.0, 0.5)


def test_serving_workers_leave_a_core_to_the_serving_path_in_decode_steps():
    def threads(cpus, gpus=0, serving=True, **engine):
        """(num_threads, decode_threads) of the engine config a worker is given."""
        got = actors.worker_threads(EngineArgs(**engine), cpus=cpus, gpus=gpus, serving=serving)
        return got.num_threads, got.decode_threads

    assert threads(2) == (2, 1)
    assert threads(8) == (8, 7)
    # one CPU has none to spare; a batch job's workers serve no HTTP; what was set is kept
    assert threads(1) == (1, None)
    assert threads(4, serving=False) == (4, None)
    assert threads(4, decode_threads=4) == (4, 4)
    assert threads(8, num_threads=3) == (3, 2)
    assert threads(1, gpus=1) == (None, None)  # GPU: torch's default
