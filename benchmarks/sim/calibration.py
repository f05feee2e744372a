"""Fit a LinearCost to measured engine steps (least squares, pure Python).

A measured step is (new tokens, sequences, kv tokens read, seconds). The fit solves the normal
equations for the coefficients that vary in the data; a column that is constant or collinear
with another (e.g. kv_read when every step ran at one context length) must be left out by the
caller (`fit_linear(..., terms=...)`), and its coefficient is 0: the model then holds only
near the measured shapes, which the calibration's check against a real fleet run tells.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from benchmarks.sim.cost_model import LinearCost

TERMS = ("per_step", "per_token", "per_seq", "per_kv")


def _row(point: Sequence[float], terms: Sequence[str]) -> list[float]:
    new, seqs, kv = point[0], point[1], point[2]
    values = {"per_step": 1.0, "per_token": new, "per_seq": seqs, "per_kv": kv}
    return [values[t] for t in terms]


def fit_linear(name: str, points: Sequence[tuple[float, float, float, float]],
               terms: Sequence[str] = TERMS) -> LinearCost:
    """points: (new_tokens, sequences, kv_read, seconds)."""
    unknown = set(terms) - set(TERMS)
    if unknown:
        raise ValueError(f"unknown terms {sorted(unknown)}; choices: {', '.join(TERMS)}")
    if len(points) < len(terms):
        raise ValueError(f"{len(points)} measured steps cannot fit {len(terms)} coefficients: "
                         f"measure more step shapes or fit fewer terms")
    coef = _least_squares([_row(p, terms) for p in points], [p[3] for p in points], terms)
    return LinearCost(name, **{t: coef.get(t, 0.0) for t in TERMS})


def _least_squares(rows: Sequence[Sequence[float]], ys: Sequence[float],
                   terms: Sequence[str]) -> dict[str, float]:
    """The coefficients (named by `terms`) minimising sum (row . coef - y)^2: normal equations."""
    k = len(terms)
    a = [[0.0] * k for _ in range(k)]
    b = [0.0] * k
    for x, y in zip(rows, ys):
        for i in range(k):
            b[i] += x[i] * y
            for j in range(k):
                a[i][j] += x[i] * x[j]
    return _solve(a, b, terms)


def _measured_terms(rows: Sequence[Sequence[float]], ys: Sequence[float],
                    terms: Sequence[str], source: str) -> dict[str, float]:
    """_least_squares over a probe's figures, a negative term refused by name: `source` was too
    noisy (a loaded machine) to tell it."""
    coef = _least_squares(rows, ys, terms)
    negative = sorted(k for k, v in coef.items() if v < 0)
    if negative:
        raise ValueError(f"{source} negative {', '.join(negative)} ({coef}): too noisy to "
                         "measure them; rerun benchmarks/fleet_sim_probe.py on a quiet machine")
    return coef


def _solve(a: list[list[float]], b: list[float], terms: Sequence[str]) -> dict[str, float]:
    """Gaussian elimination with partial pivoting; refuses a singular system by name."""
    k = len(b)
    m = [row[:] + [rhs] for row, rhs in zip(a, b)]
    for c in range(k):
        pivot = max(range(c, k), key=lambda r: abs(m[r][c]))
        if abs(m[pivot][c]) < 1e-12 * max(1.0, max(abs(v) for row in a for v in row)):
            raise ValueError(f"the measured steps do not tell {terms[c]!r} apart from the other "
                             f"terms (constant or collinear): leave it out of `terms`")
        m[c], m[pivot] = m[pivot], m[c]
        for r in range(k):
            if r != c:
                f = m[r][c] / m[c][c]
                m[r] = [x - f * y for x, y in zip(m[r], m[c])]
    return {terms[i]: m[i][k] / m[i][i] for i in range(k)}


def forward_step_points(data: dict) -> list[tuple[float, float, float, float]]:
    """(new tokens, sequences, kv read, seconds) of each `default` step of a
    benchmarks/forward_step.py result: "decode xB" is B sequences of one new token at the
    result's context, "prefill P" one sequence of P new tokens."""
    ctx = data["context"]
    points = []
    for row in data["rows"]:
        if row["variant"] != "default":
            continue
        kind, n = row["step"].split()
        seconds = row["median_cpu_ms"] / 1000
        if kind == "decode":
            b = int(n.lstrip("x"))
            points.append((b, b, b * (ctx + 1), seconds))
        else:
            p = int(n)
            points.append((p, 1, p, seconds))
    return points


def fit_serving_overhead(cost: LinearCost, simulated_tpot: Callable[[LinearCost], float],
                         real_tpot_s: float, rounds: int = 8) -> LinearCost:
    """`cost` with the per-step serving overhead that makes the simulated mean time per output
    token of one real run equal the measured one. Every output token after the first takes a
    step, so the overhead adds to the TPOT about once; longer steps then batch more sequences,
    so the remaining gap is applied again (secant steps) until it settles. Never below 0."""
    x0, f0 = 0.0, simulated_tpot(cost) - real_tpot_s
    x1 = max(0.0, -f0)
    for _ in range(rounds):
        f1 = simulated_tpot(dataclasses.replace(cost, per_step_serving=x1)) - real_tpot_s
        if f1 == f0 or abs(f1) < 1e-6:
            break
        x0, x1, f0 = x1, max(0.0, x1 - f1 * (x1 - x0) / (f1 - f0)), f1
    return dataclasses.replace(cost, per_step_serving=x1)


