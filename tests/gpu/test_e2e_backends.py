"""On a GPU: greedy tokens identical with the torch backend, Triton eager, and Triton + CUDA graphs.

Random weights with the default model's real shapes (weights cannot travel to the GPU box);
run with `make gpu-check`. Skipped without CUDA or under the Triton interpreter.
"""
import os
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                                reason="needs CUDA (and no TRITON_INTERPRET)")

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def greedy_tokens(backend: str, enforce_eager: bool, kv_dtype: str = "auto"):
    from benchmarks.random_model import random_model
    from raypaged.core.sampling_params import SamplingParams
    from raypaged.config import EngineArgs

    args = EngineArgs(kv_memory_mb=1024, max_model_len=1024, max_num_seqs=16, attention_backend=backend,
                      enforce_eager=enforce_eager, kv_dtype=kv_dtype, dtype="bfloat16",
                      device="cuda")
    model, setup = random_model("smollm2-135m", args)
    core, _, runner = setup.build_core(model)
    gen = torch.Generator().manual_seed(1)
    for i in range(12):  # mixed lengths: decode batches of several sizes once short ones finish
        n = int(torch.randint(5, 300, (1,), generator=gen))
        prompt = torch.randint(100, 40000, (n,), generator=gen).tolist()
        core.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=8 + 4 * i, ignore_eos=True))
    out = {}
    while core.has_unfinished():
        for d in core.step():
            out.setdefault(d.request_id, []).extend(d.new_token_ids)
    return out, runner


def test_torch_triton_eager_and_graphs_give_identical_tokens():
    ref, _ = greedy_tokens("torch", enforce_eager=True)
    eager, r_eager = greedy_tokens("triton", enforce_eager=True)
    graphs, r_graph = greedy_tokens("triton", enforce_eager=False)
    assert r_eager.num_graph_steps == 0
    assert r_graph.num_graph_steps > 0, "no decode step replayed a CUDA graph"
    assert eager == ref
    assert graphs == eager


def test_fp8_kv_runs_with_graphs_and_is_refused_at_start_below_sm89():
    if torch.cuda.get_device_capability() < (8, 9):
        with pytest.raises(ValueError, match="compute capability 8.9 or newer"):
            greedy_tokens("triton", enforce_eager=False, kv_dtype="fp8_e4m3")
        return
    out, runner = greedy_tokens("triton", enforce_eager=False, kv_dtype="fp8_e4m3")
    assert runner.num_graph_steps > 0 and sum(len(v) for v in out.values()) == sum(8 + 4 * i for i in range(12))
