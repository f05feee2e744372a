"""Sampling options through the whole engine on the real model: exact observable behaviour."""

import pytest

from raypaged import SamplingParams

from engine_prompts import PROMPTS


def greedy(llm, prompt, **kw):
    params = SamplingParams(**{"temperature": 0, "max_tokens": 24, "ignore_eos": True, **kw})
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]


def test_same_seed_same_text_alone_and_inside_a_batch(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate(PROMPTS[2], seeded, use_tqdm=False)[0].outputs[0].text
    others = [SamplingParams(temperature=0.8, max_tokens=10 + i, ignore_eos=True) for i in range(7)]
    batch = llm.generate(PROMPTS[:2] + [PROMPTS[2]] + PROMPTS[3:], others[:2] + [seeded] + others[2:],
                         use_tqdm=False)
    assert batch[2].outputs[0].text == alone
    unseeded = llm.generate(PROMPTS[2], SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True,
                                                       seed=4321), use_tqdm=False)[0].outputs[0].text
    assert unseeded != alone


def test_n4_returns_four_samples_and_stores_the_prompt_once(llm):
    engine = llm.engine
    tok = llm.get_tokenizer()
    prompt = tok.encode(PROMPTS[2] * 6)  # long enough that sharing shows
    # the separate requests use another prompt of the same length, so no prefix-cache hits
    other = tok.encode(PROMPTS[3] * 12)[:len(prompt)]

    def peak(add):
        add()
        top = 0
        outs = {}
        while engine.has_unfinished():
            for o in engine.step():
                outs.setdefault((o.request_id, o.index), []).extend(o.new_token_ids)
            top = max(top, engine.stats().memory.blocks_used)
        return top, outs

    sp = SamplingParams(temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    forked, outs = peak(lambda: engine.add_request("fork", prompt, SamplingParams(
        n=4, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)))
    assert sorted(outs) == [("fork", i) for i in range(4)]
    assert all(len(v) == 8 for v in outs.values())
    assert len({tuple(v) for v in outs.values()}) > 1  # the samples differ
    separate, _ = peak(lambda: [engine.add_request(f"sep{i}", other, sp) for i in range(4)])
    assert forked < separate
    res = llm.generate(PROMPTS[0], SamplingParams(n=4, temperature=1.0, max_tokens=5), use_tqdm=False)[0]
    assert [o.index for o in res.outputs] == [0, 1, 2, 3]


def test_stop_string_ends_the_text_before_it_and_never_streams_it(llm):
    full = greedy(llm, PROMPTS[2]).text
    stop = full[12:17]
    assert stop.strip() and full.find(stop) == 12
    out = greedy(llm, PROMPTS[2], stop=[stop])
    assert (out.text, out.finish_reason, out.stop_reason) == (full[:12], "stop", stop)
    kept = greedy(llm, PROMPTS[2], stop=[stop], include_stop_str_in_output=True)
    assert kept.text == full[:17]
    # streamed deltas never contain the stop string, and add up to the final text
    engine = llm.engine
    ids = llm.get_tokenizer().encode(PROMPTS[2])
    engine.add_request("stream", ids, SamplingParams(temperature=0, max_tokens=24, stop=[stop]))
    deltas = []
    while engine.has_unfinished():
        deltas += [o.new_text for o in engine.step()]
    assert "".join(deltas) == full[:12]
    assert engine.stats().memory.blocks_used == 0


def test_stop_token_ids_end_on_that_token(llm):
    toks = greedy(llm, PROMPTS[1]).token_ids
    k = 5
    target = toks[k]
    first = toks.index(target)
    out = greedy(llm, PROMPTS[1], stop_token_ids=[target])
    assert out.token_ids == toks[:first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", target)


def test_eos_stops_and_min_tokens_delays_it(llm):
    chat = [{"role": "user", "content": "Say hello."}]
    short = llm.chat(chat, SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0].outputs[0]
    eos = llm.engine.eos_token_ids[0]
    assert short.finish_reason == "stop" and short.token_ids[-1] == eos
    n = len(short.token_ids)
    longer = llm.chat(chat, SamplingParams(temperature=0, max_tokens=64, min_tokens=n + 3),
                      use_tqdm=False)[0].outputs[0]
    assert eos not in longer.token_ids[:n + 3]
    assert len(longer.token_ids) >= n + 3


def test_max_tokens_finishes_with_length(llm):
    out = greedy(llm, PROMPTS[0], max_tokens=5)
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_logprobs_rank_and_top_alternatives(llm):
    out = greedy(llm, PROMPTS[0], logprobs=3, max_tokens=6)
    assert len(out.logprobs) == 6
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == tok and lp.rank == 1 and len(lp.top) == 3
        assert lp.top[0] == (tok, lp.logprob)
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1] and lp.logprob <= 0


def test_penalties_reduce_repetition(llm):
    plain = greedy(llm, "Repeat after me: la la la la la la", max_tokens=24).token_ids
    penalised = greedy(llm, "Repeat after me: la la la la la la", max_tokens=24,
                       presence_penalty=2.0, frequency_penalty=2.0).token_ids
    assert len(set(penalised)) > len(set(plain))


def test_chat_continues_a_final_assistant_message_as_vllms_llm_chat_does(llm):
    prefill = [{"role": "user", "content": "What is the capital of France?"},
               {"role": "assistant", "content": "The capital of France is"}]
    greedy = SamplingParams(temperature=0, max_tokens=3)
    out = llm.chat(prefill, greedy, use_tqdm=False, add_generation_prompt=False,
                   continue_final_message=True)[0]
    assert out.prompt.endswith("The capital of France is")  # no end of turn after it
    assert "Paris" in out.outputs[0].text
    with pytest.raises(ValueError, match="set add_generation_prompt to false"):
        llm.chat(prefill, greedy, use_tqdm=False, continue_final_message=True)
