"""The cost models: step shapes from real batches, the roofline's regimes, the CPU fit."""
import json
from pathlib import Path

import pytest

from raypaged.core.scheduler import Scheduler
from raypaged.core.request import Request
from raypaged.core.sampling_params import SamplingParams
from raypaged.sim.calibration import fit_linear, forward_step_points
from raypaged.sim.cost_model import CPU_SMOLLM2_135M, H100_LLAMA3_8B, LinearCost, step_shape

ROOT = Path(__file__).resolve().parents[2]


def test_a_step_shape_counts_new_tokens_sequences_and_the_context_read():
    sched = Scheduler(num_blocks=32, block_size=4, max_model_len=64, max_num_batched_tokens=8)
    sched.add(Request("a", [1] * 6, SamplingParams(max_tokens=4), 4))
    sched.add(Request("b", [2] * 5, SamplingParams(max_tokens=4), 4))
    shape = step_shape(sched.schedule())  # a: 6 tokens at 0; b: its first 2 (budget 8)
    assert (shape.new_tokens, shape.sequences, shape.kv_read, shape.sampled) == (8, 2, 8, 1)
    assert shape.attended_pairs == 21 + 3  # a: 1+...+6; b: 1+2


def test_the_roofline_is_memory_bound_in_decode_and_compute_bound_in_prefill():
    from raypaged.sim.cost_model import StepShape
    h = H100_LLAMA3_8B
    decode = h.seconds(StepShape(1, 1, 1000, 1000, 1))
    weights_read = 2 * 8.03e9 / (3.35e12 * 0.8)
    assert decode == pytest.approx(weights_read + 0.5e-3, rel=0.02)
    prefill = h.seconds(StepShape(8192, 1, 8192, 8192 * 8193 // 2, 1))
    assert prefill > 8192 * 2 * 7e9 / 989e12 / 0.6   # more than its linear layers' FLOPs alone
    assert h.kv_blocks(16) == int((72e9 - 2 * 8.03e9 - 2e9) // (131072 * 16))


def test_fit_linear_recovers_the_coefficients_that_made_the_points():
    truth = LinearCost("t", per_step=0.01, per_token=0.002, per_seq=0.0005, per_kv=0.0)
    from raypaged.sim.cost_model import StepShape
    points = [(n, s, 0, truth.seconds(StepShape(n, s, 0, 0, s)))
              for n, s in [(1, 1), (4, 4), (64, 64), (256, 1), (512, 2)]]
    fit = fit_linear("t", points, terms=("per_step", "per_token", "per_seq"))
    assert (fit.per_step, fit.per_token, fit.per_seq) == pytest.approx((0.01, 0.002, 0.0005))


def test_fit_linear_names_the_term_the_measurements_cannot_tell_apart():
    decode_only = [(b, b, 0, 0.01 * b) for b in (1, 4, 16)]  # tokens == sequences everywhere
    with pytest.raises(ValueError, match="per_seq"):
        fit_linear("t", decode_only, terms=("per_step", "per_token", "per_seq"))


def test_the_cpu_calibration_is_the_fit_of_the_committed_forward_step_measurements():
    data = json.loads((ROOT / "benchmarks/results/forward_step.json").read_text())
    fit = fit_linear(CPU_SMOLLM2_135M.name, forward_step_points(data),
                     terms=("per_step", "per_token", "per_seq"))
    assert fit == CPU_SMOLLM2_135M


def test_the_serving_overhead_is_what_makes_the_simulated_tpot_the_measured_one():
    from raypaged.sim.calibration import fit_serving_overhead
    forward = LinearCost("t", per_step=0.01, per_token=0.001, per_seq=0.0, per_kv=0.0)
    # a fleet whose batches grow with the step: TPOT = 1.2 x step time + 2 ms
    tpot = lambda c: 1.2 * (c.per_step + c.per_step_serving) + 0.002  # noqa: E731
    served = fit_serving_overhead(forward, tpot, real_tpot_s=0.050)
    assert served.per_step_serving == pytest.approx(0.03)      # 1.2 x 0.04 + 0.002 = 0.050
    assert (served.per_step, served.per_token) == (0.01, 0.001)
    from raypaged.sim.cost_model import StepShape
    assert served.seconds(StepShape(3, 1, 0, 0, 1)) == pytest.approx(0.01 + 0.03 + 0.003)
    # a fleet already slower in the simulator than measured: no negative overhead
    assert fit_serving_overhead(forward, tpot, real_tpot_s=0.005).per_step_serving == 0.0
