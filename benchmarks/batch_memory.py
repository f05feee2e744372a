"""The batch driver's peak memory against the number of input rows: is it flat?

    python benchmarks/batch_memory.py [--rows 10000 1000000] [--compare-commit REV]

For each size, a fresh process runs `BatchJob` (raypaged.batch.job: the real reader, row
parser, custom_id duplicate check, resume table, prefix grouping, bounded row tasks, retry
policy and output writer) on an input of that many OpenAI batch lines with distinct custom_ids,
over a stand-in engine pool whose frontend answers every row at once with a fixed completion
body. Then the output is cut to its first half and the job runs again (a resume: half the rows
found done). Each process reports its peak RSS (VmHWM of /proc/self/status: the high-water mark
of its own address space; getrusage's ru_maxrss would carry the parent's across fork and exec);
the parent checks every output has each custom_id exactly once.

What this measures: the memory the driver spends per row. What it leaves out: Ray's cluster,
the engines, the routers' per-worker state - none of which depends on the number of rows - and
the real frontend's tokenizing (per row, freed with it). The child imports what the job module
imports (ray's client library, the serving frontend, numpy), ~80-90 MB; the real driver also
holds torch and a Hugging Face tokenizer, so its baseline is larger and its ratio smaller than
the one measured here.

--compare-commit runs the same with raypaged/batch as of REV (e.g. the commit before the
per-row tables), checked out in a temporary git worktree.
JSON: benchmarks/results/batch_memory.json; PNG beside it.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# a child imports raypaged from the tree it measures (CODE_ROOT: this one, or --compare-commit's)
sys.path.insert(0, os.environ.get("CODE_ROOT", str(ROOT)))

TARGET = 1.2  # the largest input's peak RSS within this x the smallest's


# -- the child: one job in this process -----------------------------------------------------
class ByteTokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())


class Answer:
    status_code = 200

    def __init__(self, body: bytes):
        self.body = body


class StandInFrontend:
    """Answers at once with a fixed completion: the job's own work is all that is left."""

    tokenizer = ByteTokenizer()

    def __init__(self):
        self._n = 0

    async def completions(self, body: dict) -> Answer:
        self._n += 1
        return Answer(json.dumps({
            "id": f"cmpl-{self._n}", "object": "text_completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "text": " blue", "finish_reason": "length"}],
            "usage": {"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13,
                      "prompt_tokens_details": {"cached_tokens": 0}}}).encode())

    chat_completions = completions


class StandInPool:
    block_size = 16

    def __init__(self):
        self.frontend = StandInFrontend()

    def check_alive(self) -> None:
        pass

    async def stop(self) -> None:
        pass


def child(inp: str, out: str) -> None:
    import asyncio

    from raypaged.batch import job as job_module
    from raypaged.batch.options import BatchOptions

    async def start(serve_args=None):
        return StandInPool()
    job_module.EnginePool.start = start  # before BatchJob: old and new code both look it up
    options = BatchOptions(workers=1, max_inflight=256, progress_interval_s=3600)
    assert Path(job_module.__file__).is_relative_to(os.environ.get("CODE_ROOT", ROOT))
    job = job_module.BatchJob(inp, out, options=options)
    t0 = time.monotonic()
    summary = asyncio.run(job.run(serve_args=object()))
    print(json.dumps({"wall_s": time.monotonic() - t0, "rows": summary.rows,
                      "skipped": summary.skipped, "completed": summary.completed,
                      "peak_rss_mb": peak_rss_kb() / 1024}))


def peak_rss_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


# -- the parent ----------------------------------------------------------------------------
def write_input(path: Path, rows: int) -> None:
    with open(path, "w") as f:
        for i in range(rows):
            f.write(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions",
                                "body": {"prompt": f"Question {i}: name a colour.",
                                         "max_tokens": 1}}) + "\n")


def run_child(code_root: Path, inp: Path, out: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(code_root), "CODE_ROOT": str(code_root)}
    proc = subprocess.run([sys.executable, __file__, "--child", str(inp), str(out)], env=env,
                          capture_output=True, text=True, cwd=str(code_root))
    if proc.returncode != 0:
        raise RuntimeError(proc.stdout + proc.stderr)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def check_output(out: Path, rows: int) -> bool:
    ids = {json.loads(line)["custom_id"] for line in open(out)}
    with open(out, "rb") as f:
        lines = sum(1 for _ in f)
    return lines == rows and len(ids) == rows


