"""Greedy tokens equal Hugging Face transformers' generate, token for token (fp32)."""
import pytest

from raypaged import LLM, SamplingParams

from engine_prompts import PROMPTS

GREEDY32 = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_one_mixed_length_batch_matches_hf(llm, hf_greedy):
    # the default CPU engine decodes through the C++ kernel that reads the paged cache in place
    assert llm.engine.runner.model.backend.decode_kernel is not None
    assert token_ids(llm.generate(PROMPTS, GREEDY32, use_tqdm=False)) == hf_greedy


def test_gather_decode_path_matches_hf_too(default_model_dir, hf_greedy):
    llm = LLM(str(default_model_dir), dtype="float32", kv_memory_mb=64, max_model_len=512,
              cpu_decode_kernel=False)
    assert llm.engine.runner.model.backend.decode_kernel is None
    assert token_ids(llm.generate(PROMPTS, GREEDY32, use_tqdm=False)) == hf_greedy


def test_prefix_cache_hit_gives_the_same_tokens(llm, hf_greedy):
    shared = "You are a helpful assistant. Answer briefly and precisely. " * 4
    tok = llm.get_tokenizer()
    first = llm.generate(shared + PROMPTS[0], GREEDY32, use_tqdm=False)[0]
    again = llm.generate(shared + PROMPTS[0], GREEDY32, use_tqdm=False)[0]
    assert again.num_cached_tokens >= 16 * ((len(tok.encode(shared)) - 1) // 16)
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


@pytest.mark.parametrize("kwargs", [
    {"block_size": 8},
    {"block_size": 32},
    {"max_num_batched_tokens": 16},            # every prompt prefilled in chunks
    # preemption: admitting what fits makes this budget preempt (headroom admission would not)
    {"kv_context_len": 160, "max_model_len": 80, "block_size": 8, "admission_policy": "fits"},
], ids=["block8", "block32", "chunked_prefill", "preemption"])
def test_same_tokens_under_other_cache_shapes(default_model_dir, hf_greedy, kwargs):
    budget = {} if "kv_context_len" in kwargs else {"kv_memory_mb": 64}
    llm = LLM(str(default_model_dir), dtype="float32", **{**budget, "max_model_len": 512, **kwargs})
    assert token_ids(llm.generate(PROMPTS, GREEDY32, use_tqdm=False)) == hf_greedy
    stats = llm.engine.stats()
    if "kv_context_len" in kwargs:
        assert stats.num_preemptions > 0
    assert stats.memory.blocks_used == 0  # every block returned
