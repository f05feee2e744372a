"""How long a simulated engine step takes: a cost model of the batch the real Scheduler built.

A step is described by three counts taken from the ScheduledBatch (no tensors, no model):

    new_tokens   tokens computed this step (prefill chunks + one per decoding sequence)
    sequences    requests in the step
    kv_read      tokens of K/V attention reads: every scheduled request reads its whole context
                 (start_position + its new tokens)

Two models turn them into seconds:

  LinearCost     t = per_step + per_token x new_tokens + per_seq x sequences + per_kv x kv_read
                 + per_step_serving: the forward's coefficients fitted on the real CPU engine's
                 steps, the serving path's per-step cost on a real fleet's time per output
                 token (benchmarks/fleet_sim_calibrate.py)
  RooflineCost   a GPU *model*, not a measurement: t = max(FLOPs / (peak x mfu),
                 bytes / (bandwidth x mbu)) + overhead, from public figures (H100_LLAMA3_8B)
"""
from __future__ import annotations

from dataclasses import dataclass

from raypaged.core.contracts import ScheduledBatch

# A step's slowest speed on shared cores: the serving path cannot take a step's whole core
# (the kernel's fair share gives each runnable thread its turn).
MIN_SPEED = 0.25


@dataclass(frozen=True)
class StepShape:
    new_tokens: int
    sequences: int
    kv_read: int          # sum over requests of the context attended (start + new tokens)
    attended_pairs: int   # sum over new tokens of the positions each attends (causal)
    sampled: int          # sequences that sample a token this step (need the LM head)


def step_shape(batch: ScheduledBatch) -> StepShape:
    new = seqs = kv = pairs = sampled = 0
    for sr in batch.requests:
        n, start = len(sr.token_ids), sr.start_position
        new += n
        seqs += 1
        kv += start + n
        # token k of this chunk (position start + k) attends start + k + 1 positions
        pairs += n * start + n * (n + 1) // 2
        sampled += sr.num_samples > 0
    return StepShape(new, seqs, kv, pairs, sampled)


@dataclass(frozen=True)
class LinearCost:
    """Seconds per step, linear in the step's shape; fitted, so it holds only where measured."""

    name: str
    per_step: float
    per_token: float
    per_seq: float
    per_kv: float
    # What a served step costs beyond the model's forward: scheduling, sampling, handing the
    # step's tokens to the router through Ray and to the client through HTTP, on cores shared
    # with the router, the Serve proxy and the other worker. A forward-step benchmark cannot
    # see it; it is fitted to a real fleet's time per output token
    # (calibration.fit_serving_overhead).
    per_step_serving: float = 0.0
    # Measured on the real serving path (benchmarks/fleet_sim_probe.py: one request at a time
    # on an idle 2-worker fleet), beyond the forward-step fit: a served prefill costs more per
    # token the longer the chunk's context (attention over every earlier position, which the
    # forward benchmark's one 256-token prefill cannot separate from its per-token cost), and
    # each request spends `path_s` on the way in and out (HTTP, routing, the submit to the
    # worker, the first SSE frame) outside any step.
    per_pair: float = 0.0     # per attended (query, key) pair of the step's new tokens
    path_s: float = 0.0       # per request, before its first token reaches the client
    # Per sequence of a step, what the served step thread spends beyond the forward fit and
    # per_step_serving (handing each sequence's token on, its stop checks): one sequence a
    # step on an idle fleet cannot tell it from per_step_serving, so it is measured on the
    # probe's loaded phase, the step threads' CPU against the forward fit (calibration.py).
    per_seq_serving: float = 0.0
    # The serving path's CPU per output token (HAProxy, the router replica, each worker's
    # event loop and Ray's threads, the controller, the client), measured loaded by the probe,
    # on a machine of `cores` cores that every simulated worker's step thread shares: beside
    # the steps running it takes the cores they leave free, and beyond those a share of theirs
    # (stretch, sim/shared_cores.py). 0: not modelled (a worker per machine, or a GPU's host).
    serving_cpu_per_token: float = 0.0
    # Its CPU per engine step, whatever the step's size (each worker's loop waking, one Ray
    # message per step to the router): steps of one sequence carry it alone. Told apart from
    # the per-token part by a second, lighter loaded phase of the probe (calibration.py).
    serving_cpu_per_step: float = 0.0
    cores: int = 0

    def seconds(self, s: StepShape) -> float:
        return (self.per_step + self.per_step_serving + self.per_token * s.new_tokens
                + (self.per_seq + self.per_seq_serving) * s.sequences + self.per_kv * s.kv_read
                + self.per_pair * s.attended_pairs)

    @property
    def shares_cores(self) -> bool:
        return bool((self.serving_cpu_per_token or self.serving_cpu_per_step) and self.cores)

    def stretch(self, steps: list[tuple[int, float]]) -> float:
        """How much longer a step takes on the shared cores than alone. `steps`: (tokens
        sampled, seconds alone) of every step running, the new one included, each on one
        thread. The serving path needs serving_cpu_per_token x their rate of output tokens
        + serving_cpu_per_step x their rate of steps, in cores; the steps share what it
        leaves: at most one core each."""
        if not self.shares_cores or not steps:
            return 1.0
        serving = sum((self.serving_cpu_per_token * n + self.serving_cpu_per_step) / s
                      for n, s in steps if s > 0)
        speed = min(1.0, (self.cores - serving) / len(steps))
        return 1.0 / max(speed, MIN_SPEED)


