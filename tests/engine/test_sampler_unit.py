"""Sampler behaviour on hand-made logits: exact picks, masks and log-probabilities."""
import math

import torch

from raypaged.core.sampling_params import SamplingParams
from raypaged.model.sampler import SampleRow, Sampler


def row(prompt=(9,), output=(), eos=None, index=0, **kw):
    return SampleRow(SamplingParams(**kw), list(prompt), list(output), index, eos)


def pick(logits, r):
    tokens, lps = Sampler()(torch.tensor([logits], dtype=torch.float32), [r])
    return tokens[0], lps[0]


def test_penalties_change_the_greedy_pick_exactly():
    logits = [3.0, 2.9, 0.0, -1.0]
    assert pick(logits, row(temperature=0))[0] == 0
    assert pick(logits, row(temperature=0, output=[0], presence_penalty=0.5))[0] == 1
    # frequency: 0 appeared twice -> 3.0 - 2*0.04 = 2.92 > 2.9; three times -> 2.88 < 2.9
    assert pick(logits, row(temperature=0, output=[0, 0], frequency_penalty=0.04))[0] == 0
    assert pick(logits, row(temperature=0, output=[0, 0, 0], frequency_penalty=0.04))[0] == 1
    # repetition: token 0 is in the prompt -> 3.0 / 2 = 1.5 < 2.9
    assert pick(logits, row(temperature=0, prompt=[0], repetition_penalty=2.0))[0] == 1
    # a negative logit seen before is pushed further down: -1 * 2 = -2 (not -0.5)
    assert pick([-1.0, -1.4], row(temperature=0, prompt=[0], repetition_penalty=2.0))[0] == 1


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = [0.0, 5.0, 4.0, 1.0]  # EOS = 1 is the favourite, stop id 2 the next
    r = dict(temperature=0, min_tokens=2, stop_token_ids=[2])
    assert pick(logits, row(eos=1, output=[], **r))[0] == 3
    assert pick(logits, row(eos=1, output=[3], **r))[0] == 3
    assert pick(logits, row(eos=1, output=[3, 3], **r))[0] == 1
    assert pick(logits, row(eos=1, output=[], ignore_eos=True, **r))[0] == 1  # EOS not special


def draws(logits, n=300, **kw):
    s = Sampler(seed=0)
    t = torch.tensor([logits] * n, dtype=torch.float32)
    return set(s(t, [row(**kw)] * n)[0])


def test_top_k_top_p_min_p_restrict_the_candidates():
    logits = [math.log(p) for p in (0.5, 0.3, 0.15, 0.05)]
    assert draws(logits, temperature=1.0) == {0, 1, 2, 3}
    assert draws(logits, temperature=1.0, top_k=2) == {0, 1}
    assert draws(logits, temperature=1.0, top_p=0.8) == {0, 1}       # 0.5 + 0.3 reaches 0.8
    assert draws(logits, temperature=1.0, top_p=0.81) == {0, 1, 2}
    assert draws(logits, temperature=1.0, min_p=0.5) == {0, 1}       # p >= 0.25
    assert draws(logits, temperature=1.0, top_p=0.01) == {0}         # the top token always stays


def test_min_p_comes_before_top_p_as_in_vllm_v1():
    """vLLM V1 applies min_p, then top-k/top-p to what is left: min_p 0.3 drops the two 0.1s
    (below 0.3 x 0.5), leaving 0.625 / 0.375, and top_p 0.6 then keeps the first token alone.
    Applied after top_p (on 0.5 / 0.3 / ...), the second token stayed too."""
    logits = [math.log(p) for p in (0.5, 0.3, 0.1, 0.1)]
    assert draws(logits, temperature=1.0, min_p=0.3, top_p=0.6) == {0}
    assert draws(logits, temperature=1.0, min_p=0.3) == {0, 1}



def test_top_k_past_the_vocabulary_keeps_every_token_up_to_int64_max():
    """top_k accepts any int64; past the vocabulary it means every token, as vLLM's does. Sent
    to the device as a float64, 2**63 - 1 rounded to 2**63 and turned into int64's minimum,
    which dropped every token: the NaN row then always gave token 0."""
    logits = torch.tensor([[math.log(p) for p in (0.05, 0.3, 0.15, 0.5)]] * 200)
    seeded = [dict(temperature=1.0, seed=5, output=[0] * k) for k in range(200)]
    off = Sampler()(logits, [row(**kw) for kw in seeded])[0]
    assert set(off) == {0, 1, 2, 3}
    for k in (4, 5, 2 ** 53 + 1, 2 ** 63 - 1):
        assert Sampler()(logits, [row(top_k=k, **kw) for kw in seeded])[0] == off, k


def test_a_tiny_temperature_samples_as_vllm_does_never_a_nan_row():
    """Temperatures in (0, 0.01) are raised to 0.01, as vLLM does: below about 1e-37 the scaled
    logits overflowed float32 (or the temperature itself rounded to 0), the row became NaN and
    every draw was token 0 whatever the model said."""
    logits = torch.tensor([[math.log(p) for p in (0.05, 0.3, 0.15, 0.5)]] * 200)
    logits[:, 2] = 30.0                               # a large logit, as real models give
    seeded = [dict(seed=5, output=[0] * k) for k in range(200)]
    at_floor = Sampler()(logits, [row(temperature=0.01, **kw) for kw in seeded])[0]
    assert set(at_floor) == {2}
    for t in (0.005, 1e-30, 1e-40, 1e-45):
        assert Sampler()(logits, [row(temperature=t, **kw) for kw in seeded])[0] == at_floor, t


