"""The C++ bf16 RMSNorm (alone and after the residual add), rotary embedding and KV store
(kernels/cpu_layer_ops.cpp) give the bits of the torch ops they replace (raypaged.model.llama's
RMSNorm.add_norm and apply_rotary, TorchAttentionBackend.write_kv); the engine's use of them:
tests/engine/test_cpu_layer_kernels.py."""
from __future__ import annotations

import pytest
import torch
from paged_metadata import make_metadata

from raypaged.kernels import cpu_paged_decode
from raypaged.model.attention.base import LayerKVCache
from raypaged.model.attention.torch_backend import TorchAttentionBackend
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



@pytest.mark.parametrize("hidden", [576, 100])
@pytest.mark.parametrize("rows", [1, 300])
def test_add_rms_norm_kernel_gives_the_bits_of_the_add_and_the_norm(hidden, rows):
    gen = torch.Generator().manual_seed(hidden * rows)
    norm = RMSNorm(hidden, 1e-5).bfloat16()
    norm.weight.data = (torch.randn(hidden, generator=gen) * 0.3 + 1).bfloat16()
    x = (torch.randn(rows, hidden, generator=gen) * 3).bfloat16()
    delta = (torch.randn(rows, hidden, generator=gen) * 5).bfloat16()
    delta[0, :3] = -x[0, :3]  # sums of exactly 0
    total, normed = cpu_paged_decode.add_rms_norm_bf16(x, delta, norm.weight, norm.eps)
    expected_total, expected = norm.add_norm(x, delta)  # torch's ops: no add_kernel set
    assert torch.equal(total.view(torch.int16), expected_total.view(torch.int16))
    assert torch.equal(normed.view(torch.int16), expected.view(torch.int16))


def test_add_rms_norm_kernel_refuses_a_delta_of_another_shape():
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="delta shaped as x"):
        cpu_paged_decode.add_rms_norm_bf16(x, x[:1], torch.ones(64, dtype=torch.bfloat16), 1e-5)


def _cache(num_blocks: int, block_size: int, dtype: torch.dtype) -> LayerKVCache:
    shape = (num_blocks, block_size, 3, 64)
    return LayerKVCache(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_store_kernel_writes_the_slots_index_copy_writes_and_skips_padding(dtype):
    """key/value are strided views of one qkv row, as Attention.forward passes them; slot -1 rows
    (padding) stay unwritten."""
    gen = torch.Generator().manual_seed(7)
    qkv = torch.randn(5, (9 + 2 * 3) * 64, generator=gen).to(dtype)
    key = qkv[:, 9 * 64:12 * 64].view(5, 3, 64)
    value = qkv[:, 12 * 64:].view(5, 3, 64)
    meta = make_metadata([[2, 0], [1]], [4, 1], [4, 1], block_size=4)  # 4 prefill + 1 decode
    meta.slot_mapping[2] = -1  # a padding row in the middle
    kernel, torch_ops = _cache(4, 4, dtype), _cache(4, 4, dtype)
    TorchAttentionBackend(store_kernel=cpu_paged_decode.store_kv).write_kv(key, value, kernel, meta)
    TorchAttentionBackend().write_kv(key, value, torch_ops, meta)
    assert torch.equal(kernel.key, torch_ops.key) and torch.equal(kernel.value, torch_ops.value)
    written = (kernel.key != 0).any(dim=-1).any(dim=-1).flatten().nonzero().flatten().tolist()
    assert written == sorted(s for s in meta.slot_mapping.tolist() if s >= 0)


def test_store_kernel_refuses_a_slot_outside_the_cache():
    cache = _cache(2, 4, torch.bfloat16)
    kv = torch.ones(1, 3, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="slot 8 outside the cache's 8"):
        cpu_paged_decode.store_kv(kv, kv, cache.key, cache.value, torch.tensor([8]))
