"""On a GPU: greedy tokens identical with the torch backend, Triton eager, and Triton + CUDA graphs,
for the default model's shapes and Llama-3-8B's; n > 1 with fp8 KV; preemption under a small KV
budget giving the same tokens as an ample one.

Random weights with real shapes (weights cannot travel to the GPU box; benchmarks/configs/);
run with `make gpu-check`. Skipped without CUDA or under the Triton interpreter.
"""
import gc
import os
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                                reason="needs CUDA (and no TRITON_INTERPRET)")

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# config -> (number of requests, longest prompt): the 8B shape gets fewer, it is ~60x the work
CONFIGS = {"smollm2-135m": (12, 300), "llama-3-8b": (6, 200)}
# SmolLM2 ties its embeddings: at std 1 greedy repeats each prompt's last token whatever attention
# computes (its logit leads by |embedding|^2 ~ 576), so the comparisons use std 0.1, where the
# picks depend on attention; Llama-3-8B's untied random head needs no such care
EMBED_STD = {"smollm2-135m": 0.1, "llama-3-8b": 1.0}


def prompts(config: str) -> list[list[int]]:
    count, longest = CONFIGS[config]
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(100, 40000, (int(torch.randint(5, longest, (1,), generator=gen)),),
                          generator=gen).tolist() for _ in range(count)]


def run(config: str, backend: str, enforce_eager: bool, params=None, embed_std=None,
        **engine_args):
    """Each request's tokens ({(request, sample index): ids}), the runner's graph step count and
    the engine's preemption count; the model is freed before returning."""
    from benchmarks.random_model import random_model
    from raypaged.config import EngineArgs
    from raypaged.core.sampling_params import SamplingParams

    args = EngineArgs(**{"kv_memory_mb": 1024, "max_model_len": 1024, "max_num_seqs": 16,
                         "attention_backend": backend, "enforce_eager": enforce_eager,
                         "dtype": "bfloat16", "device": "cuda", **engine_args})
    model, setup = random_model(config, args, embed_std=embed_std or EMBED_STD[config])
    core, _, runner = setup.build_core(model)
    for i, prompt in enumerate(prompts(config)):  # mixed lengths: decode batches of many sizes
        core.add_request(f"r{i}", prompt, params or SamplingParams(
            temperature=0, max_tokens=8 + 4 * i, ignore_eos=True))
    out: dict[tuple[str, int], list[int]] = {}
    while core.has_unfinished():
        for d in core.step():
            out.setdefault((d.parent_id or d.request_id, d.sample_index), []).extend(d.new_token_ids)
    result = (out, runner.num_graph_steps, core.stats().num_preemptions)
    del core, runner, model
    gc.collect()
    torch.cuda.empty_cache()
    return result


def attention_decides(out: dict, config: str) -> bool:
    """Not every request just repeats its prompt's last token (what the picks look like when
    attention does not matter)."""
    last = [p[-1] for p in prompts(config)]
    return any(set(ids) != {last[int(rid[1:])]} for (rid, _), ids in out.items())


# fp32: random layers amplify bf16 rounding until the backends' greedy picks part (the 8B shape
# in bf16 on an H200: 0 of 6 requests identical between torch and Triton; that test below)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_torch_triton_eager_and_graphs_give_identical_tokens(config):
    ref, _, _ = run(config, "torch", enforce_eager=True, dtype="float32")
    eager, eager_graph_steps, _ = run(config, "triton", enforce_eager=True, dtype="float32")
    graphs, graph_steps, _ = run(config, "triton", enforce_eager=False, dtype="float32")
    assert attention_decides(ref, config)
    assert eager_graph_steps == 0
    assert graph_steps > 0, "no decode step replayed a CUDA graph"
    assert eager == ref
    assert graphs == eager


def test_llama_3_8b_shape_in_bf16_same_tokens_eager_and_with_graphs():
    eager, _, _ = run("llama-3-8b", "triton", enforce_eager=True)
    graphs, graph_steps, _ = run("llama-3-8b", "triton", enforce_eager=False)
    ref, _, _ = run("llama-3-8b", "torch", enforce_eager=True)
    same = sum(ref[k] == eager[k] for k in ref)
    print(f"llama-3-8b bf16: torch backend and Triton token-identical on {same}/{len(ref)} requests")
    assert attention_decides(eager, "llama-3-8b")
    assert graph_steps > 0
    assert graphs == eager


def test_n_samples_with_fp8_kv_and_graphs_and_refused_below_sm89():
    from raypaged.core.sampling_params import SamplingParams

    if torch.cuda.get_device_capability() < (8, 9):
        with pytest.raises(ValueError, match="compute capability 8.9 or newer"):
            run("smollm2-135m", "triton", enforce_eager=False, kv_dtype="fp8_e4m3")
        return
    # a temperature of 1000 flattens the random model's logits: the three samples differ
    params = SamplingParams(n=3, temperature=1000.0, seed=7, max_tokens=24, ignore_eos=True)
    out, graph_steps, _ = run("smollm2-135m", "triton", enforce_eager=False, params=params,
                              kv_dtype="fp8_e4m3")
    assert graph_steps > 0
    assert sorted(out) == sorted((f"r{i}", k) for i in range(12) for k in range(3))
    assert all(len(ids) == 24 for ids in out.values())
    for i in range(12):  # three different samples of each prompt
        assert len({tuple(out[(f"r{i}", k)]) for k in range(3)}) == 3
    # greedy with fp8 KV against a bf16 cache: the first token of each request comes from the
    # prefill, whose K/V the fp8 cache rounds too; with attention deciding the picks (std 0.1)
    # most first tokens agree (printed in full: how far fp8 rounding moves greedy decoding)
    fp8, _, _ = run("smollm2-135m", "triton", enforce_eager=False, kv_dtype="fp8_e4m3")
    bf16, _, _ = run("smollm2-135m", "triton", enforce_eager=False)
    same = sum(fp8[k] == bf16[k] for k in bf16)
    first = sum(fp8[k][0] == bf16[k][0] for k in bf16)
    print(f"fp8 vs bf16 KV, greedy: {same}/{len(bf16)} requests token-identical, "
          f"{first}/{len(bf16)} first tokens")
    assert attention_decides(bf16, "smollm2-135m")
    assert first >= len(bf16) // 2


def test_preemption_under_a_small_kv_budget_gives_the_same_tokens():
    # fp32: the recomputed prefill runs in other batches than the first, as on any preemption
    ample, _, none = run("smollm2-135m", "triton", enforce_eager=False, max_model_len=360,
                         dtype="float32")
    # admitting what fits into 400 tokens of KV makes 12 requests of ~1,900 tokens preempt
    small, graph_steps, preemptions = run(
        "smollm2-135m", "triton", enforce_eager=False, kv_memory_mb=None, kv_context_len=400,
        max_model_len=360, admission_policy="fits", dtype="float32")
    assert attention_decides(ample, "smollm2-135m")
    assert none == 0 and preemptions > 0 and graph_steps > 0
    assert small == ample
