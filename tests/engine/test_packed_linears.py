"""Engine.from_args packs the linears of a CPU bf16 model, and packing changes no generated token."""
from __future__ import annotations

import pytest
import torch

from engine_prompts import PROMPTS
from raypaged.model.llama import PackedLinear, can_pack

pytestmark = pytest.mark.skipif(not can_pack(torch.bfloat16, torch.device("cpu")),
                                reason="this torch has no oneDNN linear prepacking")


def greedy_bf16(model_dir, packed: bool):
    from raypaged import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype="bfloat16", kv_memory_mb=64, max_model_len=256,
              packed_linears=packed)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                        use_tqdm=False)
    model = llm.engine.runner.model
    num_packed = sum(isinstance(m, PackedLinear) for m in model.modules())
    return [o.outputs[0].token_ids for o in outs], num_packed


def test_packed_and_plain_bf16_engines_generate_the_same_tokens(default_model_dir):
    plain, none_packed = greedy_bf16(default_model_dir, packed=False)
    packed, all_packed = greedy_bf16(default_model_dir, packed=True)
    assert none_packed == 0
    assert all_packed == 30 * 4 + 1  # four per layer, and the tied lm_head
    assert packed == plain