def test_top_p_1_keeps_the_tail_a_seeded_draw_needs_whatever_the_batch():
    """top_p = 1.0 drops nothing, as in vLLM. The float32 cumulative sum over a 49152-token
    vocabulary reached 1.0 before its tail, so a row that went through top-k/top-p (its own
    top_k, or another row's top_p in the batch) lost ~3000 tail tokens: seed 3 at output
    position 11851 draws tail token 18295 alone, and drew another one next to a top_p row."""
    vocab, d = 49152, 5e-8
    p = torch.full((vocab,), d, dtype=torch.float64)
    p[0] = 1 - (vocab - 1) * d
    logits = p.log().float().expand(2, vocab).contiguous()
    seeded = dict(temperature=1.0, seed=3, output=[0] * 11851)
    assert Sampler()(logits[:1], [row(**seeded)])[0] == [18295]
    assert Sampler()(logits, [row(**seeded), row(temperature=1.0, top_p=0.5)])[0][0] == 18295
    assert Sampler()(logits[:1], [row(top_k=vocab, **seeded)])[0] == [18295]

def test_seeded_draws_do_not_depend_on_the_batch():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    seeded = row(temperature=1.0, seed=1234, output=[1, 2])
    alone = Sampler(seed=0)(logits[:1], [seeded])[0]
    others = [row(temperature=0.7), row(temperature=1.0, seed=7), row(temperature=0)] + [row()] * 2
    batched = Sampler(seed=99)(logits, [seeded] + others)[0]
    assert batched[0] == alone[0]
    # a different output position or sample index draws differently (per-step, per-sample seeds)
    assert {Sampler()(logits[:1], [row(temperature=1.0, seed=1234, output=[1] * k, index=i)])[0][0]
            for k in range(4) for i in range(4)} != {alone[0]}


def test_logprobs_are_the_models_log_softmax_with_rank():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    (tok,), (lp,) = Sampler()(logits, [row(temperature=0, logprobs=2)])
    ref = logits.log_softmax(-1)[0]
    assert tok == 1 and lp.token_id == 1 and lp.rank == 1
    assert lp.logprob == ref[1].item()
    assert [t for t, _ in lp.top] == [1, 2]
    assert [v for _, v in lp.top] == [ref[1].item(), ref[2].item()]


def test_unseeded_draws_follow_the_distribution():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 8000
    tokens, _ = Sampler(seed=3)(p.log().expand(n, 4).contiguous(), [row(temperature=1.0)] * n)
    freq = torch.bincount(torch.tensor(tokens), minlength=4).float() / n
    # 4 standard errors of a binomial proportion at n = 8000 is at most 0.023
    assert torch.allclose(freq, p, atol=0.023), freq


def test_seeded_draws_follow_the_distribution_across_seeds_and_positions():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    rows = [row(temperature=1.0, seed=s, output=[0] * k) for s in range(400) for k in range(20)]
    tokens, _ = Sampler()(p.log().expand(len(rows), 4).contiguous(), rows)
    freq = torch.bincount(torch.tensor(tokens), minlength=4).float() / len(rows)
    assert torch.allclose(freq, p, atol=0.023), freq


def test_penalties_apply_per_row_in_one_batch():
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0]] * 3)
    rows = [row(temperature=0, output=[0], presence_penalty=0.5),
            row(temperature=0, output=[0]),                        # no penalty: keeps token 0
            row(temperature=0, prompt=[0], repetition_penalty=2.0)]
    assert Sampler()(logits, rows)[0] == [1, 0, 1]


def test_min_tokens_builds_a_requests_banned_ids_once_not_every_step():
    """A request listing many stop ids costs its index tensor once: later steps reuse it, and
    it is dropped once the request is past min_tokens."""
    params = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=list(range(1, 100)))
    s = Sampler()
    logits = torch.zeros(2, 128)
    logits[:, 5] = 1.0                                            # a stop id is the favourite
    other = SampleRow(SamplingParams(temperature=0), [9], [], 0, None)
    assert s(logits, [SampleRow(params, [9], [], 0, 127), other])[0] == [0, 5]
    built = s._banned[id(params)][2]
    assert s(logits, [SampleRow(params, [9], [0], 0, 127), other])[0] == [0, 5]
    assert s._banned[id(params)][2] is built                      # reused, not rebuilt
    assert s(logits[:1], [SampleRow(params, [9], [0, 0, 0], 0, 127)])[0] == [5]
    assert s._banned == {}                                        # past min_tokens: let go


def test_stop_token_ids_are_a_set_as_well():
    import dataclasses
    params = SamplingParams(stop_token_ids=[7, 3, 7])
    assert params.stop_token_set == frozenset({3, 7}) and params.stop_token_ids == (7, 3, 7)
    assert dataclasses.replace(params, stop_token_ids=(1,)).stop_token_set == frozenset({1})
    assert params == SamplingParams(stop_token_ids=[7, 3, 7])
