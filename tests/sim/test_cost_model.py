"""The cost models: step shapes from real batches, the roofline's regimes, the CPU fit."""
import dataclasses
import json
from pathlib import Path

import pytest

from raypaged.core.scheduler import Scheduler
from raypaged.core.request import Request
from raypaged.core.sampling_params import SamplingParams
from benchmarks.sim.calibration import fit_linear, forward_step_points
from benchmarks.sim.cost_model import CPU_SMOLLM2_135M, H100_LLAMA3_8B, LinearCost, step_shape

ROOT = Path(__file__).resolve().parents[2]


def test_a_step_shape_counts_new_tokens_sequences_and_the_context_read():
    sched = Scheduler(num_blocks=32, block_size=4, max_model_len=64, max_num_batched_tokens=8)
    sched.add(Request("a", [1] * 6, SamplingParams(max_tokens=4), 4))
    sched.add(Request("b", [2] * 5, SamplingParams(max_tokens=4), 4))
    shape = step_shape(sched.schedule())  # a: 6 tokens at 0; b: its first 2 (budget 8)
    assert (shape.new_tokens, shape.sequences, shape.kv_read, shape.sampled) == (8, 2, 8, 1)
    assert shape.attended_pairs == 21 + 3  # a: 1+...+6; b: 1+2


