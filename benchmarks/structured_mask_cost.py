"""Where constrained decoding's per-step cost goes: xgrammar's bitmask fill, the apply on the
logits and the token accept, for 16 rows of one JSON schema on SmolLM2's 49,152-token vocabulary.

    .venv/bin/python benchmarks/structured_mask_cost.py [--rows 16] [--repeats 3]

Each step: fill one bitmask row per matcher, apply the bitmask to [rows, vocab] float32 logits,
accept one token per matcher (the tokens of a fixed JSON answer). Two ways to fill, interleaved
repeat by repeat: per row (GrammarMatcher.fill_next_token_bitmask in a Python loop, what
model/sampler.py's LogitMasks does) and batched (BatchGrammarMatcher, xgrammar's own threads). Prints
per-step medians; writes benchmarks/results/structured_mask_cost.json and .png. No model runs:
compare these with a decode step's time (benchmarks/structured_overhead.py).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.report import plot_path, pyplot, table, write  # noqa: E402
from benchmarks.structured_overhead import SCHEMA  # noqa: E402

ANSWER = ('{"name": "Alice Smith", "age": 31, "hobbies": ["reading books", '
          '"hiking in the mountains", "cooking", "chess", "painting", "swimming"]}')


def steps(compiled, ids, rows: int, batched: bool, threads: int) -> dict:
    import torch
    import xgrammar as xgr

    vocab = compiled.tokenizer_info.vocab_size
    bitmask = xgr.allocate_token_bitmask(rows, vocab)
    logits = torch.randn(rows, vocab)
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(rows)]
    batch = xgr.BatchGrammarMatcher(max_threads=threads)
    fill, apply, accept = [], [], []
    for t in ids[:-1]:
        a = time.perf_counter()
        if batched:
            batch.batch_fill_next_token_bitmask(matchers, bitmask)
        else:
            for i, m in enumerate(matchers):
                m.fill_next_token_bitmask(bitmask, i)
        b = time.perf_counter()
        xgr.apply_token_bitmask_inplace(logits, bitmask, indices=list(range(rows)))
        c = time.perf_counter()
        for m in matchers:
            assert m.accept_token(t)
        fill.append(b - a)
        apply.append(c - b)
        accept.append(time.perf_counter() - c)
    return {"fill_ms": 1e3 * statistics.median(fill), "apply_ms": 1e3 * statistics.median(apply),
            "accept_ms": 1e3 * statistics.median(accept)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="BatchGrammarMatcher threads")
    args = ap.parse_args()
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from raypaged.model.default_model import default_model_dir

    tok = AutoTokenizer.from_pretrained(str(default_model_dir()))
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=49152,
                                              stop_token_ids=[tok.eos_token_id])
    compiled = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False) \
        .compile_json_schema(json.dumps(SCHEMA))
    ids = tok.encode(ANSWER, add_special_tokens=False)
    runs: dict[str, list[dict]] = {"per_row": [], "batched": []}
    for _ in range(args.repeats):
        for name in runs:
            runs[name].append(steps(compiled, ids, args.rows, name == "batched", args.threads))
    rows = []
    for name, rs in runs.items():
        row = {"fill": name, **{k: statistics.median(r[k] for r in rs) for k in rs[0]}}
        row["total_ms"] = row["fill_ms"] + row["apply_ms"] + row["accept_ms"]
        rows.append(row)
    print(table(rows, ["fill", "fill_ms", "apply_ms", "accept_ms", "total_ms"]))
    path = write("structured_mask_cost", {"rows_per_step": args.rows, "steps": len(ids) - 1,
                                          "repeats": args.repeats, "threads": args.threads,
                                          "rows": rows, "runs": runs})
    print(f"wrote {path}")
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        bottom = [0.0] * len(rows)
        for part, color in (("fill_ms", "#47a"), ("apply_ms", "#4a7"), ("accept_ms", "#a74")):
            vals = [r[part] for r in rows]
            ax.bar([r["fill"] for r in rows], vals, bottom=bottom, color=color, label=part)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_ylabel("ms per step (median)")
        ax.set_title(f"grammar mask cost, {args.rows} rows, 49,152 vocab, CPU")
        ax.legend()
        fig.tight_layout()
        fig.savefig(plot_path("structured_mask_cost"), dpi=110)


if __name__ == "__main__":
    main()
