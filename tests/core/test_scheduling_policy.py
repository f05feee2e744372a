"""Admission with headroom, the bounded victim rule, FCFS resume and the preemption counters,
on pools of a few blocks, against the first rules (admit what fits, preempt the newest)."""
import random

import pytest

from raypaged.core.request import RequestStatus
from raypaged.core.sampling_params import SamplingParams
from raypaged.core.scheduling_policy import FIRST_RULES, FITS, SchedulingPolicy

from core_engine import make_engine, run_to_completion

BOUNDED_FITS = SchedulingPolicy(admission_policy=FITS)  # the new victim rule alone


def sp(max_tokens):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def first_step_of(eng, rid):
    return next(i for i, b in enumerate(eng.runner.batches)
                if any(r.request_id == rid for r in b.requests))


def two_that_cannot_both_finish(policy):
    # 8 blocks of 4 tokens; each ends holding 8 + 12 - 1 = 19 tokens of KV = 5 blocks: both fit
    # now (2 + 2 blocks), never both to the end
    eng = make_engine(num_blocks=8, block_size=4, prefix=False, policy=policy)
    eng.add_request("a", list(range(8)), sp(12))
    eng.add_request("b", list(range(100, 108)), sp(12))
    return eng


def test_headroom_admits_the_second_request_only_once_both_can_finish():
    eng = two_that_cannot_both_finish(SchedulingPolicy())
    eng.step()
    assert [r.request_id for r in eng.runner.batches[0].requests] == ["a"]
    assert eng.stats().num_blocked == 1  # b waits for blocks although 6 are free
    run_to_completion(eng)
    # admitted at step 7: a holds 15 tokens and ends at 19 (5 blocks) while b reaches 12 (3)
    assert first_step_of(eng, "b") == 7
    assert eng.stats().num_preemptions == 0
    assert eng.stats().preemption.recomputed_tokens == 0
    assert eng.stats().preemption.computed_tokens == 2 * (8 + 11)
    assert eng.stats().preemption.preempted_per_request == (2,)  # both finished, never preempted


def test_admitting_what_fits_preempts_and_recomputes_instead():
    eng = two_that_cannot_both_finish(FIRST_RULES)
    run_to_completion(eng)
    assert first_step_of(eng, "b") == 0
    stats = eng.stats()
    assert stats.num_preemptions == 1
    # b is preempted holding 16 tokens of KV (8 prompt + 8 outputs) and computes them again
    assert stats.preemption.recomputed_tokens == 16
    assert stats.preemption.computed_tokens == 2 * (8 + 11) + 16
    assert stats.preemption.preempted_per_request == (1, 1)


def test_open_max_tokens_is_projected_from_the_outputs_seen():
    # a finished with 12 outputs; c, d and e leave max_tokens open (up to the 40-token
    # context): projected at 12 outputs each, c and d fit (7 + 12 = 19 tokens, 5 blocks each)
    eng = make_engine(num_blocks=10, block_size=4, max_model_len=40, prefix=False)
    eng.add_request("a", list(range(8)), sp(12))
    run_to_completion(eng)
    eng.add_request("c", list(range(200, 208)), sp(None))
    eng.add_request("d", list(range(300, 308)), sp(None))
    eng.add_request("e", list(range(400, 408)), sp(None))
    eng.step()
    assert [r.request_id for r in eng.runner.batches[-1].requests] == ["c", "d"]
    assert eng.stats().num_blocked == 1  # e would need 5 more blocks: only 10 - 2 * 5 = 0 left


def test_watermark_keeps_blocks_free_beyond_the_projection():
    # 10 blocks, watermark 0.2 = 2 blocks: a (5 blocks at the end) + b (5) no longer fit
    policy = SchedulingPolicy(kv_watermark=0.2)
    eng = make_engine(num_blocks=10, block_size=4, prefix=False, policy=policy)
    eng.add_request("a", list(range(8)), sp(12))
    eng.add_request("b", list(range(100, 108)), sp(12))
    eng.step()
    assert [r.request_id for r in eng.runner.batches[0].requests] == ["a"]
    eng = make_engine(num_blocks=10, block_size=4, prefix=False)  # default watermark: 0 blocks
    eng.add_request("a", list(range(8)), sp(12))
    eng.add_request("b", list(range(100, 108)), sp(12))
    eng.step()
    assert [r.request_id for r in eng.runner.batches[0].requests] == ["a", "b"]


def three_running(policy):
    """a (9-token prompt), b (2), c (15) fill 8 of 9 blocks; c takes the last at step 3, and
    at step 4 b needs one more while nothing is free."""
    eng = make_engine(num_blocks=9, block_size=4, prefix=False, policy=policy)
    eng.add_request("a", list(range(9)), sp(20))
    eng.add_request("b", list(range(100, 102)), sp(20))
    eng.add_request("c", list(range(200, 215)), sp(20))
    while eng.stats().num_preemptions == 0:
        eng.step()
    return eng


