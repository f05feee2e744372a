"""`raypaged batch` as a process: interrupted by SIGTERM, then re-run with the same arguments,
it completes the rest: every custom_id exactly once, no partial line."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from batch_inputs import numbered_prompts, read_output, write_lines
from batch_testing import ENGINE, ROOT

N = 30


def batch_command(inp, out) -> list[str]:
    engine_flags = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE.items()]
    return [sys.executable, "-m", "raypaged.cli", "batch", str(inp), str(out), "--num-cpus=2",
            "--workers=1", "--cpus-per-worker=1", "--max-inflight=2",
            "--progress-interval-s=1", *engine_flags]


def start(cmd) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def test_a_job_interrupted_by_sigterm_resumes_without_duplicates(tmp_path):
    inp = write_lines(tmp_path / "in.jsonl", numbered_prompts(N, max_tokens=8))
    out = tmp_path / "out.jsonl"
    first = start(batch_command(inp, out))
    try:
        deadline = time.monotonic() + 240
        while not (out.exists() and len(out.read_text().splitlines()) >= 4):
            assert first.poll() is None, first.stdout.read()
            assert time.monotonic() < deadline, "no output lines in 240 s"
            time.sleep(0.1)
        first.send_signal(signal.SIGTERM)
        log, _ = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 130, log
    assert "interrupted; the lines written so far are complete" in log
    partial = read_output(out)  # every line whole
    assert 4 <= len(partial) < N
    assert len({o["custom_id"] for o in partial}) == len(partial)

    torn = '{"id": "batch_req_29_00c0ffee00c0ffee", "custom_id": "r2'
    with open(out, "a") as f:  # as if killed in the middle of writing a line
        f.write(torn)
    second = start(batch_command(inp, out))
    log, _ = second.communicate(timeout=400)
    assert second.returncode == 0, log
    assert f"resuming, {len(partial)} rows already in" in log
    assert f"cut a torn last line ({len(torn)} bytes)" in log
    assert f"rows             {N} ({len(partial)} done by an earlier run)" in log
    assert f"completed        {N - len(partial)}" in log

    lines = read_output(out)
    assert lines[:len(partial)] == partial
    assert sorted(o["custom_id"] for o in lines) == sorted(f"r{i}" for i in range(N))
    assert all(o["response"]["status_code"] == 200 for o in lines)
