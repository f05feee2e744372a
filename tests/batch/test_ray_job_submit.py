"""The real thing: `ray job submit -- raypaged batch` against a cluster this test starts with
`ray start --head` on loopback (free ports, its own temp dir), stopped at the end."""
from __future__ import annotations

import os
import subprocess

import pytest

from batch_inputs import numbered_prompts, read_output, write_lines
from batch_testing import ENGINE, ROOT
from ray_head import BIN, start_ray_head, stop


@pytest.fixture
def ray_head():
    """(dashboard address, env) of a one-node cluster with its own token; stopped afterwards."""
    head, info = start_ray_head(num_cpus=2, env={"PYTHONPATH": str(ROOT)})
    try:
        yield info.dashboard, info.env
    finally:
        stop(head)


def test_ray_job_submit_runs_raypaged_batch_to_success(ray_head, tmp_path):
    address, env = ray_head
    work = tmp_path / "work"
    work.mkdir()
    write_lines(work / "in.jsonl", numbered_prompts(6, max_tokens=4))
    out = tmp_path / "out.jsonl"
    engine_flags = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE.items()]
    job_id = f"raypaged-batch-test-{os.getpid()}"
    submit = subprocess.run(
        [str(BIN / "ray"), "job", "submit", "--address", address, "--submission-id", job_id,
         "--working-dir", str(work), "--",
         "raypaged", "batch", "in.jsonl", str(out), "--workers=1", "--cpus-per-worker=1",
         "--progress-interval-s=1", *engine_flags],
        env=env, capture_output=True, text=True, timeout=400)
    logs = submit.stdout + submit.stderr
    assert submit.returncode == 0, logs
    status = subprocess.run([str(BIN / "ray"), "job", "status", "--address", address, job_id],
                            env=env, capture_output=True, text=True, timeout=60)
    assert f"Job '{job_id}' succeeded" in status.stdout, status.stdout + status.stderr  # SUCCEEDED
    assert "completed        6" in logs
    lines = read_output(out)
    assert sorted(o["custom_id"] for o in lines) == [f"r{i}" for i in range(6)]
    assert all(o["response"]["body"]["usage"]["completion_tokens"] == 4 for o in lines)
