"""`run_batch`: the Python API beside the offline `LLM`, and what `raypaged batch` calls.

Joins the Ray cluster at `options.address` or $RAY_ADDRESS (set for a `ray job submit` job),
else starts a local Ray bound to 127.0.0.1 and stops it at the end; a driver that already called
ray.init() keeps its cluster.
"""
from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Callable

import ray

from raypaged.batch.engines import fleet_args
from raypaged.batch.job import BatchJob
from raypaged.batch.options import BatchOptions
from raypaged.batch.progress import BatchSummary
from raypaged.config import EngineArgs


def run_batch(input_path: str | Path, output_path: str | Path, engine: EngineArgs | None = None,
              options: BatchOptions | None = None) -> BatchSummary:
    """Answer every line of `input_path` into `output_path` (resuming what an earlier run wrote).

    Lines refused for their own input are error lines in the output, not exceptions; rows that
    failed for other reasons past retry_timeout_s are left out (`summary.unanswered`; run again
    to answer them). This raises only when the job cannot run: a missing input, an output that is
    the input or that another job holds, an input changed since the output answered it
    (InputChanged), engines that cannot start; or when the output stops taking writes mid-run
    (OutputWriteFailed: the lines written are whole, run again once there is room).
    """
    return run_job(BatchJob(input_path, output_path, engine, options))


def run_job(job: BatchJob, on_ray: Callable[[], object] = lambda: None) -> BatchSummary:
    """Run the job on Ray (`on_ray`: called once Ray is up, before the engines start). On a
    local Ray, the engines' unset resources are filled from this machine."""
    options = job.options
    address = options.address or os.environ.get("RAY_ADDRESS")
    if address and not ray.is_initialized():
        ray.init(address=address, namespace="raypaged-batch")
    local = not ray.is_initialized()  # else the cluster joined, or the driver's own: it stays up
    if local:
        # A new cluster (address="local"), never one some `ray start` left running on this
        # machine; loopback only: a local job needs no port reachable from elsewhere.
        ray.init(address="local", num_cpus=options.num_cpus or os.cpu_count(),
                 include_dashboard=False, namespace="raypaged-batch", _node_ip_address="127.0.0.1")
    try:
        on_ray()
        args = fleet_args(job.engine, options)
        if local:
            import torch

            from raypaged.serve.cli import local_worker_resources
            args = local_worker_resources(args, int(ray.cluster_resources().get("CPU", 1)),
                                          torch.cuda.device_count())
        return asyncio.run(job.run(args))
    finally:
        if local:
            ray.shutdown()
