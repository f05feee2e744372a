"""Structured outputs on the real default model (greedy, fp32): each constraint kind's exact
output, logit_bias, n > 1, and a constraint that survives preemption and continuation."""
from __future__ import annotations

import json

import pytest

from raypaged import LLM
from raypaged.core.contracts import Continuation
from raypaged.core.sampling_params import SamplingParams

PERSON = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"]}
ASK = [{"role": "user", "content": "Give me a person as JSON with name and age."}]


def greedy(so, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=40, structured_outputs=so, **kw)


@pytest.mark.parametrize("so, text", [
    ({"json": PERSON}, '{\n  "name": "John",\n  "age": 25\n}'),
    ({"json": PERSON, "disable_any_whitespace": True}, '{"name": "John", "age": 25}'),
    ({"json_object": True}, '{\n  "name": "John",\n  "age": 25\n}'),
    ({"regex": r"[0-9]{3}-[0-9]{4}"}, "123-1568"),
    ({"choice": ["yes", "no"]}, "no"),
    ({"grammar": 'root ::= "hello " name\nname ::= "world" | "there"'}, "hello there"),
], ids=["json", "json_compact", "json_object", "regex", "choice", "grammar"])
def test_each_constraint_gives_its_exact_greedy_output_and_stops(llm, so, text):
    out = llm.chat(ASK, greedy(so), use_tqdm=False)[0].outputs[0]
    assert out.text == text
    assert out.finish_reason == "stop"


def test_without_a_constraint_the_same_prompt_answers_in_markdown(llm):
    # what the constraint changes: unconstrained, the model wraps its JSON in a code fence
    out = llm.chat(ASK, greedy(None), use_tqdm=False)[0].outputs[0]
    assert out.text.startswith("```json\n{")


def test_logit_bias_forces_its_token(llm):
    tok = llm.get_tokenizer()
    paris = tok.encode(" Paris")[0]
    plain = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    biased = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True,
                            logit_bias={paris: 100})
    prompt = "The capital of France is"
    assert llm.generate(prompt, plain, use_tqdm=False)[0].outputs[0].text == " Paris.\n"
    assert llm.generate(prompt, biased, use_tqdm=False)[0].outputs[0].text == " Paris Paris Paris"


def test_each_of_n_samples_keeps_its_own_grammar_state(llm):
    choices = ["red apple", "green pear", "blue plum", "yellow lemon"]
    params = SamplingParams(n=6, temperature=1.5, seed=3, max_tokens=12,
                            structured_outputs={"choice": choices})
    outs = llm.generate("My favourite fruit is the", params, use_tqdm=False)[0].outputs
    texts = [o.text for o in outs]
    assert all(t in choices for t in texts), texts
    assert len(set(texts)) > 1  # the samples went their own ways, each still valid


def test_a_bad_constraint_is_refused_before_anything_runs(llm):
    for so, what in [({"regex": "a("}, "parenthesis is not closed"),
                     ({"json": {"type": "foo"}}, 'Unsupported type "foo"'),
                     ({"grammar": "root ::= x"}, 'Rule "x" is not defined')]:
        with pytest.raises(ValueError, match=what):
            llm.generate("x", greedy(so), use_tqdm=False)
    assert not llm.engine.has_unfinished()


def test_a_constrained_request_continues_from_its_tokens_with_its_grammar_state(llm):
    """A continuation (the failover path) replays its output tokens into a fresh matcher."""
    engine = llm.engine
    prompt = llm.chat(ASK, greedy({"json": PERSON}), use_tqdm=False)[0].prompt_token_ids
    whole = list(llm.chat(ASK, greedy({"json": PERSON}), use_tqdm=False)[0].outputs[0].token_ids)
    replayed = engine.runner.sampler.masks.num_replayed
    for cut in (1, 7, len(whole) - 1):
        rid = f"cont{cut}"
        engine.add_request(rid, prompt, greedy({"json": PERSON}),
                           continuation=Continuation(0, tuple(whole[:cut]), 0))
        more = []
        while engine.has_unfinished():
            for out in engine.step():
                more.extend(out.new_token_ids)
        assert whole[:cut] + more == whole, cut
    assert engine.runner.sampler.masks.num_replayed - replayed == 1 + 7 + len(whole) - 1


def test_constrained_outputs_are_unchanged_by_preemption(default_model_dir, llm):
    regexes = [r"[0-9]{3}-[0-9]{4}", r"(cat|dog)s? (run|sleep)", r"[A-Z][a-z]+ [A-Z][a-z]+"]
    specs = [{"json": PERSON}, {"json_object": True}] + [{"regex": r} for r in regexes]
    params = [SamplingParams(temperature=0, max_tokens=30, structured_outputs=s) for s in specs]
    roomy = [o.outputs[0].token_ids for o in llm.chat([ASK] * len(specs), params,
                                                      use_tqdm=False)]
    tight = LLM(str(default_model_dir), dtype="float32", kv_context_len=160, max_model_len=80,
                block_size=8, admission_policy="fits")
    for p in params:  # compiled before they arrive, so all five run (and preempt) together
        tight.engine.grammars.prepare(p.structured_outputs).future.result()
    outs = tight.chat([ASK] * len(specs), params, use_tqdm=False)
    assert tight.engine.stats().num_preemptions > 0
    assert tight.engine.runner.sampler.masks.num_replayed > 0  # a re-admitted one replayed
    assert [o.outputs[0].token_ids for o in outs] == roomy
    assert json.loads(outs[0].outputs[0].text) == {"name": "John", "age": 25}
