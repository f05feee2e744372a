"""Continuous batching: token budget, chunked prefill, mixed steps, preemption, abort, refusal."""
import random

import pytest

from raypaged.core.request import RequestStatus
from raypaged.core.sampling_params import SamplingParams
from raypaged.core.scheduling_policy import FIRST_RULES, FITS, SchedulingPolicy

from core_engine import make_engine, run_to_completion
from fake_runner import next_token


def sp(max_tokens=8, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


def test_long_prompt_is_prefilled_in_budget_sized_chunks():
    eng = make_engine(num_blocks=300, block_size=16, max_num_batched_tokens=256)
    eng.add_request("long", list(range(1000)), sp(2))
    run_to_completion(eng)
    steps = [b.requests[0] for b in eng.runner.batches]
    assert [len(s.token_ids) for s in steps] == [256, 256, 256, 232, 1]
    assert [s.start_position for s in steps] == [0, 256, 512, 768, 1000]
    assert [s.num_samples for s in steps] == [0, 0, 0, 1, 1]  # only the last chunk samples


def batch_tokens(batch) -> int:
    return sum(len(r.token_ids) for r in batch.requests)


def test_token_budget_is_never_exceeded():
    rng = random.Random(0)
    eng = make_engine(num_blocks=400, block_size=8, max_num_batched_tokens=64)
    for i in range(30):
        eng.add_request(f"r{i}", [rng.randrange(1000) for _ in range(rng.randint(1, 150))],
                        sp(rng.randint(1, 20)))
    run_to_completion(eng)
    assert max(batch_tokens(b) for b in eng.runner.batches) == 64
    assert all(batch_tokens(b) <= 64 for b in eng.runner.batches)


def test_decode_and_prefill_share_a_step():
    eng = make_engine()
    eng.add_request("a", list(range(5)), sp(4))
    eng.step()
    eng.add_request("b", list(range(100, 110)), sp(4))
    eng.step()
    both = eng.runner.batches[-1].requests
    assert [(r.request_id, len(r.token_ids)) for r in both] == [("a", 1), ("b", 10)]


def test_max_num_seqs_caps_the_running_set():
    eng = make_engine(max_num_seqs=2)
    for i in range(3):
        eng.add_request(f"r{i}", [i, i + 1], sp(3))
    eng.step()
    assert [r.request_id for r in eng.runner.batches[0].requests] == ["r0", "r1"]
    run_to_completion(eng)


def workload(seed=3, n=8):
    rng = random.Random(seed)
    return [(f"r{i}", [rng.randrange(50) for _ in range(rng.randint(5, 30))], rng.randint(5, 20))
            for i in range(n)]


def outputs(eng, reqs):
    for rid, prompt, max_tokens in reqs:
        eng.add_request(rid, prompt, sp(max_tokens))
    return run_to_completion(eng)


# Admitting what fits makes the tiny pool preempt (headroom admission would not: see
# test_scheduling_policy.py); both victim rules must give the same tokens.
@pytest.mark.parametrize("policy", [FIRST_RULES, SchedulingPolicy(admission_policy=FITS)],
                         ids=["newest", "bounded"])
def test_preemption_under_a_tiny_pool_gives_the_same_outputs(policy):
    reqs = workload()
    big = make_engine(num_blocks=512, block_size=4)
    tiny = make_engine(num_blocks=14, block_size=4, policy=policy)  # 56 tokens; one needs up to 50
    want = outputs(big, reqs)
    got = outputs(tiny, reqs)
    assert tiny.stats().num_preemptions > 0
    assert big.stats().num_preemptions == 0
    assert got == want
    assert sorted(got) == sorted(r[0] for r in reqs)  # every request finished exactly once
    assert tiny.scheduler.kv.pool.num_free == 14


def test_preempted_request_goes_back_to_the_head_of_the_queue():
    eng = make_engine(num_blocks=6, block_size=4, max_num_batched_tokens=64, policy=FIRST_RULES)
    eng.add_request("old", list(range(8)), sp(12))   # grows to 20 tokens = 5 blocks
    eng.add_request("new", list(range(50, 58)), sp(12))
    eng.add_request("later", list(range(200, 209)), sp(1))  # 3 blocks: waits behind the others
    while eng.stats().num_preemptions == 0:
        eng.step()
    sched = eng.scheduler
    assert [r.request_id for r in sched.running] == ["old"]
    assert [r.request_id for r in sched.waiting] == ["new", "later"]
    assert sched.requests["new"].status is RequestStatus.PREEMPTED
    assert sched.requests["new"].num_computed_tokens == 0
    # queued work: all of "new" again (recompute), all of "later", the decode token of "old"
    assert sched.num_queued_tokens == sched.requests["new"].num_tokens + 9 + 1
    run_to_completion(eng)
    assert sched.num_queued_tokens == 0


@pytest.mark.parametrize("state", ["waiting", "running", "preempted"])
def test_abort_frees_everything_in_any_state(state):
    eng = make_engine(num_blocks=6, block_size=4, policy=FIRST_RULES)  # "preempted" needs one
    eng.add_request("old", list(range(8)), sp(12))
    eng.add_request("victim", list(range(50, 58)), sp(12))
    if state == "running":
        eng.step()
        assert eng.scheduler.requests["victim"].status is RequestStatus.RUNNING
    if state == "preempted":
        while eng.stats().num_preemptions == 0:
            eng.step()
        assert eng.scheduler.requests["victim"].status is RequestStatus.PREEMPTED
    deltas = eng.abort("victim")
    assert [(d.request_id, d.finish_reason) for d in deltas] == [("victim", "abort")]
    assert "victim" not in eng.scheduler.requests
    assert "victim" not in eng.scheduler.kv.tables
    assert eng.abort("victim") == []  # aborting twice is harmless
    run_to_completion(eng)
    assert eng.scheduler.kv.pool.num_free == 6


def test_abort_of_a_forked_request_aborts_every_sample():
    eng = make_engine()
    eng.add_request("r", list(range(6)), SamplingParams(n=3, temperature=1, max_tokens=9))
    eng.step()
    assert sorted(d.request_id for d in eng.abort("r")) == ["r", "r#1", "r#2"]
    assert not eng.has_unfinished() and eng.scheduler.kv.pool.num_free == 64


def test_request_that_can_never_fit_is_refused_with_what_fits():
    eng = make_engine(num_blocks=4, block_size=4, max_model_len=100)
    with pytest.raises(ValueError, match=r"needs 5 KV blocks \(20 tokens\).*pool has 4 \(16 tokens\)"):
        eng.add_request("big", list(range(12)), sp(8))
    with pytest.raises(ValueError, match=r"maximum context length is 100 tokens.*needs 108 \(95 in the prompt, 13"):
        eng.add_request("long", list(range(95)), sp(13))
    with pytest.raises(ValueError, match="max_model_len is 100"):
        eng.add_request("long", list(range(100)), SamplingParams(max_tokens=None))
    eng.add_request("ok", list(range(8)), sp(8))  # the refusals left nothing behind
    assert list(run_to_completion(eng)) == ["ok"]


@pytest.mark.parametrize("overlap", [False, True])
def test_a_request_that_fits_the_pool_exactly_is_served_one_token_more_is_refused(overlap):
    """A sequence holds the KV of every token but its last sampled one (that one is never fed
    back): 9 prompt + 8 output tokens need 16 slots, all 4 blocks of 4; 9 + 9 need 17."""
    eng = make_engine(num_blocks=4, block_size=4, max_model_len=100, overlap=overlap)
    with pytest.raises(ValueError, match=r"needs 5 KV blocks \(18 tokens\).*pool has 4 \(16 "
                                         r"tokens\): keep prompt \+ max_tokens <= 17 "):
        eng.add_request("one_more", list(range(9)), sp(9))
    eng.add_request("exact", list(range(9)), sp(8))
    out = run_to_completion(eng, max_steps=50)
    assert len(out["exact"]) == 8 and eng.scheduler.kv.pool.num_free == 4


def test_request_with_more_samples_than_max_num_seqs_is_refused_not_queued_forever():
    """n samples need n seats at once: with n > max_num_seqs the request could never be
    admitted, and as the head of the FCFS queue it would hold back everyone behind it."""
    eng = make_engine(max_num_seqs=2)
    with pytest.raises(ValueError, match=r"n = 3 samples but max_num_seqs is 2"):
        eng.add_request("wide", [1, 2, 3], SamplingParams(n=3, temperature=1, max_tokens=2))
    assert not eng.scheduler.requests and not eng.scheduler.waiting
    eng.add_request("pair", [1, 2, 3], SamplingParams(n=2, temperature=1, max_tokens=2))
    eng.add_request("after", [4, 5], sp(2))
    assert sorted(run_to_completion(eng)) == ["after", "pair", "pair#1"]


def test_an_abort_while_only_held_requests_remain_still_reaches_the_runner():
    """A step with nothing to run (only a request whose grammar still compiles: Engine.step
    calls core.step() then too) runs no batch: the aborted id must ride on the next one that
    does, or the runner keeps the aborted request's state (its block-table row) for ever."""
    eng = make_engine()
    eng.add_request("a", [1, 2, 3], sp(8))
    eng.add_request("g", [4, 5, 6], sp(2), held=True)
    eng.step()
    eng.abort("a")
    assert eng.step() == []  # only "g", held: no batch runs
    eng.release("g")
    run_to_completion(eng)
    batches = eng.runner.batches
    assert [[r.request_id for r in b.requests] for b in batches] == [["a"], ["g"], ["g"]]
    assert [sorted(b.finished_request_ids) for b in batches] == [[], ["a"], []]


def test_duplicate_request_id_is_refused():
    eng = make_engine()
    eng.add_request("x", [1, 2], sp())
    with pytest.raises(ValueError, match="'x' is already in use"):
        eng.add_request("x", [3], sp())


def expected(prompt, k):
    seq, out = list(prompt), []
    for _ in range(k):
        out.append(next_token(seq))
        seq.append(out[-1])
    return out


def test_stop_conditions():
    prompt = [3, 1, 4, 1, 5]
    ref = expected(prompt, 10)
    eng = make_engine()
    eng.add_request("eos", prompt, sp(10), eos_token_id=ref[2])
    eng.add_request("stop_id", prompt, sp(10, stop_token_ids=[ref[3]]))
    eng.add_request("min", prompt, sp(10, min_tokens=3), eos_token_id=ref[2])
    eng.add_request("ignore", prompt, sp(10, ignore_eos=True), eos_token_id=ref[2])
    eng.add_request("len", prompt, sp(4))
    finals = {}
    out = {}
    while eng.has_unfinished():
        for d in eng.step():
            out.setdefault(d.request_id, []).extend(d.new_token_ids)
            if d.finished:
                finals[d.request_id] = (d.finish_reason, d.stop_reason)
    assert out["eos"] == ref[:3] and finals["eos"] == ("stop", None)
    assert out["stop_id"] == ref[:4] and finals["stop_id"] == ("stop", ref[3])
    # min_tokens=3: the EOS at output 3 does not stop it; the next EOS (output 6) does.
    assert ref[5] == ref[2]
    assert out["min"] == ref[:6] and finals["min"] == ("stop", None)
    assert out["ignore"] == ref[:10] and finals["ignore"] == ("length", None)
    assert out["len"] == ref[:4] and finals["len"] == ("length", None)


def test_generation_stops_at_max_model_len():
    eng = make_engine(max_model_len=12)
    eng.add_request("r", list(range(5)), SamplingParams(temperature=0, max_tokens=None))
    out = run_to_completion(eng)
    assert len(out["r"]) == 7


def test_queued_tokens_count_what_is_admitted_but_not_computed():
    from core_engine import make_engine
    from raypaged.core.sampling_params import SamplingParams

    engine = make_engine(num_blocks=64, block_size=4, max_num_batched_tokens=10)
    engine.add_request("a", list(range(1, 13)), SamplingParams(max_tokens=3, temperature=0))
    engine.add_request("b", list(range(20, 26)), SamplingParams(max_tokens=3, temperature=0))
    assert engine.stats().num_queued_tokens == 12 + 6
    engine.step()  # 10 tokens of "a" (the budget)
    assert engine.stats().num_queued_tokens == 2 + 6
    engine.step()  # the rest of "a" (2, it samples) and 6 of "b" (it samples)
    assert engine.stats().num_queued_tokens == 1 + 1  # each feeds its sampled token next