def probe_terms(forward: LinearCost, probe: dict) -> LinearCost:
    """`forward` with the serving path's terms measured by benchmarks/fleet_sim_probe.py (one
    request at a time on an idle real fleet: no queueing, no batching), none of them fitted to
    the runs the calibration is checked on. Per probe request of P prompt tokens and T output
    tokens, on an idle worker:

        TTFT = path_s + serving + forward(P new tokens, 1 sequence) + per_pair x P(P+1)/2
        TPOT = serving + forward(1 new token, 1 sequence) + per_pair x (P + T/2)
               (a decode step of one token attends its whole context: P + T/2 on average)

    solved together by least squares for path_s (per request), serving (per step,
    `per_step_serving`) and per_pair (per attended pair: what a longer chunk costs beyond the
    forward fit's per-token term). A negative solution is refused by name: the probe was too
    noisy (a loaded machine) to tell the term, so rerun it quiet. The probe's loaded phase,
    where it has one, gives the serving path's CPU per output token on the machine's cores
    (`serving_cpu_per_token`, `cores`: LinearCost.stretch)."""
    rows, ys = [], []
    for r in probe["requests"]:
        p, t = r["prompt_tokens"], r["output_tokens"]
        rows.append([1.0, 1.0, p * (p + 1) / 2])
        ys.append(r["ttft_ms"] / 1000 - forward.per_step - forward.per_token * p
                  - forward.per_seq - forward.per_kv * p)
        rows.append([0.0, 1.0, p + t / 2])
        ys.append(r["tpot_ms"] / 1000 - forward.per_step - forward.per_token - forward.per_seq
                  - forward.per_kv * (p + t / 2))
    coef = _measured_terms(rows, ys, ("path_s", "per_step_serving", "per_pair"),
                           "the probe gives")
    if "loaded" in probe:
        coef.update(serving_cpu_terms(probe), cores=probe["loaded"]["cores"])
    served = dataclasses.replace(forward, **coef)
    if "engine_steps" in probe.get("loaded", {}):
        # the idle probe's per-step term holds one sequence's share; the loaded phase's
        # steps of several sequences tell it apart (at most all of the per-step term)
        extra = min(max(0.0, loaded_step_residual(served, probe["loaded"])["per_seq_s"]),
                    served.per_step_serving)
        served = dataclasses.replace(served, per_seq_serving=extra,
                                     per_step_serving=served.per_step_serving - extra)
    return served


def serving_cpu_terms(probe: dict) -> dict:
    """The serving path's CPU outside the step threads, from the probe's loaded phases: per
    output token only, from the one phase of an older probe; with its light phase too (fewer
    clients, fewer sequences a step), per step and per token, the two phases' CPU solved
    together. A negative term is refused by name, as probe_terms does: too noisy to tell."""
    phases = [probe[k] for k in ("loaded", "loaded_light") if k in probe]
    if len(phases) < 2 or any("engine_steps" not in p for p in phases):
        return {"serving_cpu_per_token": phases[0]["serving_cpu_ms_per_token"] / 1000}
    return _measured_terms([[p["engine_steps"], p["output_tokens"]] for p in phases],
                           [p["machine_busy_s"] - p["step_threads_s"] for p in phases],
                           ("serving_cpu_per_step", "serving_cpu_per_token"),
                           "the probe's loaded phases give")


def loaded_step_residual(cost: LinearCost, loaded: dict) -> dict:
    """The probe's loaded phase: what the step threads spent (their CPU) against what `cost`
    (forward fit, per_step_serving, per_pair) predicts for the steps they ran, and the rest
    per sequence beyond a step's first (`cost`'s per-step terms, from one sequence a step on
    an idle fleet, already hold one sequence's share). Each request of P prompt tokens and T
    output tokens is one prefill step of P tokens (the probe's prompts fit in one chunk) and
    T - 1 decode steps of one token, the k-th reading P + k positions; the steps are the
    workers' count."""
    steps = loaded["engine_steps"]
    prompts = loaded["prompt_tokens"]
    t = loaded["output_tokens"] / len(prompts)
    seq_steps = t * len(prompts)
    new = sum(prompts) + (t - 1) * len(prompts)
    decode_reads = sum((t - 1) * p + t * (t - 1) / 2 for p in prompts)
    kv = sum(prompts) + decode_reads
    pairs = sum(p * (p + 1) / 2 for p in prompts) + decode_reads
    predicted = ((cost.per_step + cost.per_step_serving) * steps + cost.per_token * new
                 + cost.per_seq * seq_steps + cost.per_kv * kv + cost.per_pair * pairs)
    rest = loaded["step_threads_s"] - predicted
    return {"steps": steps, "seq_steps": seq_steps, "step_threads_s": loaded["step_threads_s"],
            "predicted_s": predicted, "per_seq_s": rest / (seq_steps - steps)}