def test_the_newest_request_is_the_first_rules_victim():
    eng = three_running(FIRST_RULES)
    sched = eng.scheduler
    assert len(eng.runner.batches) == 4
    assert [r.request_id for r in sched.running] == ["a", "b"]
    c = sched.requests["c"]
    assert c.status is RequestStatus.PREEMPTED and c.num_lost_tokens == 17  # its whole KV


def test_the_bounded_victim_is_the_request_with_the_least_computed_work():
    eng = three_running(BOUNDED_FITS)
    sched = eng.scheduler
    assert len(eng.runner.batches) == 4
    assert [r.request_id for r in sched.running] == ["a", "c"]
    b = sched.requests["b"]  # 4 tokens computed, against a's 12 and c's 17
    assert b.status is RequestStatus.PREEMPTED and b.num_lost_tokens == 4
    assert [r.request_id for r in sched.waiting] == ["b"]


def test_preempted_requests_resume_in_arrival_order_ahead_of_later_arrivals():
    eng = make_engine(num_blocks=9, block_size=4, prefix=False, policy=BOUNDED_FITS)
    for rid, start, prompt in (("a", 0, 9), ("b", 100, 2), ("c", 200, 15)):
        eng.add_request(rid, list(range(start, start + prompt)), sp(20))
    eng.step()
    eng.add_request("late", list(range(300, 304)), sp(4))  # admitted: 1 block still fits
    sched = eng.scheduler
    while len(sched.running) > 1:
        eng.step()
    # preempted least work first: late, then b, then c; they wait in order of arrival
    assert [r.request_id for r in sched.running] == ["a"]
    assert [r.request_id for r in sched.waiting] == ["b", "c", "late"]
    assert [sched.requests[r].num_preemptions for r in ("b", "c", "late")] == [1, 1, 1]
    run_to_completion(eng)


def random_requests(seed, n=12):
    rng = random.Random(seed)
    return [(f"r{i}", [rng.randrange(50) for _ in range(rng.randint(5, 30))], rng.randint(5, 20))
            for i in range(n)]


@pytest.mark.parametrize("policy, per_request", [
    (FIRST_RULES, (8, 3, 1)),       # the newest is preempted again: one request twice
    (BOUNDED_FITS, (8, 4)),         # a request preempted once is not chosen again
    (SchedulingPolicy(), (12,)),    # headroom admission: nobody is preempted
], ids=["first_rules", "bounded_victim", "headroom"])
def test_preemptions_per_request_under_a_tiny_pool(policy, per_request):
    eng = make_engine(num_blocks=14, block_size=4, prefix=False, policy=policy)
    for rid, prompt, max_tokens in random_requests(4):
        eng.add_request(rid, prompt, sp(max_tokens))
    run_to_completion(eng)
    stats = eng.stats()
    assert stats.preemption.preempted_per_request == per_request
    assert stats.num_preemptions == sum(k * n for k, n in enumerate(per_request))


def test_a_preempted_request_protected_after_one_preemption_is_passed_over():
    eng = three_running(BOUNDED_FITS)
    sched = eng.scheduler
    b = sched.requests["b"]
    b.num_preemptions = 1  # as if b had been preempted before: now a, b, c are candidates
    sched.waiting.remove(b)
    sched.running.append(b)  # (table already freed: b is only a candidate here)
    from raypaged.core.preemption import choose_victim
    assert choose_victim(sched.running, 1).request_id == "a"  # b protected; a less work than c
    assert choose_victim([b], 1) is b  # the only candidate is chosen even so
    sched.running.remove(b)
    sched.waiting.appendleft(b)


def test_time_preempted_is_counted_from_preemption_to_resume():
    now = [0.0]
    eng = make_engine(num_blocks=8, block_size=4, prefix=False, policy=FIRST_RULES,
                      clock=lambda: now[0])
    eng.add_request("a", list(range(8)), sp(12))
    eng.add_request("b", list(range(100, 108)), sp(12))
    while eng.stats().num_preemptions == 0:
        now[0] += 1.0
        eng.step()
    preempted_at = now[0]
    while eng.scheduler.requests["b"].status is not RequestStatus.RUNNING:
        now[0] += 1.0
        eng.step()
    assert eng.stats().preemption.preempted_seconds == now[0] - preempted_at > 0
    run_to_completion(eng)


def test_resume_recomputes_only_what_the_prefix_cache_lost():
    # prefix caching on: b's full blocks stay cached when it is preempted, and its resume hits
    # them; only the tokens past its last full block are computed again
    eng = make_engine(num_blocks=8, block_size=4, prefix=True, policy=FIRST_RULES)
    eng.add_request("a", list(range(8)), sp(12))
    eng.add_request("b", list(range(100, 108)), sp(12))
    out = run_to_completion(eng)
    stats = eng.stats()
    assert stats.num_preemptions == 1
    # lost 16 tokens (4 blocks); 3 full blocks were still cached at resume
    assert stats.preemption.recomputed_tokens == 4
    ref = two_that_cannot_both_finish(SchedulingPolicy())
    assert run_to_completion(ref) == out  # same tokens as without any preemption