def test_the_roofline_is_memory_bound_in_decode_and_compute_bound_in_prefill():
    from benchmarks.sim.cost_model import StepShape
    h = H100_LLAMA3_8B
    decode = h.seconds(StepShape(1, 1, 1000, 1000, 1))
    weights_read = 2 * 8.03e9 / (3.35e12 * 0.8)
    assert decode == pytest.approx(weights_read + 0.5e-3, rel=0.02)
    prefill = h.seconds(StepShape(8192, 1, 8192, 8192 * 8193 // 2, 1))
    assert prefill > 8192 * 2 * 7e9 / 989e12 / 0.6   # more than its linear layers' FLOPs alone
    assert h.kv_blocks(16) == int((72e9 - 2 * 8.03e9 - 2e9) // (131072 * 16))


def test_fit_linear_recovers_the_coefficients_that_made_the_points():
    truth = LinearCost("t", per_step=0.01, per_token=0.002, per_seq=0.0005, per_kv=0.0)
    from benchmarks.sim.cost_model import StepShape
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
    from benchmarks.sim.calibration import fit_serving_overhead
    forward = LinearCost("t", per_step=0.01, per_token=0.001, per_seq=0.0, per_kv=0.0)
    # a fleet whose batches grow with the step: TPOT = 1.2 x step time + 2 ms
    tpot = lambda c: 1.2 * (c.per_step + c.per_step_serving) + 0.002  # noqa: E731
    served = fit_serving_overhead(forward, tpot, real_tpot_s=0.050)
    assert served.per_step_serving == pytest.approx(0.03)      # 1.2 x 0.04 + 0.002 = 0.050
    assert (served.per_step, served.per_token) == (0.01, 0.001)
    from benchmarks.sim.cost_model import StepShape
    assert served.seconds(StepShape(3, 1, 0, 0, 1)) == pytest.approx(0.01 + 0.03 + 0.003)
    # a fleet already slower in the simulator than measured: no negative overhead
    assert fit_serving_overhead(forward, tpot, real_tpot_s=0.005).per_step_serving == 0.0


def test_a_step_costs_its_attended_pairs_and_the_probe_terms_are_what_the_probe_measured():
    from benchmarks.sim.calibration import probe_terms
    from benchmarks.sim.cost_model import StepShape
    forward = LinearCost("t", per_step=0.01, per_token=0.001, per_seq=0.0005, per_kv=0.0)
    truth = dataclasses.replace(forward, per_step_serving=0.004, per_pair=2e-6, path_s=0.015)
    # a 100-token prefill attends 100 x 101 / 2 = 5,050 pairs: 10 + 4 + 100 + 0.5 + 10.1 ms
    assert truth.seconds(StepShape(100, 1, 100, 5050, 1)) == pytest.approx(0.1246)
    # an idle fleet measured exactly as the model says: the probe gives the terms back
    requests = []
    for p in (16, 64, 256, 432):
        ttft = truth.path_s + truth.seconds(StepShape(p, 1, p, p * (p + 1) // 2, 1))
        tpot = truth.seconds(StepShape(1, 1, p + 8, p + 8, 1))   # 16 output tokens: context p + 8
        requests.append({"prompt_tokens": p, "output_tokens": 16, "ttft_ms": 1000 * ttft,
                         "tpot_ms": 1000 * tpot})
    got = probe_terms(forward, {"requests": requests})
    assert (got.per_step, got.per_token, got.per_seq) == (0.01, 0.001, 0.0005)
    assert got.per_step_serving == pytest.approx(0.004)
    assert got.per_pair == pytest.approx(2e-6)
    assert got.path_s == pytest.approx(0.015)
    # a probe faster than the forward fit cannot be explained by positive terms: refused by name
    fast = [{**r, "ttft_ms": r["ttft_ms"] / 3} for r in requests]
    with pytest.raises(ValueError, match="rerun benchmarks/fleet_sim_probe.py on a quiet machine"):
        probe_terms(forward, {"requests": fast})


def test_the_committed_probe_gives_positive_terms():
    from benchmarks.sim.calibration import probe_terms
    probe = json.loads((ROOT / "benchmarks/results/fleet_sim_probe.json").read_text())
    got = probe_terms(CPU_SMOLLM2_135M, probe)
    assert got.per_step_serving > 0 and got.per_pair > 0 and got.path_s > 0


def test_the_serving_path_takes_the_free_cores_first_then_a_share_of_the_steps():
    from benchmarks.sim.cost_model import MIN_SPEED
    shared = dataclasses.replace(CPU_SMOLLM2_135M, serving_cpu_per_token=0.01, cores=2)
    # one step giving 10 tokens a second: the serving path needs 0.1 core, the free one has it
    assert shared.stretch([(10, 1.0)]) == 1.0
    # two steps: 0.2 core taken from the two step threads, 0.9 core each
    assert shared.stretch([(10, 1.0), (10, 1.0)]) == pytest.approx(1 / 0.9)
    # three steps on two cores: 2/3 each before the serving path takes anything
    assert shared.stretch([(0, 1.0)] * 3) == pytest.approx(1.5)
    # a serving path that would take every core leaves each step its kernel's turn
    assert shared.stretch([(100, 1.0), (100, 1.0)]) == pytest.approx(1 / MIN_SPEED)
    # without the terms, or on the GPU model, steps never share
    assert CPU_SMOLLM2_135M.stretch([(100, 1.0)] * 4) == 1.0
    assert not H100_LLAMA3_8B.shares_cores


def test_the_probes_loaded_phase_gives_the_serving_cpu_per_token_on_its_cores():
    from benchmarks.sim.calibration import probe_terms
    probe = json.loads((ROOT / "benchmarks/results/fleet_sim_probe_2026_11_29c.json").read_text())
    got = probe_terms(LinearCost("no forward", 0.0, 0.0, 0.0, 0.0), probe)
    loaded = probe["loaded"]
    assert got.serving_cpu_per_token == pytest.approx(
        (loaded["machine_busy_s"] - loaded["step_threads_s"]) / loaded["output_tokens"])
    assert got.cores == 2 and got.shares_cores


def test_the_loaded_phase_gives_the_step_threads_cost_per_sequence_beyond_the_fit():
    from benchmarks.sim.calibration import loaded_step_residual, probe_terms
    from benchmarks.sim.cost_model import StepShape
    forward = LinearCost("t", per_step=0.01, per_token=0.001, per_seq=0.0005, per_kv=0.0)
    truth = dataclasses.replace(forward, per_step_serving=0.004, per_pair=2e-6, path_s=0.015)
    extra = 0.0003  # per sequence of a step, on the step thread: what the idle probe cannot see
    idle = []
    for p in (16, 64, 256, 432):
        ttft = truth.path_s + truth.seconds(StepShape(p, 1, p, p * (p + 1) // 2, 1)) + extra
        tpot = truth.seconds(StepShape(1, 1, p + 8, p + 8, 1)) + extra
        idle.append({"prompt_tokens": p, "output_tokens": 16, "ttft_ms": 1000 * ttft,
                     "tpot_ms": 1000 * tpot})
    # loaded: two requests of 16 and 100 prompt tokens, 4 output tokens each, run two at a time
    # (a prefill step of both, then 3 decode steps of both reading p + 1, p + 2, p + 3)
    shapes = [StepShape(116, 2, 116, 136 + 5050, 2)]
    shapes += [StepShape(2, 2, 116 + 2 * k, 116 + 2 * k, 2) for k in (1, 2, 3)]
    spent = sum(truth.seconds(s) + extra * s.sequences for s in shapes)
    loaded = {"engine_steps": 4, "prompt_tokens": [16, 100], "output_tokens": 8,
              "step_threads_s": spent, "serving_cpu_ms_per_token": 2.0, "cores": 2}
    # the idle probe folds one sequence's extra into its per-step term; the loaded phase,
    # two sequences a step, tells the rest apart
    got = probe_terms(forward, {"requests": idle, "loaded": loaded})
    assert got.per_seq_serving == pytest.approx(extra)
    assert got.per_step_serving == pytest.approx(truth.per_step_serving)
    assert got.per_pair == pytest.approx(truth.per_pair)
    residual = loaded_step_residual(dataclasses.replace(
        got, per_step_serving=got.per_step_serving + extra), loaded)
    assert (residual["steps"], residual["seq_steps"]) == (4, 8)
    assert residual["per_seq_s"] == pytest.approx(extra)
    # a step of one sequence costs what the idle probe measured; each further one `extra`
    one = StepShape(1, 1, 20, 20, 1)
    assert got.seconds(one) == pytest.approx(truth.seconds(one) + extra)


def test_the_probes_two_loaded_phases_tell_the_serving_cpu_per_step_from_per_token():
    from benchmarks.sim.calibration import serving_cpu_terms
    per_step, per_token = 0.004, 0.0015  # seconds of CPU outside the step threads

    def phase(steps, tokens):
        busy = 30.0 + per_step * steps + per_token * tokens
        return {"engine_steps": steps, "output_tokens": tokens, "machine_busy_s": busy,
                "step_threads_s": 30.0, "cores": 2,
                "serving_cpu_ms_per_token": 1000 * (busy - 30.0) / tokens}
    # 8 clients: 3.5 sequences a step; 2 clients: 1.2
    probe = {"loaded": phase(720, 2520), "loaded_light": phase(1000, 1200)}
    assert serving_cpu_terms(probe) == pytest.approx(
        {"serving_cpu_per_step": per_step, "serving_cpu_per_token": per_token})
    # an older probe, one loaded phase: all of it per output token, as before
    older = {"loaded": probe["loaded"]}
    assert serving_cpu_terms(older) == {
        "serving_cpu_per_token": probe["loaded"]["serving_cpu_ms_per_token"] / 1000}
    # phases that would need a negative term are refused by name
    light = {**phase(1000, 1200), "machine_busy_s": 30.1}
    bad = {"loaded": phase(720, 2520), "loaded_light": light}
    with pytest.raises(ValueError, match="serving_cpu_per_step"):
        serving_cpu_terms(bad)


def test_the_serving_path_per_step_cpu_counts_each_running_steps_rate():
    # 0.05 s of CPU per step, no per-token part: two steps of 0.1 s each need 1 core between
    # them, which leaves the two step threads one core: half a core each
    shared = dataclasses.replace(CPU_SMOLLM2_135M, serving_cpu_per_step=0.05, cores=2)
    assert shared.shares_cores
    assert shared.stretch([(1, 0.1)]) == 1.0  # alone: the free core serves it
    assert shared.stretch([(1, 0.1), (1, 0.1)]) == pytest.approx(2.0)
