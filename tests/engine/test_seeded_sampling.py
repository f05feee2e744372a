"""A seeded request's tokens depend on its seed alone: not on its batch, not on preemption.

Real default model, fp32 on the CPU. The reference is the request run alone; then inside a batch
of 12 with other sampling settings; then in an engine whose KV pool is so small that the seeded
request (the newest, so the one preempted) is preempted and recomputed mid-generation.
"""
import pytest

from raypaged import LLM, SamplingParams

from engine_prompts import PROMPTS

SEEDED = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=2024, max_tokens=20, ignore_eos=True)


def others(n):
    return [SamplingParams(temperature=[0, 0.7, 1.0][i % 3], seed=None if i % 2 else i,
                           max_tokens=12 + i, ignore_eos=True) for i in range(n)]


def run_to_end(engine, requests):
    """requests: [(id, prompt ids, params)] -> ({id: tokens}, {id: times preempted})."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    tokens, preempted = {rid: [] for rid, _, _ in requests}, {}
    while engine.has_unfinished():
        for o in engine.step():
            tokens[o.request_id].extend(o.new_token_ids)
        for rid, req in engine.core.scheduler.requests.items():
            preempted[rid] = req.num_preemptions
    return tokens, preempted


@pytest.fixture(scope="module")
def prompts(llm):
    tok = llm.get_tokenizer()
    return [tok.encode(p) for p in PROMPTS + [p + " Then" for p in PROMPTS]]


def test_same_seed_same_tokens_alone_in_a_batch_of_12_and_after_preemption(llm, default_model_dir, prompts):
    target = prompts[2]
    alone, _ = run_to_end(llm.engine, [("alone", target, SEEDED)])
    assert len(alone["alone"]) == 20

    batch = [(f"o{i}", prompts[i + 3], p) for i, p in enumerate(others(11))] + [("seeded", target, SEEDED)]
    batched, _ = run_to_end(llm.engine, batch)
    assert batched["seeded"] == alone["alone"]

    # 7 blocks of 16 tokens: 5 sequences growing to 2-3 blocks each cannot all stay, and under
    # the first rules (admit what fits, preempt the newest) the newest running one (the seeded
    # request, added last) is the one preempted
    small = LLM(str(default_model_dir), dtype="float32", kv_context_len=7 * 16, max_model_len=64,
                admission_policy="fits", preemption_policy="newest")
    tight, preempted = run_to_end(small.engine, batch[-5:])
    assert preempted["seeded"] >= 1
    assert tight["seeded"] == alone["alone"]
