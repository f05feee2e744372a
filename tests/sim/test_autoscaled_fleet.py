"""The autoscaled simulated fleet: the serving policy grows it under a queue (new workers serve
only after their cold start) and drains it back when the load goes; worker-seconds count every
worker from spawn to leaving."""
import pytest

from raypaged.core.autoscale_policy import ScalePolicy
from benchmarks.sim.autoscaled import AutoscaledFleet
from benchmarks.sim.cost_model import LinearCost
from benchmarks.sim.policies import make_policy
from benchmarks.sim.trace import SimRequest
from benchmarks.sim.worker import EngineShape, SimWorker

# one 100-token prompt per step (token budget 100), 10 ms a token: a prefill step is 1 s
SHAPE = EngineShape(num_blocks=256, block_size=16, max_model_len=1024,
                    max_num_batched_tokens=100)
COST = LinearCost("test", per_step=0.0, per_token=0.01, per_seq=0.0, per_kv=0.0)
SCALE = ScalePolicy(1, 3, target_wait_s=2.0, scale_in_load=0.5, window_s=10.0,
                    out_cooldown_s=2.0, in_cooldown_s=10.0)


def fleet(scale=SCALE, cold_start_s=5.0):
    return AutoscaledFleet(lambda wid: SimWorker(wid, SHAPE, COST),
                           make_policy("round_robin", 16), scale, cold_start_s)


def burst(n, at=0.0):
    return [SimRequest(at, 100, 1, lambda k=k: [k + 3] * 100) for k in range(n)]



def test_a_fixed_fleet_counts_its_workers_for_the_whole_run():
    run = fleet(ScalePolicy(2, 2)).run(burst(4))
    assert run.decisions == []
    # round robin: 2 prompts per worker, 1 s each -> the last first token at 2 s
    assert sorted(run.ttft_s) == pytest.approx([1.0, 1.0, 2.0, 2.0])
    assert run.worker_seconds == pytest.approx(2 * run.sim_seconds)


def steady(n, every_s, start=0.0):
    return [SimRequest(start + k * every_s, 100, 1, lambda k=k: [k + 3] * 100) for k in range(n)]


def test_a_queue_scales_out_after_the_cold_start_and_back_in_when_idle():
    # 2 prompts a second for 20 s against 1 a second per worker, then one late request
    requests = steady(40, 0.5) + steady(1, 1, start=120.0)
    run = fleet().run(requests)
    outs = [d for d in run.decisions if d[2] > d[1]]
    ins = [d for d in run.decisions if d[2] < d[1]]
    assert outs and all(reason == "queue_wait" for *_, reason in outs)
    assert max(n for _, n in run.timeline) == 3
    assert ins and all(reason == "low_load" for *_, reason in ins)
    assert run.timeline[-1][1] == 1  # drained back to min_workers before the late request
    # one worker alone: the queue grows all along, the 40th prompt waits 20.5 s; autoscaled, the
    # prompts queued on the first worker before the others joined wait 10.5 s at most
    alone = fleet(ScalePolicy(1, 1)).run(requests)
    assert max(alone.ttft_s) == pytest.approx(20.5)
    assert max(run.ttft_s) == pytest.approx(10.5)
    assert alone.worker_seconds == pytest.approx(alone.sim_seconds)
    assert run.worker_seconds < 3 * run.sim_seconds
