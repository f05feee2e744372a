"""fp8 (e4m3) KV cache quality: top-1 agreement with a full-precision cache, teacher-forced.

For each prompt, the fp32-cache engine's greedy continuation is the reference text; both engines
(fp32 model, fp32 cache vs fp8 e4m3 cache) then read prompt + reference through their paged caches
in chunks (so every chunk attends to K/V read back from the cache) and predict each next token.
Agreement = the share of the reference's positions where the fp8 engine's argmax equals the
fp32 engine's. Teacher forcing keeps one early disagreement from changing every later position.

    python benchmarks/fp8_kv_agreement.py [--tokens 32] [--model DIR]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "engine"))  # the prompts the engine tests check against HF

from benchmarks.report import pyplot, plot_path, table, write  # noqa: E402
from engine_prompts import PROMPTS  # noqa: E402

TARGET = 0.95


def teacher_forced_top1(llm, ids: list[int], chunk: int = 16) -> list[int]:
    """Prefill `ids` in chunks through the paged cache (every chunk reads the earlier ones back
    from the cache) and return the argmax prediction at every position."""
    from raypaged.core.contracts import ScheduledBatch, ScheduledRequest
    from raypaged import SamplingParams

    runner = llm.engine.runner
    bs = llm.engine.block_size
    table_ = list(range(-(-len(ids) // bs)))  # the engine is idle and owns these blocks exclusively
    preds = []
    for start in range(0, len(ids), chunk):
        sr = ScheduledRequest("tf", ids[start:start + chunk], start, table_, 0, SamplingParams(),
                              ids, [])
        input_ids, positions, meta = runner.buffers.prepare(ScheduledBatch((sr,)))
        hidden = runner.model(input_ids, positions, runner.kv_caches, meta)
        preds += runner.model.compute_logits(hidden).argmax(-1).tolist()
    return preds


def agreement(ref, fp8, prompts: list[str], continuations: list[list[int]]) -> list[dict]:
    """Per prompt: positions where the fp8 engine's top-1 equals the reference engine's."""
    tok = ref.get_tokenizer()
    rows = []
    for prompt, cont in zip(prompts, continuations):
        prompt_ids = tok.encode(prompt)
        ids = prompt_ids + cont
        a, b = teacher_forced_top1(ref, ids), teacher_forced_top1(fp8, ids)
        gen = slice(len(prompt_ids) - 1, len(ids) - 1)  # predictions of the continuation
        rows.append({"prompt": prompt[:32].replace("\n", "\\n"), "tokens": len(cont),
                     "ref_reproduces": a[gen] == cont,
                     "agree": sum(x == y for x, y in zip(a[gen], b[gen]))})
    return rows


def main(argv=None) -> None:
    from raypaged import LLM, SamplingParams

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=32, help="reference tokens per prompt")
    p.add_argument("--model", default=None, help="model folder (default: the default model)")
    args = p.parse_args(argv)
    common = dict(dtype="float32", kv_memory_mb=32, max_model_len=256)
    ref = LLM(args.model, **common)
    fp8 = LLM(args.model, kv_dtype="fp8_e4m3", **common)
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    continuations = [o.outputs[0].token_ids for o in ref.generate(PROMPTS, params)]
    rows = agreement(ref, fp8, PROMPTS, continuations)
    agree, total = sum(r["agree"] for r in rows), sum(r["tokens"] for r in rows)
    rate = agree / total
    print(table(rows, ["prompt", "tokens", "agree", "ref_reproduces"]))
    verdict = "met" if rate >= TARGET else "MISSED"
    print(f"fp8 KV top-1 agreement: {agree}/{total} = {rate:.3f} (target >= {TARGET}: {verdict})")
    path = write("fp8_kv_agreement", {"args": vars(args), "rows": rows, "agree": agree,
                                      "total": total, "rate": rate, "target": TARGET,
                                      "verdict": verdict})
    print(f"wrote {path}")
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.barh([r["prompt"] for r in rows], [r["agree"] / r["tokens"] for r in rows])
    ax.axvline(TARGET, color="k", ls="--", lw=1)
    ax.set_xlabel("top-1 agreement, fp8 e4m3 cache vs fp32 cache")
    ax.set_title(f"fp8 KV agreement: {rate:.3f} overall ({agree}/{total})")
    fig.tight_layout()
    fig.savefig(plot_path("fp8_kv_agreement"))


if __name__ == "__main__":
    main()
