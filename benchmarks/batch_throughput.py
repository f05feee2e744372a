"""Batch throughput: `raypaged batch` vs the offline `LLM.generate` on the same requests, 2 engines
vs 1, and the prefix cache hit rate with and without prefix grouping. One process, one run:

    offline         LLM.generate, all requests at once, on one CPU slice (torch threads)
    batch 1 engine  run_batch, one engine actor on one slice               (ratio to offline)
    batch 1 engine  run_batch, same, --no-prefix-grouping (input order)
    batch 2 engines run_batch, two actors on two slices, prefix grouping on (ratio to 1 engine)
    batch 2 engines run_batch, same, --no-prefix-grouping (input order, round robin)
    Ray Data, 1 / 2 read_json -> map_batches(actor holding the offline LLM) -> write_json, the
                    same requests as plain rows (benchmarks/ray_data_baseline.py; ratio to
                    `raypaged batch` with as many engines, prefix grouping on)

Workload (seeded): N completion requests, half of them a question after one of a few long shared
system prompts, half unique; shuffled; greedy, ignore_eos, a fixed number of output tokens.

    pip install -e '.[bench]'     # Ray Data (pandas, pyarrow) for its rows; or --no-ray-data
    python benchmarks/batch_throughput.py [--requests 512] [--cpus-per-engine 1] [--output-len 16]

The offline engine is warmed up with 4 requests first (as benchmarks/offline_throughput.py
does); the batch engines are not: their first, slow steps count against them, as they do for
Ray Data's actors. Each system's tok/s counts from its first row sent (Ray Data: the first batch
an actor began) to its last line written; engine start is `startup_s`, beside it.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.report import plot_path, pyplot, table, write  # noqa: E402

WORDS = ("river stone light garden window paper music silver cloud market winter forest engine "
         "letter bridge planet harbor candle mirror thunder orchard lantern valley").split()


def workload(n: int, systems: int, system_words: int, output_len: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    shared = [f"System {s}: " + " ".join(rng.choice(WORDS) for _ in range(system_words))
              for s in range(systems)]
    bodies = []
    for i in range(n):
        question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 40)))
        prompt = (f"{shared[i % systems]}\nQuestion {i}: {question}" if i % 2 == 0
                  else f"Note {i}: {question}")
        bodies.append({"prompt": prompt, "max_tokens": output_len, "temperature": 0,
                       "ignore_eos": True})
    rng.shuffle(bodies)
    return bodies


def run_offline(bodies: list[dict], engine: dict, threads: int) -> dict:
    from raypaged import LLM, SamplingParams

    llm = LLM(**engine, num_threads=threads)
    params = [SamplingParams(temperature=0, max_tokens=b["max_tokens"], ignore_eos=True)
              for b in bodies]
    llm.generate(["warm up"] * 4, params[:4], use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate([b["prompt"] for b in bodies], params, use_tqdm=False)
    dt = time.perf_counter() - t0
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    cached = sum(o.num_cached_tokens for o in outs)
    return {"run": "offline LLM.generate", "engines": 1, "grouping": "-", "seconds": dt,
            "output_tokens": out_tokens, "tok_per_s": out_tokens / dt,
            "prefix_hit_rate": cached / prompt_tokens}


def run_batch_job(bodies: list[dict], engine: dict, workers: int, cpus: float, grouping: bool,
                  tmp: Path) -> dict:
    from raypaged.batch import BatchOptions, run_batch
    from raypaged.config import EngineArgs

    inp, out = tmp / f"in-{workers}-{grouping}.jsonl", tmp / f"out-{workers}-{grouping}.jsonl"
    inp.write_text("".join(json.dumps({"custom_id": f"r{i}", "method": "POST",
                                       "url": "/v1/completions", "body": b}) + "\n"
                           for i, b in enumerate(bodies)))
    s = run_batch(inp, out, EngineArgs(**engine),
                  BatchOptions(workers=workers, cpus_per_worker=cpus, prefix_grouping=grouping,
                               progress_interval_s=30))
    assert (s.completed, s.failed) == (len(bodies), 0), s
    return {"run": f"raypaged batch, {workers} engine{'s' * (workers > 1)}", "engines": workers,
            "grouping": "on" if grouping else "off", "seconds": s.wall_s,
            "output_tokens": s.completion_tokens, "tok_per_s": s.output_tokens_per_s,
            "prefix_hit_rate": s.prefix_hit_rate, "startup_s": s.startup_s}


def add_ratios(rows: list[dict]) -> None:
    """x_offline; x_1_engine (to the same system with one engine); x_raypaged (to `raypaged
    batch` with prefix grouping and as many engines)."""
    def system(r):
        return r["run"].split(",")[0]
    offline = rows[0]["tok_per_s"]
    one = {system(r): r["tok_per_s"] for r in rows if r["engines"] == 1 and r["grouping"] != "off"}
    ours = {r["engines"]: r["tok_per_s"] for r in rows
            if system(r) == "raypaged batch" and r["grouping"] == "on"}
    for r in rows:
        r["x_offline"] = r["tok_per_s"] / offline
        r["x_1_engine"] = r["tok_per_s"] / one[system(r)]
        r["x_raypaged"] = (r["tok_per_s"] / ours[r["engines"]]
                           if system(r) != "offline LLM.generate" else None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--system-prompts", type=int, default=4)
    ap.add_argument("--system-words", type=int, default=200, help="words per shared system prompt")
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--cpus-per-engine", type=int, default=1,
                    help="one CPU slice: the offline engine's torch threads, each actor's CPUs")
    ap.add_argument("--kv-memory-mb", type=float, default=256)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ray-data-batch-size", type=int, default=32,
                    help="rows per map_batches call (Ray Data LLM's default batch_size is 32)")
    ap.add_argument("--no-ray-data", action="store_true",
                    help="skip the Ray Data rows (they need `pip install -e '.[bench]'`)")
    args = ap.parse_args()

    import ray

    if not args.no_ray_data:
        try:
            import ray.data  # noqa: F401
        except ImportError as exc:
            sys.exit(f"Ray Data is not importable ({exc}): pip install -e '.[bench]', "
                     "or run with --no-ray-data")
    bodies = workload(args.requests, args.system_prompts, args.system_words, args.output_len,
                      args.seed)
    engine = dict(dtype=args.dtype, kv_memory_mb=args.kv_memory_mb, max_model_len=1024)
    slice_ = args.cpus_per_engine
    load_at_start = os.getloadavg()[0]
    rows = [run_offline(bodies, engine, slice_)]
    ray.init(address="local", num_cpus=2 * slice_, include_dashboard=False,
             _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for workers in (1, 2):  # Ray Data right after its peer: load drifts on a shared box
                rows.append(run_batch_job(bodies, engine, workers, slice_, True, Path(tmp)))
                if not args.no_ray_data:
                    from benchmarks.ray_data_baseline import run_ray_data
                    from raypaged.serve.allocator import worker_env_vars
                    rows.append(run_ray_data(bodies, engine, workers, slice_,
                                             args.ray_data_batch_size, Path(tmp),
                                             worker_env_vars("tcmalloc")))
                rows.append(run_batch_job(bodies, engine, workers, slice_, False, Path(tmp)))
    finally:
        ray.shutdown()
    add_ratios(rows)
    print(f"{args.requests} completion requests, half behind one of {args.system_prompts} shared "
          f"system prompts of {args.system_words} words; {args.output_len} output tokens each "
          f"(greedy, ignore_eos); {slice_} CPU(s) per engine; KV {args.kv_memory_mb:g} MiB per "
          "engine")
    print(table(rows, ["run", "grouping", "seconds", "output_tokens", "tok_per_s", "x_offline",
                       "x_1_engine", "x_raypaged", "prefix_hit_rate", "startup_s",
                       "output_files", "engines_per_prefix"]))
    load = {"at_start": load_at_start, "at_end": os.getloadavg()[0], "cpus": os.cpu_count()}
    print(f"load average (1 min) {load['at_start']:.2f} at the start, {load['at_end']:.2f} at the "
          f"end, on {load['cpus']} CPUs: this run's own engines and driver count in it")
    # without the Ray Data rows, the file the README's earlier batch row names
    name = "batch_throughput" if args.no_ray_data else "batch_throughput_ray_data"
    print(f"wrote {write(name, {'args': vars(args), 'load_average': load, 'rows': rows})}")
    plt = pyplot()
    if plt is None:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(14, 4.2))
    labels = [label(r) for r in rows]
    a.bar(labels, [r["tok_per_s"] for r in rows])
    a.set_ylabel("output tokens / s")
    a.set_title("throughput (same requests, same run)")
    a.tick_params(axis="x", labelsize=7)
    b.tick_params(axis="x", labelsize=7)
    b.bar(labels, [100 * r["prefix_hit_rate"] for r in rows])
    b.set_ylabel("prompt tokens from the prefix cache (%)")
    b.set_title("prefix cache hit rate")
    fig.tight_layout()
    fig.savefig(plot_path(name), dpi=80)
    print(f"wrote {plot_path(name)}")


def label(row: dict) -> str:
    if row["run"].startswith("offline"):
        return "offline"
    name = "Ray Data" if row["run"].startswith("Ray Data") else "batch"
    return f"{name} {row['engines']}" + ("\nno grouping" if row["grouping"] == "off" else "")


if __name__ == "__main__":
    main()
