"""The autoscaling policy on constructed load samples: out, in, hold, cool-downs and bounds."""
import math

import pytest

from raypaged.core.autoscale_policy import (LOW_LOAD, MAX_WORKERS, MIN_WORKERS, PREEMPTIONS,
                                            QUEUE_WAIT, CapacityMeter, Decision, LoadSample,
                                            ScaleHistory, ScalePolicy, decide, remember,
                                            saturated_rate)

POLICY = ScalePolicy(min_workers=1, max_workers=4, target_wait_s=2.0, scale_in_load=0.5,
                     window_s=10.0, out_cooldown_s=5.0, in_cooldown_s=20.0)
CAP = 1000.0  # one worker's tokens per second


def samples(serving, queued=(), computed=0, preemptions=0, t_end=100.0, n=20, **kw):
    """n samples 1 s apart ending at t_end; `queued` gives the last ones' queued tokens."""
    out = []
    for k in range(n):
        q = queued[k - n + len(queued)] if k >= n - len(queued) else 0
        out.append(LoadSample(time_s=t_end - (n - 1 - k), interval_s=1.0, serving=serving,
                              queued_tokens=q, computed_tokens=computed,
                              preemptions=preemptions, capacity_tokens_per_s=CAP, **kw))
    return out


def test_wait_is_queued_tokens_over_the_serving_workers_capacity():
    s = LoadSample(0.0, 1.0, serving=2, queued_tokens=5000, capacity_tokens_per_s=CAP)
    assert s.wait_s == 2.5
    assert LoadSample(0.0, 1.0, serving=2, queued_tokens=5000).wait_s == 0.0  # unmeasured


def test_scales_out_by_the_factor_the_wait_is_over_target():
    # 1 worker, 5000 tokens queued: 5 s wait, 2.5x the target -> capped at doubling: 2
    d = decide(POLICY, 1, samples(1, queued=(5000, 5000)), ScaleHistory(), 100.0)
    assert d == Decision(2, QUEUE_WAIT, True)
    # 2 workers, 6000 queued: 3 s, 1.5x -> ceil(3) = 3 workers
    d = decide(POLICY, 2, samples(2, queued=(6000, 6000)), ScaleHistory(), 100.0)
    assert d == Decision(3, QUEUE_WAIT, True)
    # 3 workers, 13000 queued: 4.33 s -> doubling would be 6, max_workers is 4
    d = decide(POLICY, 3, samples(3, queued=(13000, 13000)), ScaleHistory(), 100.0)
    assert d == Decision(4, QUEUE_WAIT, True)


def test_one_poll_over_target_is_not_enough():
    d = decide(POLICY, 1, samples(1, queued=(0, 5000)), ScaleHistory(), 100.0)
    assert d.desired == 1 and not d.changed


def test_preemptions_at_two_polls_in_a_row_scale_out_by_one():
    d = decide(POLICY, 2, samples(2, preemptions=1), ScaleHistory(), 100.0)
    assert d == Decision(3, PREEMPTIONS, True)


def test_never_above_max_workers():
    d = decide(POLICY, 4, samples(4, queued=(90000, 90000)), ScaleHistory(), 100.0)
    assert d == Decision(4, "at max_workers", False)
    assert decide(POLICY, 6, samples(6), ScaleHistory(), 100.0) == Decision(4, MAX_WORKERS, True)


def test_never_below_min_workers():
    quiet = samples(1, computed=0)
    assert decide(POLICY, 1, quiet, ScaleHistory(), 100.0) == Decision(1, "hold", False)
    assert decide(POLICY, 0, quiet, ScaleHistory(), 100.0) == Decision(1, MIN_WORKERS, True)


