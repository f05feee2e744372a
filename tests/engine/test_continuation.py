"""A sample carried on from its tokens (serving's failover) goes on exactly as if uninterrupted:
the same tokens (greedy, seeded, penalties, min_tokens) and the same text deltas, whatever
characters the detokenizer was still holding back at the cut."""
from __future__ import annotations

import pytest

from raypaged.core.contracts import Continuation
from raypaged.core.sampling_params import SamplingParams
from raypaged.output_processor import IncrementalDetokenizer


def deltas_from(tok, prompt_ids, ids, cut, text_chars, stop):
    detok = IncrementalDetokenizer(tok, prompt_ids, SamplingParams(stop=stop))
    detok.resume(ids[:cut], text_chars)
    return [detok.add([t]) for t in ids[cut:]]


def test_the_detokenizer_resumes_at_every_cut_with_the_same_text(llm):
    tok = llm.get_tokenizer()
    prompt_ids = tok.encode("Say:")
    ids = tok.encode(" héllo 🦊 wörld — 東京 ✓ and then Paris, of course")
    stop = ("Paris",)
    whole = IncrementalDetokenizer(tok, prompt_ids, SamplingParams(stop=stop))
    deltas = []
    for t in ids:
        deltas.append(whole.add([t]))
        if whole.stop_reason:  # the sample ends with this token
            break
    assert "".join(deltas) == " héllo 🦊 wörld — 東京 ✓ and then "
    ids = ids[:len(deltas)]
    held = 0
    for cut in range(1, len(ids)):
        sent = "".join(deltas[:cut])
        held += len(tok.decode(ids[:cut])) - len(sent) > 1  # characters still held back
        rest = deltas_from(tok, prompt_ids, ids, cut, len(sent), stop)
        assert rest == deltas[cut:], cut
    assert held  # some cuts fall where the stop-string hold or a split character waits


def test_a_continuation_that_claims_more_text_than_its_tokens_is_refused(llm):
    tok = llm.get_tokenizer()
    detok = IncrementalDetokenizer(tok, tok.encode("Say:"), SamplingParams())
    with pytest.raises(ValueError, match="text_chars=99"):
        detok.resume(tok.encode(" hi"), 99)


def run(engine, rid, prompt_ids, params, continuation=None):
    engine.add_request(rid, prompt_ids, params, continuation=continuation)
    tokens, texts = [], []
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id == rid
            tokens.extend(out.new_token_ids)
            texts.append(out.new_text)
            finish = out.finish_reason
    return tokens, texts, finish


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=14, ignore_eos=True),
    SamplingParams(temperature=0.9, seed=11, max_tokens=14, min_tokens=12,
                   presence_penalty=0.5, repetition_penalty=1.2),
], ids=["greedy", "seeded_penalties_min_tokens"])
def test_the_engine_continues_a_sample_with_the_uninterrupted_tokens_and_text(llm, params):
    engine = llm.engine
    prompt = engine.tokenizer.encode("The three largest cities in Europe are")
    tokens, texts, finish = run(engine, "whole", prompt, params)
    assert len(tokens) == 14
    for cut in (1, 6, 13):
        sent = "".join(texts[:cut])
        more, more_texts, more_finish = run(engine, f"cut{cut}", prompt, params,
                                            Continuation(0, tuple(tokens[:cut]), len(sent)))
        assert tokens[:cut] + more == tokens, cut
        assert sent + "".join(more_texts) == "".join(texts), cut
        assert more_finish == finish


def test_a_continuation_of_the_third_sample_draws_that_samples_seeded_tokens(llm):
    engine = llm.engine
    prompt = engine.tokenizer.encode("Name a colour:")
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    engine.add_request("n3", prompt, params)
    samples: dict[int, list[int]] = {0: [], 1: [], 2: []}
    texts: dict[int, list[str]] = {0: [], 1: [], 2: []}
    while engine.has_unfinished():
        for out in engine.step():
            samples[out.index].extend(out.new_token_ids)
            texts[out.index].append(out.new_text)
    assert len({tuple(s) for s in samples.values()}) == 3  # the samples differ
    sent = "".join(texts[2][:3])
    more, more_texts, _ = run(engine, "n3-2", prompt, SamplingParams(
        n=1, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True),
        Continuation(2, tuple(samples[2][:3]), len(sent)))
    assert samples[2][:3] + more == samples[2]
    assert sent + "".join(more_texts) == "".join(texts[2])
    with pytest.raises(ValueError, match="n must be 1"):
        engine.add_request("bad", prompt, params, continuation=Continuation(0, (1,), 0))
