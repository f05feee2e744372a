"""fp8 (e4m3) KV cache: top-1 agreement with the full-precision cache, teacher-forced."""
import sys
from pathlib import Path

from raypaged import LLM

from engine_prompts import PROMPTS

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/ runs from the checkout
from benchmarks.fp8_kv_agreement import teacher_forced_top1  # noqa: E402


def test_fp8_cache_agrees_on_at_least_95_percent_of_positions(default_model_dir, hf_greedy, llm):
    tok = llm.get_tokenizer()
    ref = LLM(str(default_model_dir), dtype="float32", kv_memory_mb=32, max_model_len=256)
    fp8 = LLM(str(default_model_dir), dtype="float32", kv_memory_mb=32, max_model_len=256,
              kv_dtype="fp8_e4m3")
    agree = total = 0
    for prompt, cont in zip(PROMPTS, hf_greedy):
        prompt_ids = tok.encode(prompt)
        ids = prompt_ids + cont
        a, b = teacher_forced_top1(ref, ids), teacher_forced_top1(fp8, ids)
        gen = slice(len(prompt_ids) - 1, len(ids) - 1)  # predictions of the generated tokens
        assert a[gen] == cont  # the fp32 cache reproduces the greedy continuation exactly
        agree += sum(x == y for x, y in zip(a[gen], b[gen]))
        total += len(cont)
    rate = agree / total
    print(f"fp8 KV top-1 agreement: {agree}/{total} = {rate:.3f}")
    assert rate >= 0.95
