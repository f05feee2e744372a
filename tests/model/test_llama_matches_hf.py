"""Our paged Llama-family model gives transformers' logits, through chunked prefill and decode."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from raypaged.kernels import cpu_paged_decode
from raypaged.model.attention.torch_backend import TorchAttentionBackend
from raypaged.model.kv_cache import allocate_kv_caches
from raypaged.model.loader import load_model
from paged_metadata import make_metadata, positions_for, scattered_block_tables

SMALL = dict(vocab_size=257, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             max_position_embeddings=128, rms_norm_eps=1e-5)

CONFIGS = {
    # GQA group 2, llama3 rope scaling with a short original context so the scaling matters.
    "llama": lambda: LlamaConfig(
        **SMALL, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
        rope_theta=500000.0),
    # GQA group 4, explicit head_dim that is not hidden / heads.
    "mistral": lambda: MistralConfig(
        **SMALL, num_attention_heads=4, num_key_value_heads=1, head_dim=24, sliding_window=None,
        tie_word_embeddings=False),
    # GQA group 3, q/k/v bias, tied embeddings.
    "qwen2": lambda: Qwen2Config(
        **SMALL, num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=True),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def hf_and_ours(request, tmp_path_factory):
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(CONFIGS[request.param](), attn_implementation="eager")
    with torch.no_grad():  # random everything, biases and norms included, so none can hide
        for p in hf.parameters():
            p.normal_(0.0, 0.2)
    hf.eval()
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path, safe_serialization=True)
    ours, config = load_model(path, dtype="float32", device="cpu")
    return hf, ours, config


@pytest.mark.parametrize("decode", ["gather", "cpp"])
def test_mixed_batch_chunked_prefill_then_decode_matches_transformers(hf_and_ours, decode):
    hf, ours, config = hf_and_ours
    ours.backend = TorchAttentionBackend(cpu_paged_decode.paged_decode if decode == "cpp" else None)
    gen = torch.Generator().manual_seed(1)
    # Sequence A: 21-token prompt prefilled in chunks of 13 and 8 (crossing a block boundary),
    # then one decode. Sequence B: 6-token prompt at once, a decode beside A's second chunk,
    # and another beside A's decode.
    a = torch.randint(0, config.vocab_size, (22,), generator=gen)
    b = torch.randint(0, config.vocab_size, (8,), generator=gen)
    steps = [  # (tokens of A this step, of B this step), as (start, end) positions
        ((0, 13), (0, 6)),
        ((13, 21), (6, 7)),
        ((21, 22), (7, 8)),
    ]
    block_size = 8
    tables = scattered_block_tables([22, 8], block_size, num_blocks=12)
    caches = allocate_kv_caches(config, num_blocks=12, block_size=block_size, dtype=torch.float32)

    with torch.no_grad():
        ref_a = hf(a[None]).logits[0]  # [22, vocab]
        ref_b = hf(b[None]).logits[0]  # [8, vocab]
    worst = 0.0
    for (a0, a1), (b0, b1) in steps:
        query_lens, seq_lens = [a1 - a0, b1 - b0], [a1, b1]
        meta = make_metadata(tables, query_lens, seq_lens, block_size)
        ids = torch.cat([a[a0:a1], b[b0:b1]])
        logits = ours.compute_logits(ours(ids, positions_for(query_lens, seq_lens), caches, meta))
        expected = torch.cat([ref_a[a0:a1], ref_b[b0:b1]])
        assert logits.shape == expected.shape and logits.dtype == torch.float32
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
        worst = max(worst, (logits - expected).abs().max().item())
    print(f"{config.architecture}: max |ours - transformers| = {worst:.2e}")
