"""Prepacked oneDNN linears (CPU bf16) change where the weight reorder happens, not the numbers."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

from raypaged.model.attention import get_attention_backend
from raypaged.model.kv_cache import allocate_kv_caches
from raypaged.model.llama import LlamaModel
from raypaged.model.model_config import ModelConfig
from raypaged.model.llama import PackedLinear, can_pack, pack_linears
from paged_metadata import make_metadata, positions_for, scattered_block_tables

pytestmark = pytest.mark.skipif(not can_pack(torch.bfloat16, torch.device("cpu")),
                                reason="this torch has no oneDNN linear prepacking")

# every kind of linear: biased q/k/v and o_proj, GQA, and an untied lm_head
CONFIG = ModelConfig(
    architecture="LlamaForCausalLM", vocab_size=300, hidden_size=64, intermediate_size=96,
    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=1e4,
    rope_scaling=None, max_position_embeddings=256, tie_word_embeddings=False,
    attention_bias=True, o_proj_bias=True, eos_token_ids=(0,), bos_token_id=None)


def random_model(config: ModelConfig) -> LlamaModel:
    torch.manual_seed(0)
    model = LlamaModel(config, get_attention_backend("torch", "cpu"))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model.to(torch.bfloat16).eval()


def logits_of_a_prefill_then_a_decode(model: LlamaModel) -> list[torch.Tensor]:
    """Two sequences: prefill of 5 and 9 tokens, then one decode step each."""
    caches = allocate_kv_caches(CONFIG, 8, 4, torch.bfloat16, "cpu")
    tables = scattered_block_tables([10, 10], 4, 8)
    out = []
    for query_lens, seq_lens in (([5, 9], [5, 9]), ([1, 1], [6, 10])):
        meta = make_metadata(tables, query_lens, seq_lens, 4)
        ids = torch.arange(3, 3 + sum(query_lens)) * 7 % CONFIG.vocab_size
        hidden = model(ids, positions_for(query_lens, seq_lens), caches, meta)
        out.append(model.compute_logits(hidden))
    return out


@pytest.mark.parametrize("tied", [False, True])
def test_packing_replaces_every_linear_and_gives_the_same_bits(tied):
    config = dataclasses.replace(CONFIG, tie_word_embeddings=tied)
    eager = random_model(config)
    packed = copy.deepcopy(eager)
    # qkv, o, gate_up, down per layer; the lm_head (for a tied model, a packed embedding copy)
    assert pack_linears(packed) == 2 * 4 + 1
    assert not any(isinstance(m, nn.Linear) for m in packed.modules())
    assert sum(isinstance(m, PackedLinear) for m in packed.modules()) == 9
    assert isinstance(packed.lm_head, PackedLinear)
    for want, got in zip(logits_of_a_prefill_then_a_decode(eager),
                         logits_of_a_prefill_then_a_decode(packed), strict=True):
        assert torch.equal(want, got)


def test_a_model_that_ran_before_packing_runs_its_packed_linears_after():
    model = random_model(CONFIG)
    logits_of_a_prefill_then_a_decode(model)  # its layer parts: bound to the plain linears
    pack_linears(model)
    logits_of_a_prefill_then_a_decode(model)
    linears = [step.__self__ for parts in model.layer_parts
               for step in (parts.qkv_proj, parts.o_proj, parts.gate_up_proj, parts.down_proj)]
    assert len(linears) == 2 * 4
    assert all(isinstance(m, PackedLinear) for m in linears)


def test_only_cpu_bf16_and_fp32_pack():
    assert can_pack(torch.float32, torch.device("cpu"))
    assert not can_pack(torch.float16, torch.device("cpu"))
    assert not can_pack(torch.bfloat16, torch.device("meta"))


def test_packed_fp32_linears_stay_within_a_few_ulps_of_eager():
    """fp32 packing swaps MKL for oneDNN: another summation order, not other arithmetic."""
    eager = random_model(CONFIG).float()
    packed = copy.deepcopy(eager)
    pack_linears(packed)
    assert isinstance(packed.layers[0].mlp.down_proj, PackedLinear)
    caches = allocate_kv_caches(CONFIG, 8, 4, torch.float32, "cpu")
    meta = make_metadata(scattered_block_tables([9], 4, 8), [9], [9], 4)
    ids, positions = torch.arange(3, 12) * 7 % CONFIG.vocab_size, positions_for([9], [9])
    want = eager.compute_logits(eager(ids, positions, caches, meta))
    got = packed.compute_logits(packed(ids, positions, caches, meta))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