@dataclass(frozen=True)
class RooflineCost:
    """A decoder-only transformer on one accelerator, bounded by compute or by memory traffic.

    FLOPs  = 2 x body params x new tokens + 2 x LM-head params x sampled sequences
             + 4 x layers x (q heads x head dim) x attended pairs     (QK^T and PV)
    bytes  = weight bytes (read once per step) + KV bytes per token x kv_read
             + KV bytes per token x new_tokens                        (writing the new K/V)
    """

    name: str
    body_params: float        # every weight a token goes through, the embedding lookup aside
    head_params: float        # the LM head (only for sequences that sample)
    weight_bytes: float
    layers: int
    q_width: int              # query heads x head dim
    kv_bytes_per_token: float
    peak_flops: float
    bandwidth: float          # bytes/s
    mfu: float                # achievable fraction of peak FLOPs (an assumption, stated)
    mbu: float                # achievable fraction of peak bandwidth (an assumption, stated)
    overhead_s: float         # per step: launch, scheduling, sampling (an assumption, stated)
    kv_budget_bytes: float    # memory left for the KV cache
    path_s: float = 0.0       # per request outside any step (HTTP, routing): not modelled

    def seconds(self, s: StepShape) -> float:
        flops = (2 * self.body_params * s.new_tokens + 2 * self.head_params * s.sampled
                 + 4 * self.layers * self.q_width * s.attended_pairs)
        traffic = self.weight_bytes + self.kv_bytes_per_token * (s.kv_read + s.new_tokens)
        return max(flops / (self.peak_flops * self.mfu),
                   traffic / (self.bandwidth * self.mbu)) + self.overhead_s

    shares_cores = False  # one accelerator per worker, whose host work is in overhead_s

    def kv_blocks(self, block_size: int) -> int:
        return int(self.kv_budget_bytes // (self.kv_bytes_per_token * block_size))


# Llama-3.1-8B (the Llama-3-8B architecture with a 128k context: the Mooncake trace's prompts run
# to 126k tokens) in bf16 on one H100 SXM 80 GB. Public figures:
#   model (benchmarks/configs/llama-3-8b.json): 32 layers, hidden 4096, 32 query heads and 8 KV
#     heads of 128, MLP 14336, vocab 128256 -> 8.03e9 params, of which 0.525e9 embedding and
#     0.525e9 LM head; KV per token = 2 (K, V) x 32 layers x 8 x 128 x 2 bytes = 131,072 bytes
#   H100 SXM (NVIDIA H100 Tensor Core GPU datasheet): 989 TFLOPS dense BF16, 3.35 TB/s HBM3
# Assumptions (not measurements): 60% of peak FLOPs in prefill, 80% of peak bandwidth in decode,
# 0.5 ms per step of host overhead (CUDA graphs), 90% of 80 GB given to the engine, 2 GB of it
# for activations: KV budget = 72 - 16.06 - 2 = 53.9 GB (411k tokens).
_LLAMA_PARAMS, _EMBED = 8.03e9, 128256 * 4096
H100_LLAMA3_8B = RooflineCost(
    name="H100 x Llama-3.1-8B bf16 (roofline model)",
    body_params=_LLAMA_PARAMS - 2 * _EMBED, head_params=_EMBED, weight_bytes=2 * _LLAMA_PARAMS,
    layers=32, q_width=32 * 128, kv_bytes_per_token=2 * 32 * 8 * 128 * 2,
    peak_flops=989e12, bandwidth=3.35e12, mfu=0.6, mbu=0.8, overhead_s=0.5e-3,
    kv_budget_bytes=0.9 * 80e9 - 2 * _LLAMA_PARAMS - 2e9)


# The real CPU engine on this project's 2-core machine (SmolLM2-135M, bf16, the engine's CPU
# defaults, 1 thread = one serving worker's CPU), fitted by benchmarks/fleet_sim_calibrate.py to
# benchmarks/results/forward_step.json (2026-11-23): decode of 1/4/16/64 sequences and a
# 256-token prefill, all at context 256, so per_kv is not fitted (0): the model holds near
# that context. Its check against a real `raypaged serve --workers 2` run is in
# benchmarks/results/fleet_sim_calibration.json.
CPU_SMOLLM2_135M = LinearCost(name="CPU x SmolLM2-135M (fitted)",
                              per_step=0.014125632641791622, per_token=0.0008510550153178756,
                              per_seq=0.0006991274368331322, per_kv=0.0)