def test_out_cooldown_after_a_scale_out_and_after_a_worker_joined():
    busy = samples(2, queued=(9000, 9000))
    assert decide(POLICY, 2, busy, ScaleHistory(last_out_s=96.0), 100.0).reason == "out cooldown"
    assert decide(POLICY, 2, busy, ScaleHistory(last_out_s=95.0), 100.0).changed
    # a worker was still starting at t=97 (joined since): 3 s ago < 5 s
    joined = [s if s.time_s != 97.0 else LoadSample(97.0, 1.0, 2, starting=1) for s in busy]
    assert decide(POLICY, 2, joined, ScaleHistory(), 100.0).reason == "out cooldown"


def test_holds_while_a_worker_starts_or_drains():
    busy = samples(2, queued=(9000, 9000))
    starting = busy[:-1] + [LoadSample(100.0, 1.0, 2, starting=1, queued_tokens=9000,
                                       capacity_tokens_per_s=CAP)]
    assert decide(POLICY, 3, starting, ScaleHistory(), 100.0) == Decision(3, "starting", False)
    draining = samples(2, draining=1)
    assert decide(POLICY, 2, draining, ScaleHistory(), 100.0) == Decision(2, "draining", False)


def test_scales_in_when_the_window_fits_in_one_worker_fewer_with_headroom():
    # 3 workers, demand 1000 tok/s: 2 workers at 0.5 x 1000 carry exactly 1000 -> one leaves
    assert decide(POLICY, 3, samples(3, computed=1000), ScaleHistory(), 100.0) == Decision(
        2, LOW_LOAD, True)
    # 1001 tok/s does not fit
    d = decide(POLICY, 3, samples(3, computed=1001), ScaleHistory(), 100.0)
    assert d == Decision(3, "hold", False)


def test_no_scale_in_after_a_preemption_or_a_long_wait_in_the_window():
    window = samples(3, computed=100)
    window[12] = LoadSample(window[12].time_s, 1.0, 3, preemptions=1, capacity_tokens_per_s=CAP)
    assert not decide(POLICY, 3, window, ScaleHistory(), 100.0).changed
    window = samples(3, computed=100)
    window[12] = LoadSample(window[12].time_s, 1.0, 3, queued_tokens=3001,  # 1.0003 s > 1 s
                            capacity_tokens_per_s=CAP)
    assert not decide(POLICY, 3, window, ScaleHistory(), 100.0).changed
    window[12] = LoadSample(window[12].time_s, 1.0, 3, queued_tokens=3000,
                            capacity_tokens_per_s=CAP)
    assert decide(POLICY, 3, window, ScaleHistory(), 100.0).changed


def test_in_cooldown_after_any_change_and_a_full_window_of_history():
    quiet = samples(3, computed=0)
    assert decide(POLICY, 3, quiet, ScaleHistory(-math.inf, 81.0), 100.0).reason == "in cooldown"
    assert decide(POLICY, 3, quiet, ScaleHistory(-math.inf, 80.0), 100.0).changed
    assert decide(POLICY, 3, quiet[-8:], ScaleHistory(), 100.0).reason == "short history"


def test_no_scale_in_before_capacity_is_measured():
    quiet = [LoadSample(s.time_s, 1.0, 3) for s in samples(3)]
    assert decide(POLICY, 3, quiet, ScaleHistory(), 100.0) == Decision(3, "hold", False)


def test_the_history_remembers_changes_only():
    h = ScaleHistory()
    assert remember(h, Decision(2, "hold", False), 2, 50.0) == h
    assert remember(h, Decision(3, QUEUE_WAIT, True), 2, 50.0) == ScaleHistory(50.0, 50.0)
    assert remember(ScaleHistory(50.0, 50.0), Decision(2, LOW_LOAD, True), 3,
                    90.0) == ScaleHistory(50.0, 90.0)


def test_a_flapping_load_does_not_flap_the_fleet():
    """Load alternating over and under the target each poll: never two polls over in a row."""
    seq = [LoadSample(float(t), 1.0, 2, queued_tokens=9000 if t % 2 else 0, computed_tokens=500,
                      capacity_tokens_per_s=CAP) for t in range(100)]
    desired, history = 2, ScaleHistory()
    for t in range(2, 100):
        d = decide(POLICY, desired, seq[:t], history, float(t - 1))
        history = remember(history, d, desired, float(t - 1))
        desired = d.desired
    assert desired == 2


