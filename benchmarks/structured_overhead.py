"""Structured outputs overhead: TPOT of constrained vs unconstrained requests, concurrency 16.

    .venv/bin/python benchmarks/structured_overhead.py [--concurrency 16] [--repeats 3]

One engine (the default model, fp32, CPU), `concurrency` requests submitted at once per run,
TPOT per request = (time of its last token - time of its first) / (tokens - 1), from the step
loop's clock; workloads interleaved run by run so drift on a shared machine hits each alike:

    plain    no constraint, exactly --tokens tokens (ignore_eos)
    regex    regex [A-Za-z ,.]+ with min_tokens = max_tokens = --tokens: the same token count,
             every token masked by the grammar (matcher + bitmask + apply)
    json     a JSON schema (a person: name, age, hobbies list), stops when the JSON is complete
             (up to --tokens); a cold compile per run (the cache is cleared before each run)

Target (issue 29): constrained TPOT <= 1.10x unconstrained. Writes
benchmarks/results/structured_overhead.json and .png.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.report import plot_path, pyplot, table, write  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "hobbies": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "age", "hobbies"]}
PROMPT = "Describe a person as JSON with a name, an age and a list of hobbies."


def workloads(tokens: int):
    from raypaged import SamplingParams

    return {
        "plain": SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True),
        "regex": SamplingParams(temperature=0, max_tokens=tokens, min_tokens=tokens,
                                structured_outputs={"regex": "[A-Za-z ,.]+"}),
        "json": SamplingParams(temperature=0, max_tokens=tokens,
                               structured_outputs={"json": SCHEMA}),
    }


def run_once(llm, params, concurrency: int) -> dict:
    engine = llm.engine
    tok = engine.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False,
                                     add_generation_prompt=True)
    ids = tok.encode(prompt, add_special_tokens=False)
    if engine.grammars is not None:  # every run compiles cold, as a new schema would
        engine.grammars._entries.clear()
    times: dict[str, list[float]] = {}
    start = time.perf_counter()
    for i in range(concurrency):
        engine.add_request(f"r{i}", ids, params)
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            times.setdefault(out.request_id, []).extend([now] * len(out.new_token_ids))
    wall = time.perf_counter() - start
    tpots = [(t[-1] - t[0]) / (len(t) - 1) for t in times.values() if len(t) > 1]
    tokens = sum(len(t) for t in times.values())
    return {"tpot_ms": 1e3 * statistics.mean(tpots), "ttft_ms": 1e3 * statistics.mean(
        t[0] - start for t in times.values()), "tokens": tokens,
        "tokens_per_s": tokens / wall, "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from raypaged import LLM

    llm = LLM(None, dtype="float32", max_model_len=1024)
    loads = workloads(args.tokens)
    run_once(llm, loads["plain"], 2)  # warm-up: kernels, thread pools, the tokenizer table
    run_once(llm, loads["json"], 2)
    runs: dict[str, list[dict]] = {k: [] for k in loads}
    for _ in range(args.repeats):
        for name, params in loads.items():
            runs[name].append(run_once(llm, params, args.concurrency))
    base = statistics.median(r["tpot_ms"] for r in runs["plain"])
    rows = []
    for name, rs in runs.items():
        tpot = statistics.median(r["tpot_ms"] for r in rs)
        rows.append({"workload": name, "tpot_ms": tpot, "tpot_vs_plain": tpot / base,
                     "target": "" if name == "plain" else
                     ("met" if tpot / base <= 1.10 else "MISSED (> 1.10x)"),
                     "ttft_ms": statistics.median(r["ttft_ms"] for r in rs),
                     "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
                     "tokens": rs[0]["tokens"]})
    print(table(rows, ["workload", "tpot_ms", "tpot_vs_plain", "target", "ttft_ms",
                       "tokens_per_s", "tokens"]))
    path = write("structured_overhead", {"concurrency": args.concurrency, "tokens": args.tokens,
                                         "repeats": args.repeats, "rows": rows, "runs": runs,
                                         "vllm": "not measured (see docs/structured_outputs.md)"})
    print(f"wrote {path}")
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.bar([r["workload"] for r in rows], [r["tpot_ms"] for r in rows],
               color=["#888", "#4a7", "#47a"])
        ax.axhline(base * 1.10, color="r", linestyle="--", label="1.10x plain (target)")
        ax.set_ylabel("TPOT, ms (median of runs)")
        ax.set_title(f"structured outputs, concurrency {args.concurrency}, CPU fp32")
        ax.legend()
        fig.tight_layout()
        fig.savefig(plot_path("structured_overhead"), dpi=110)


if __name__ == "__main__":
    main()