def keep_first_half(out: Path) -> None:
    with open(out, "rb") as f:
        half = sum(1 for _ in f) // 2
    with open(out, "rb") as src, open(out.with_suffix(".half"), "wb") as dst:
        for _, line in zip(range(half), src):
            dst.write(line)
    out.with_suffix(".half").replace(out)


def measure(code: str, code_root: Path, rows_list: list[int], work: Path) -> list[dict]:
    results = []
    for rows in rows_list:
        inp, out = work / f"in_{rows}.jsonl", work / f"out_{code}_{rows}.jsonl"
        if not inp.exists():
            write_input(inp, rows)
        for phase in ("fresh", "resume half done"):
            if phase == "fresh":
                out.unlink(missing_ok=True)
            else:
                keep_first_half(out)
            r = run_child(code_root, inp, out)
            r.update(code=code, phase=phase, input_mb=inp.stat().st_size / 2**20,
                     exactly_once=check_output(out, rows))
            results.append(r)
            print(f"{code:>8} {phase:>16} {rows:>9,} rows: peak RSS {r['peak_rss_mb']:.1f} MB, "
                  f"{r['wall_s']:.1f} s, exactly once: {r['exactly_once']}", flush=True)
        out.unlink()
    return results


def worktree(rev: str, into: Path) -> Path:
    path = into / "compare"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), rev],
                   check=True, capture_output=True)
    return path


def plot(results: list[dict], name: str) -> None:
    from benchmarks.report import plot_path, pyplot
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for (code, phase) in sorted({(r["code"], r["phase"]) for r in results}):
        pts = sorted((r["rows"], r["peak_rss_mb"]) for r in results
                     if r["code"] == code and r["phase"] == phase)
        ax.plot(*zip(*pts), marker="o", label=f"{code}, {phase}")
    ax.set_xscale("log")
    ax.set_xlabel("input rows")
    ax.set_ylabel("driver peak RSS (MB)")
    ax.set_title("raypaged batch driver memory vs input size")
    ax.legend()
    fig.tight_layout()
    fig.savefig(plot_path(name))


def main(argv=None) -> int:
    sys.path.insert(1, str(ROOT))
    from benchmarks.report import write
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[10_000, 1_000_000])
    ap.add_argument("--compare-commit", help="also measure raypaged/batch as of this git revision")
    ap.add_argument("--name", default="batch_memory")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns.child:
        child(*ns.child)
        return 0
    rows_list = sorted(ns.rows)
    with tempfile.TemporaryDirectory(prefix="batch_memory_") as tmp:
        work = Path(tmp)
        results = measure("this", ROOT, rows_list, work)
        if ns.compare_commit:
            old = worktree(ns.compare_commit, work)
            try:
                results += measure(ns.compare_commit[:10], old, rows_list, work)
            finally:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                                str(old)], check=True)
    small, large = rows_list[0], rows_list[-1]
    ratios = {}
    for code in dict.fromkeys(r["code"] for r in results):
        for phase in ("fresh", "resume half done"):
            by = {r["rows"]: r for r in results if r["code"] == code and r["phase"] == phase}
            ratio = by[large]["peak_rss_mb"] / by[small]["peak_rss_mb"]
            per_row = ((by[large]["peak_rss_mb"] - by[small]["peak_rss_mb"]) * 2**20
                       / (large - small))
            ratios[f"{code}, {phase}"] = {"ratio": ratio, "bytes_per_row": per_row}
    from benchmarks.report import table
    print()
    print(table(results, ["code", "phase", "rows", "input_mb", "peak_rss_mb", "wall_s",
                          "exactly_once"]))
    print()
    for key, v in ratios.items():
        met = "met" if v["ratio"] <= TARGET else "MISSED"
        print(f"{key}: {large:,} rows / {small:,} rows peak RSS = {v['ratio']:.3f}x "
              f"(target <= {TARGET}x: {met}), {v['bytes_per_row']:.1f} bytes per extra row")
    path = write(ns.name, {"what": "driver peak RSS, stand-in engine pool (see docstring)",
                           "target_ratio": TARGET, "results": results, "ratios": ratios})
    plot(results, ns.name)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
