"""Chaos for `raypaged batch`: the job's controller SIGKILLed mid-run, with the real model.

    python benchmarks/batch_chaos.py [--rows 192] [--workers 2] [--max-tokens 16]

Runs `raypaged batch` (default model, --workers engines on a local Ray) on --rows completion
lines (greedy, ignore_eos, two shared prompt prefixes), waits until a quarter of the output is
written, SIGKILLs the job's ControllerActor process, and lets the job finish. Prints and writes
(benchmarks/results/batch_chaos.json, .png): rows, output lines, rows answered exactly once,
duplicated and missing custom_ids, lines that are not 200 (retryable errors written: the
target is 0), whether the engines kept their processes (no restart, no model load), seconds
from the kill to a new controller process, lines written before the kill and in total over
time, the exit status and wall time. The sibling of benchmarks/chaos.py (which breaks a
`raypaged serve` fleet).

--compare-commit REV runs `raypaged batch` as of REV instead (checked out in a temporary git
worktree), written under --name: e.g. the code before the job survived its controller.
--limit-s stops the job (SIGTERM, as `ray job stop` does) if it runs that long, and reports
what its output holds then.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import plot_path, pyplot, table, write  # noqa: E402
from benchmarks.serve_process import descendants  # noqa: E402

# comm is cut at 15 characters: "ray::ControllerActor" reads "ray::Controller"
CONTROLLER, WORKER = "ray::Controller", "ray::WorkerActo"
SHARED = ["You are a terse assistant. Answer with one word. " * 3,
          "Reply in French, politely and briefly, to the user. " * 3]


def pids(root: int, name: str) -> set[int]:
    return {p for p, n in descendants(root).items() if n.startswith(name)}


def lines_in(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=192)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--name", default="batch_chaos")
    ap.add_argument("--compare-commit", help="run raypaged/batch as of this git revision")
    ap.add_argument("--limit-s", type=float, default=1800,
                    help="stop the job after this many seconds")
    ns = ap.parse_args(argv)
    if not ns.compare_commit:
        return run(ns, ROOT)
    tree = Path(tempfile.mkdtemp(prefix="batch_chaos_code_")) / "code"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree),
                    ns.compare_commit], check=True, capture_output=True)
    try:
        return run(ns, tree)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                       check=True)
        shutil.rmtree(tree.parent, ignore_errors=True)


def run(ns, code_root: Path) -> int:

    work = Path(tempfile.mkdtemp(prefix="batch_chaos_"))
    inp, out, log = work / "in.jsonl", work / "out.jsonl", work / "job.log"
    with open(inp, "w") as f:
        for i in range(ns.rows):
            f.write(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                                "body": {"prompt": f"{SHARED[i % 2]}Question {i}: a colour?",
                                         "max_tokens": ns.max_tokens, "temperature": 0,
                                         "ignore_eos": True}}) + "\n")
    cmd = [sys.executable, "-m", "raypaged.cli", "batch", str(inp), str(out),
           f"--workers={ns.workers}", "--cpus-per-worker=1", f"--num-cpus={ns.workers + 1}",
           "--max-inflight=4", "--progress-interval-s=5", "--kv-memory-mb=64",
           "--max-model-len=512"]
    t0 = time.monotonic()
    timeline = []  # (s, lines written)
    with open(log, "w") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, cwd=str(code_root),
                                env={**os.environ, "PYTHONPATH": str(code_root)},
                                start_new_session=True)
    killed_at = new_controller_s = None
    stopped = False
    killed: set[int] = set()
    workers_before: set[int] = set()
    try:
        while proc.poll() is None:
            now, written = time.monotonic() - t0, lines_in(out)
            timeline.append((now, written))
            if killed_at is None and written >= ns.rows // 4:
                workers_before = pids(proc.pid, WORKER)
                killed = pids(proc.pid, CONTROLLER)
                for pid in killed:
                    os.kill(pid, signal.SIGKILL)
                killed_at, lines_at_kill = now, written
                print(f"{now:.1f} s: SIGKILL controller {sorted(killed)} with {written} of "
                      f"{ns.rows} lines written", flush=True)
            elif killed_at is not None and new_controller_s is None:
                if pids(proc.pid, CONTROLLER) - killed:
                    new_controller_s = now - killed_at
                    workers_after = pids(proc.pid, WORKER)
            time.sleep(0.1)
            if now > ns.limit_s and not stopped:
                print(f"{now:.1f} s: past --limit-s, SIGTERM to the job", flush=True)
                proc.send_signal(signal.SIGTERM)
                stopped = True
                proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    wall_s = time.monotonic() - t0
    timeline.append((wall_s, lines_in(out)))

    answers = [json.loads(line) for line in out.read_text().splitlines()]
    counts = Counter(o["custom_id"] for o in answers)
    statuses = Counter(o["response"]["status_code"] for o in answers)
    expected = {f"r{i}" for i in range(ns.rows)}
    result = {
        "code": ns.compare_commit or "this", "rows": ns.rows, "workers": ns.workers, "max_tokens": ns.max_tokens,
        "exit_status": proc.returncode, "stopped_at_limit_s": ns.limit_s if stopped else None,
        "wall_s": wall_s, "output_lines": len(answers),
        "answered_exactly_once": sum(1 for c in expected if counts.get(c) == 1),
        "duplicated": sum(1 for c in counts.values() if c > 1),
        "missing": len(expected - set(counts)),
        "status_codes": {str(k): v for k, v in sorted(statuses.items())},
        # every row is valid: any line that is not a 200 is a failure not of the row's making
        "retryable_errors_written": sum(v for k, v in statuses.items() if k != 200),
        "wrong_token_counts": sum(1 for o in answers if o["response"]["status_code"] == 200 and
                                  o["response"]["body"]["usage"]["completion_tokens"]
                                  != ns.max_tokens),
        "controller_killed": bool(killed), "killed_at_s": killed_at,
        "lines_at_kill": lines_at_kill if killed else None,
        "new_controller_after_s": new_controller_s,
        "engines_kept_their_processes": (bool(workers_before) and workers_before == workers_after)
        if new_controller_s is not None else None,
        "log_says_new_controller": "starting a new one over the same engines" in log.read_text(),
    }
    print(log.read_text()[-1500:])
    print(table([result], ["rows", "output_lines", "answered_exactly_once", "duplicated",
                           "missing", "retryable_errors_written", "exit_status", "wall_s"]))
    print(table([result], ["lines_at_kill", "new_controller_after_s",
                           "engines_kept_their_processes", "wrong_token_counts"]))
    ok = (result["answered_exactly_once"] == ns.rows and result["retryable_errors_written"] == 0
          and proc.returncode == 0 and bool(killed))
    print(f"target (every row answered exactly once, 0 retryable errors written): "
          f"{'met' if ok else 'MISSED'}")
    result["target_met"] = ok
    result["timeline"] = timeline[::max(1, len(timeline) // 400)]
    path = write(ns.name, result)
    plot(result, ns.name)
    print(f"wrote {path}")
    shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


def plot(result: dict, name: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(*zip(*result["timeline"]), label="output lines")
    if result["killed_at_s"] is not None:
        ax.axvline(result["killed_at_s"], color="red", linestyle="--", label="controller SIGKILL")
    ax.set_xlabel("seconds since `raypaged batch` started")
    ax.set_ylabel("lines written")
    ax.set_title(f"raypaged batch, controller killed: {result['answered_exactly_once']}/"
                 f"{result['rows']} rows exactly once")
    ax.legend()
    fig.tight_layout()
    fig.savefig(plot_path(name))


if __name__ == "__main__":
    sys.exit(main())
