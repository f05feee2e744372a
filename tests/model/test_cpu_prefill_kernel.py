"""The C++ bf16 prefill attention (kernels/cpu_paged_prefill.cpp) against a float64 per-token
reference and against the SDPA path it replaces, over scattered paged blocks; and the engine's
choice of it (model/setup.py cpu_prefill_kernel)."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from paged_metadata import make_metadata, scattered_block_tables
from raypaged.kernels import cpu_paged_decode
from raypaged.model.attention.base import LayerKVCache
from raypaged.model.attention.torch_backend import TorchAttentionBackend
from test_torch_attention import reference_attention

NUM_BLOCKS = 160


def has_avx512_bf16() -> bool:
    try:
        return " avx512_bf16" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


needs_bf16_dot = pytest.mark.skipif(not has_avx512_bf16(), reason="the kernel needs AVX512-BF16")


def paged_step(seq_lens, query_lens, block_size, num_heads, num_kv_heads, head_dim, seed=0):
    """A bf16 cache holding every sequence's tokens in scattered blocks, this step's queries and
    metadata, and the float64 reference output per sequence."""
    gen = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, block_size, num_kv_heads, head_dim)
    cache = LayerKVCache(torch.zeros(shape, dtype=torch.bfloat16),
                         torch.zeros(shape, dtype=torch.bfloat16))
    tables = scattered_block_tables(seq_lens, block_size, NUM_BLOCKS, seed=seed)
    ks = [torch.randn(s, num_kv_heads, head_dim, generator=gen).bfloat16() for s in seq_lens]
    vs = [torch.randn(s, num_kv_heads, head_dim, generator=gen).bfloat16() for s in seq_lens]
    TorchAttentionBackend().write_kv(torch.cat(ks), torch.cat(vs), cache,
                                     make_metadata(tables, seq_lens, seq_lens, block_size))
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).bfloat16()
    scale = head_dim ** -0.5
    expected, start = [], 0
    for k, v, s, n in zip(ks, vs, seq_lens, query_lens):
        expected.append(reference_attention(q[start:start + n], k, v, s - n, scale))
        start += n
    meta = make_metadata(tables, query_lens, seq_lens, block_size)
    return cache, q, meta, scale, torch.cat(expected)


@needs_bf16_dot
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (4, 4), (16, 1)])  # groups 3, 1, 16
@pytest.mark.parametrize("block_size", [8, 16])
def test_prefill_kernel_matches_float64_reference(head_dim, num_heads, num_kv_heads, block_size):
    # fresh prompts of 2 tokens, of 37 (a ragged query tile) and of 300 (ten key chunks, 19
    # tiles); chunks of 50 over a cached 70 and of 33 over a cached 256 (chunk ends off and on
    # a key-chunk boundary)
    seq_lens, query_lens = [2, 37, 300, 120, 289], [2, 37, 300, 50, 33]
    cache, q, meta, scale, expected = paged_step(seq_lens, query_lens, block_size, num_heads,
                                                 num_kv_heads, head_dim, seed=head_dim + num_heads)
    kernel = TorchAttentionBackend(prefill_kernel=cpu_paged_decode.paged_prefill)
    ours = kernel.attend(q, cache, meta, scale)
    sdpa = TorchAttentionBackend().attend(q, cache, meta, scale)
    assert ours.dtype == torch.bfloat16 and ours.shape == q.shape
    # bf16: the output rounded once and the probabilities once (as GPU flash attention does)
    torch.testing.assert_close(ours.float(), expected, atol=2e-2, rtol=2e-2)
    err, sdpa_err = (ours.float() - expected).abs().max(), (sdpa.float() - expected).abs().max()
    assert err <= 2 * sdpa_err, (err, sdpa_err)  # no worse than SDPA's own bf16 error, twice over


@needs_bf16_dot
def test_mixed_step_sends_only_prefill_chunks_to_the_prefill_kernel():
    """Decode rows still go through the decode kernel; prefill rows land at their own offsets."""
    seq_lens, query_lens = [40, 65, 1, 200, 18], [1, 65, 1, 70, 1]
    cache, q, meta, scale, expected = paged_step(seq_lens, query_lens, 16, 9, 3, 64, seed=7)
    calls = []

    def counted(query, *args):
        calls.append(query.shape[0])
        return cpu_paged_decode.paged_prefill(query, *args)
    backend = TorchAttentionBackend(cpu_paged_decode.paged_decode, counted)
    ours = backend.attend(q, cache, meta, scale)
    assert calls == [65, 70]  # one call per prefill chunk, in batch order
    torch.testing.assert_close(ours.float(), expected, atol=2e-2, rtol=2e-2)


@needs_bf16_dot
def test_prefill_kernel_refuses_inputs_it_cannot_read():
    cache, q, meta, scale, _ = paged_step([20], [20], 16, 9, 3, 64)
    table = meta.block_tables[0]
    with pytest.raises(RuntimeError, match="bf16 query and cache"):
        cpu_paged_decode.paged_prefill(q.float(), cache.key, cache.value, table, 20, scale)
    with pytest.raises(RuntimeError, match="must cover seq_len"):
        cpu_paged_decode.paged_prefill(q, cache.key, cache.value, table[:1], 20, scale)
    with pytest.raises(RuntimeError, match="must cover seq_len"):
        cpu_paged_decode.paged_prefill(q, cache.key, cache.value, table, 19, scale)  # n > seq_len


def test_prefill_unsupported_names_the_reason():
    ok = dict(query_dtype=torch.bfloat16, cache_dtype=torch.bfloat16, num_heads=9,
              num_kv_heads=3, head_dim=64)
    assert cpu_paged_decode.prefill_unsupported(**ok) is None
    assert cpu_paged_decode.prefill_unsupported(**{**ok, "head_dim": 128}) is None
    assert "bf16 only" in cpu_paged_decode.prefill_unsupported(
        **{**ok, "query_dtype": torch.float32, "cache_dtype": torch.float32})
    assert "bf16 only" in cpu_paged_decode.prefill_unsupported(
        **{**ok, "cache_dtype": torch.float8_e4m3fn})
    assert "head dim 80 (64 or 128)" == cpu_paged_decode.prefill_unsupported(**{**ok, "head_dim": 80})
    assert "at most 16 per KV head" in cpu_paged_decode.prefill_unsupported(
        **{**ok, "num_heads": 51, "num_kv_heads": 3})


def test_engine_keeps_sdpa_for_prefill_where_the_kernel_does_not_apply(monkeypatch, caplog):
    from raypaged.model.setup import cpu_prefill_kernel

    mcfg = SimpleNamespace(num_heads=9, num_kv_heads=3, head_dim=64)
    caplog.set_level("INFO")
    assert cpu_prefill_kernel(mcfg, torch.float32, torch.float32) is None  # by design: info only
    assert "bf16 only" in caplog.text and "WARNING" not in caplog.text
    monkeypatch.setattr(cpu_paged_decode, "prefill_built", lambda: False)  # a CPU without it
    caplog.clear()
    assert cpu_prefill_kernel(mcfg, torch.bfloat16, torch.bfloat16) is None
    assert "no AVX512-BF16" in caplog.text and "--no-cpu-prefill-kernel" in caplog.text

    def no_compiler():
        raise RuntimeError("the C++ attention kernels could not be built (g++: not found)")
    monkeypatch.setattr(cpu_paged_decode, "prefill_built", no_compiler)
    caplog.clear()
    assert cpu_prefill_kernel(mcfg, torch.bfloat16, torch.bfloat16) is None
    assert "g++: not found" in caplog.text


@needs_bf16_dot
def test_engine_takes_the_kernel_for_a_bf16_model_on_this_cpu():
    from raypaged.model.setup import cpu_prefill_kernel

    mcfg = SimpleNamespace(num_heads=9, num_kv_heads=3, head_dim=64)
    assert cpu_prefill_kernel(mcfg, torch.bfloat16, torch.bfloat16) is cpu_paged_decode.paged_prefill
