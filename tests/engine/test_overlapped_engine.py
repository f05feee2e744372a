"""Overlapped scheduling (--async-scheduling) on the real model (fp32, CPU): the same tokens,
text and finish reasons as the synchronous loop, which matches Hugging Face token for token."""
import pytest

from raypaged import LLM, SamplingParams

from engine_prompts import PROMPTS

GREEDY32 = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def overlapped(default_model_dir):
    return LLM(str(default_model_dir), dtype="float32", kv_memory_mb=128, max_model_len=1024,
               async_scheduling=True)


def summary(outputs):
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs]
            for o in outputs]


def test_the_engine_overlaps_only_when_asked(llm, overlapped):
    assert llm.engine.core.executor is None  # off by default
    assert overlapped.engine.core.executor is not None


def test_greedy_tokens_match_hf(overlapped, hf_greedy):
    outs = overlapped.generate(PROMPTS, GREEDY32, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy
    assert overlapped.engine.stats().memory.blocks_used == 0


@pytest.mark.parametrize("kwargs", [
    {"max_num_batched_tokens": 16},                                  # chunked prefill
    # preemption: admitting what fits makes this budget preempt (headroom admission would not)
    {"kv_context_len": 160, "max_model_len": 80, "block_size": 8, "admission_policy": "fits"},
], ids=["chunked_prefill", "preemption"])
def test_greedy_tokens_match_hf_under_chunking_and_preemption(default_model_dir, hf_greedy, kwargs):
    budget = {} if "kv_context_len" in kwargs else {"kv_memory_mb": 64}
    llm = LLM(str(default_model_dir), dtype="float32", async_scheduling=True,
              **{**budget, "max_model_len": 512, **kwargs})
    outs = llm.generate(PROMPTS, GREEDY32, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy
    stats = llm.engine.stats()
    if "kv_context_len" in kwargs:
        assert stats.num_preemptions > 0
    assert stats.memory.blocks_used == 0


def stopping_params(tok):
    """Each prompt ends differently: a stop string, a stop id, max_tokens, EOS, n = 2, seeds."""
    return [
        SamplingParams(temperature=0, max_tokens=40, stop=[" Paris", "."]),
        SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[tok.encode(":")[0]],
                       include_stop_str_in_output=True),
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=60),
        SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=25, stop=["\n"]),
        SamplingParams(temperature=1.0, top_k=40, seed=11, n=2, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=3, max_tokens=30, presence_penalty=0.5,
                       frequency_penalty=0.3, logprobs=2),
        SamplingParams(temperature=0, max_tokens=30, min_tokens=5, stop=[" the"]),
    ]


def test_stops_lengths_seeds_and_penalties_end_at_the_same_token(llm, overlapped):
    params = stopping_params(llm.get_tokenizer())
    sync = llm.generate(PROMPTS, params, use_tqdm=False)
    over = overlapped.generate(PROMPTS, params, use_tqdm=False)
    assert summary(over) == summary(sync)
    reasons = {c.finish_reason for o in sync for c in o.outputs}
    assert reasons == {"stop", "length"}
    for a, b in zip(sync, over):  # logprob values may differ in the last bits (batch shapes)
        for ca, cb in zip(a.outputs, b.outputs):
            assert len(ca.logprobs or ()) == len(cb.logprobs or ())


def test_abort_mid_stream_frees_every_block_and_emits_nothing_more(overlapped):
    engine = overlapped.engine
    tok = overlapped.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for i, p in enumerate(PROMPTS[:4]):
        engine.add_request(f"abort-{i}", tok.encode(p), params)
    seen = {}
    for _ in range(6):
        for o in engine.step():
            seen.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert 0 < len(seen["abort-1"]) < 30
    (out,) = engine.abort("abort-1")
    assert out.finish_reason == "abort"
    while engine.has_unfinished():
        for o in engine.step():
            assert o.request_id != "abort-1", "an aborted request produced after its abort"
            seen[o.request_id].extend(o.new_token_ids)
    assert all(len(seen[f"abort-{i}"]) == 30 for i in (0, 2, 3))
    assert engine.stats().memory.blocks_used == 0
    assert not engine.core.scheduler.kv.tables
