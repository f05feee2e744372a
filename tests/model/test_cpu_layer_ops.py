"""The C++ bf16 RMSNorm and rotary embedding (kernels/cpu_layer_ops.cpp) give the bits of the
torch ops they replace (raypaged.model.llama.RMSNorm, apply_rotary); the engine's use of them:
tests/engine/test_cpu_layer_kernels.py."""
from __future__ import annotations

import pytest
import torch

from raypaged.kernels import cpu_paged_decode
from raypaged.model.llama import RMSNorm, RotaryEmbedding, apply_rotary


@pytest.mark.parametrize("hidden", [576, 4096, 100])  # SmolLM2, Llama-3-8B, a tail past 8s
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_rms_norm_kernel_gives_the_bits_of_rmsnorm(hidden, rows):
    gen = torch.Generator().manual_seed(hidden + rows)
    norm = RMSNorm(hidden, 1e-5).bfloat16()
    norm.weight.data = (torch.randn(hidden, generator=gen) * 0.3 + 1).bfloat16()
    x = (torch.randn(rows, hidden, generator=gen) * 3).bfloat16()
    x[0, :7] = torch.tensor([0.0, -0.0, 1e-30, 3e4, -3e4, 1e-3, 65504.0])
    if rows > 1:
        x[1] = 0  # the mean is 0: 1/sqrt(eps) scales zeros
    expected = norm(x)
    assert torch.equal(cpu_paged_decode.rms_norm_bf16(x, norm.weight, norm.eps).view(torch.int16),
                       expected.view(torch.int16))


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_rotary_kernel_gives_the_bits_of_apply_rotary(head_dim, tokens):
    heads, kv_heads = 9, 3
    gen = torch.Generator().manual_seed(head_dim + tokens)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen) * 4).bfloat16()
    qk = qkv[:, :(heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)  # strided
    positions = torch.randint(0, 100_000, (tokens,), generator=gen)
    cos, sin = RotaryEmbedding(head_dim, 500_000.0, None).cos_sin(positions, torch.bfloat16)
    out = cpu_paged_decode.rotary_bf16(qk, cos, sin)
    assert out.is_contiguous()
    assert torch.equal(out.view(torch.int16), apply_rotary(qk, cos, sin).view(torch.int16))


def test_rotary_kernel_refuses_mismatched_tables():
    x = torch.zeros(2, 3, 64, dtype=torch.bfloat16)
    cos = torch.zeros(2, 1, 16, dtype=torch.bfloat16)  # D/2 would be 32
    with pytest.raises(RuntimeError, match=r"cos and sin \[T, 1, D/2\]"):
        cpu_paged_decode.rotary_bf16(x, cos, cos)