def test_capacity_is_measured_only_over_saturated_intervals():
    assert saturated_rate(queued_before=500, computed=400, interval_s=0.5) == 800.0
    assert saturated_rate(queued_before=300, computed=400, interval_s=0.5) is None  # went idle
    assert saturated_rate(queued_before=500, computed=0, interval_s=0.5) is None
    meter = CapacityMeter(alpha=0.5)
    meter.observe(500, 400, 0.5)
    meter.observe(10, 400, 0.5)   # not saturated: ignored
    meter.observe(900, 600, 0.5)  # 1200 tok/s
    assert meter.tokens_per_s == 1000.0


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError, match="min_workers <= max_workers"):
        ScalePolicy(min_workers=3, max_workers=2)


def test_prompts_the_routers_hold_back_count_as_queued():
    """Fair admission keeps a flood at the routers until the fleet has room: the workers'
    queues stay short while the demand waits. The held prompt tokens count as queued, so the
    fleet scales out (with only the workers' queues it never did)."""
    from raypaged.core.autoscale_policy import ScaleRound, WorkerCounters

    scale = ScaleRound(POLICY, desired=1)
    scale.capacity.tokens_per_s = CAP  # measured earlier
    busy = {"w0": WorkerCounters(computed_tokens=0, preemptions=0, queued_tokens=100)}
    scale.sample(0.0, 1.0, busy, serving=1, starting=0, draining=0)  # w0's counters start
    for t in (1.0, 2.0):
        busy = {"w0": WorkerCounters(busy["w0"].computed_tokens + 900, 0, 100)}
        sample = scale.sample(t, 1.0, busy, serving=1, starting=0, draining=0,
                              held_tokens=4900)
        assert sample.queued_tokens == 5000 and sample.wait_s == 5.0
        before, decision = scale.decide(sample)
    assert (before, decision) == (1, Decision(2, QUEUE_WAIT, True))

    quiet = ScaleRound(POLICY, desired=1)
    quiet.capacity.tokens_per_s = CAP
    quiet.sample(0.0, 1.0, busy, serving=1, starting=0, draining=0)
    for t in (1.0, 2.0):
        sample = quiet.sample(t, 1.0, busy, serving=1, starting=0, draining=0)
        assert sample.wait_s == 0.1
        assert quiet.decide(sample)[1].changed is False


def test_a_worker_new_to_the_round_counts_its_queue_at_once():
    """Only its counters (computed tokens, preemptions) start afresh with a worker that joined
    or restarted; its queue is a level, and it waits on a serving worker now: left out, the
    wait was under-read for a poll after every join or restart (and, after a controller restart
    that adopts a loaded fleet, every worker's queue was left out of the first sample)."""
    from raypaged.core.autoscale_policy import ScaleRound, WorkerCounters

    scale = ScaleRound(POLICY, desired=2)
    scale.capacity.tokens_per_s = CAP
    scale.sample(0.0, 1.0, {"w0": WorkerCounters(0, 0, 100, incarnation="a")},
                 serving=1, starting=1, draining=0)
    sample = scale.sample(1.0, 1.0, {"w0": WorkerCounters(500, 0, 100, incarnation="a"),
                                     "w1": WorkerCounters(0, 0, 3900, incarnation="b")},
                          serving=2, starting=0, draining=0)
    assert (sample.queued_tokens, sample.computed_tokens, sample.wait_s) == (4000, 500, 2.0)
    restarted = scale.sample(2.0, 1.0, {"w0": WorkerCounters(0, 0, 1000, incarnation="c"),
                                        "w1": WorkerCounters(700, 0, 3000, incarnation="b")},
                             serving=2, starting=0, draining=0)
    assert (restarted.queued_tokens, restarted.computed_tokens) == (4000, 700)
