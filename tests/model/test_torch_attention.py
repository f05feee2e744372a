"""TorchAttentionBackend against a naive per-token reference, over mixed paged batches, with
decode rows through the gather + SDPA path and through the C++ kernel that reads the cache in
place (raypaged.kernels.cpu_paged_decode)."""
from __future__ import annotations

import pytest
import torch

from raypaged.model.attention.base import LayerKVCache
from raypaged.kernels import cpu_paged_decode
from raypaged.model.attention.torch_backend import FP8_E4M3_MAX, TorchAttentionBackend
from paged_metadata import make_metadata, scattered_block_tables

HEAD_DIM = 32
NUM_BLOCKS = 64


@pytest.fixture(params=["gather", "cpp"])
def decode_kernel(request):
    """None (gather + SDPA) or the C++ decode kernel, built here (a test machine has g++)."""
    return cpu_paged_decode.paged_decode if request.param == "cpp" else None


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: int,
                        scale: float) -> torch.Tensor:
    """One sequence, one token at a time: q [n, H, D] at positions context..context+n-1 over
    k/v [context+n, Hkv, D] -> [n, H, D], computed in float64."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)  # [S, H, D]
    v = v.double().repeat_interleave(group, dim=1)
    out = []
    for i in range(q.shape[0]):
        visible = context + i + 1
        scores = torch.einsum("hd,shd->hs", q[i].double(), k[:visible]) * scale  # [H, visible]
        out.append(torch.einsum("hs,shd->hd", scores.softmax(-1), v[:visible]))
    return torch.stack(out).float()


def through_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """What an fp8 cache gives back for x."""
    return (x / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).float() * scale


def empty_cache(block_size: int, num_kv_heads: int, kv_dtype: str) -> LayerKVCache:
    dtype = torch.float8_e4m3fn if kv_dtype == "fp8" else torch.float32
    shape = (NUM_BLOCKS, block_size, num_kv_heads, HEAD_DIM)
    # Non-unit scales, so a reader that forgets them is caught.
    scales = (0.05, 0.02) if kv_dtype == "fp8" else (1.0, 1.0)
    return LayerKVCache(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype), *scales)


def run_step(seq_lens, query_lens, block_size, num_heads, num_kv_heads, kv_dtype,
             decode_kernel=None):
    """Write every sequence's cached prefix in an earlier step, then this step's K/V, then attend.
    Returns (ours, reference), both [T, H, D]."""
    gen = torch.Generator().manual_seed(block_size * 100 + num_heads)
    backend = TorchAttentionBackend(decode_kernel)
    cache = empty_cache(block_size, num_kv_heads, kv_dtype)
    tables = scattered_block_tables(seq_lens, block_size, NUM_BLOCKS, seed=block_size)
    ks = [torch.randn(s, num_kv_heads, HEAD_DIM, generator=gen) for s in seq_lens]
    vs = [torch.randn(s, num_kv_heads, HEAD_DIM, generator=gen) for s in seq_lens]
    contexts = [s - q for s, q in zip(seq_lens, query_lens)]

    prefix_meta = make_metadata(tables, contexts, contexts, block_size)
    if sum(contexts):
        backend.write_kv(torch.cat([k[:c] for k, c in zip(ks, contexts)]),
                         torch.cat([v[:c] for v, c in zip(vs, contexts)]), cache, prefix_meta)
    meta = make_metadata(tables, query_lens, seq_lens, block_size)
    backend.write_kv(torch.cat([k[c:] for k, c in zip(ks, contexts)]),
                     torch.cat([v[c:] for v, c in zip(vs, contexts)]), cache, meta)
    q = torch.randn(sum(query_lens), num_heads, HEAD_DIM, generator=gen)
    scale = HEAD_DIM ** -0.5
    ours = backend.attend(q, cache, meta, scale)

    expected, start = [], 0
    for k, v, c, n in zip(ks, vs, contexts, query_lens):
        if kv_dtype == "fp8":
            k, v = through_fp8(k, cache.k_scale), through_fp8(v, cache.v_scale)
        expected.append(reference_attention(q[start:start + n], k, v, c, scale))
        start += n
    return ours, torch.cat(expected)


@pytest.mark.parametrize("kv_dtype", ["fp32", "fp8"])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (8, 2)])  # GQA groups 1, 3, 4
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_mixed_batch_matches_per_token_reference(block_size, num_heads, num_kv_heads, kv_dtype,
                                                  decode_kernel):
    bs = block_size
    # decode at 2*bs (a full last block), a fresh prefill of bs+1, a decode at 1 token,
    # a chunk of 5 over a cached prefix of 3*bs-5 (ends on a block boundary), a decode at bs+1.
    seq_lens = [2 * bs, bs + 1, 1, 3 * bs, bs + 1]
    query_lens = [1, bs + 1, 1, 5, 1]
    ours, expected = run_step(seq_lens, query_lens, bs, num_heads, num_kv_heads, kv_dtype,
                              decode_kernel)
    assert ours.shape == expected.shape and ours.dtype == torch.float32
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_dtype", ["fp32", "fp8"])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_pure_decode_batch_matches_per_token_reference(block_size, kv_dtype, decode_kernel):
    seq_lens = [1, block_size, block_size + 1, 2 * block_size - 1, 3 * block_size]
    ours, expected = run_step(seq_lens, [1] * 5, block_size, 6, 2, kv_dtype, decode_kernel)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [8, 16])
def test_prefill_only_batch_matches_per_token_reference(block_size):
    seq_lens = [3 * block_size + 1, 2 * block_size, 7]
    query_lens = [block_size + 1, 2 * block_size, 7]  # one chunk over a cached prefix, two fresh
    ours, expected = run_step(seq_lens, query_lens, block_size, 8, 2, "fp32")
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


def test_write_kv_fills_exactly_the_mapped_slots_and_skips_padding():
    backend = TorchAttentionBackend()
    cache = empty_cache(block_size=4, num_kv_heads=2, kv_dtype="fp32")
    key = torch.arange(3 * 2 * HEAD_DIM, dtype=torch.float32).view(3, 2, HEAD_DIM) + 1
    meta = make_metadata([[5]], [2], [2], block_size=4)
    meta.slot_mapping = torch.tensor([21, -1, 22])  # row 1 is a padding row
    backend.write_kv(key, -key, cache, meta)
    flat_k = cache.key.view(-1, 2, HEAD_DIM)
    assert torch.equal(flat_k[21], key[0]) and torch.equal(flat_k[22], key[2])
    assert torch.equal(cache.value.view(-1, 2, HEAD_DIM)[22], -key[2])
    written = (flat_k != 0).any(dim=(1, 2)).nonzero().flatten().tolist()
    assert written == [21, 22]


def test_fp8_write_divides_by_scale_and_clamps_to_the_e4m3_range():
    backend = TorchAttentionBackend()
    cache = empty_cache(block_size=4, num_kv_heads=1, kv_dtype="fp8")  # k_scale 0.05
    key = torch.tensor([0.5, -1.0, 1e6, -1e6]).repeat(HEAD_DIM // 4).view(1, 1, HEAD_DIM)
    backend.write_kv(key, key, cache, make_metadata([[0]], [1], [1], block_size=4))
    stored = cache.key[0, 0, 0, :4].float()
    assert stored.tolist() == [10.0, -20.0, 448.0, -448.0]  # value / 0.05, clamped, not NaN


def test_padding_rows_with_zero_seq_len_come_back_zero(decode_kernel):
    backend = TorchAttentionBackend(decode_kernel)
    cache = empty_cache(block_size=8, num_kv_heads=2, kv_dtype="fp32")
    meta = make_metadata([[1], [2]], [1, 1], [3, 1], block_size=8)
    meta.seq_lens_cpu = [3, 0]  # sequence 1 is a CUDA-graph padding row
    meta.seq_lens = torch.tensor([3, 0], dtype=torch.int32)
    cache.key.normal_()
    cache.value.normal_()
    out = backend.attend(torch.randn(2, 4, HEAD_DIM), cache, meta, scale=0.1)
    assert out[0].abs().sum() > 0
    assert torch.equal(out[1], torch.zeros(4, HEAD_DIM))


def test_bfloat16_queries_and_cache_stay_close_to_the_fp32_result(decode_kernel):
    seq_lens, query_lens = [20, 9], [1, 9]
    ours32, _ = run_step(seq_lens, query_lens, 8, 6, 2, "fp32")
    gen = torch.Generator().manual_seed(8 * 100 + 6)  # same draws as run_step's
    backend = TorchAttentionBackend(decode_kernel)
    shape = (NUM_BLOCKS, 8, 2, HEAD_DIM)
    cache = LayerKVCache(torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16))
    tables = scattered_block_tables(seq_lens, 8, NUM_BLOCKS, seed=8)
    ks = [torch.randn(s, 2, HEAD_DIM, generator=gen) for s in seq_lens]
    vs = [torch.randn(s, 2, HEAD_DIM, generator=gen) for s in seq_lens]
    full = make_metadata(tables, seq_lens, seq_lens, 8)
    backend.write_kv(torch.cat(ks).bfloat16(), torch.cat(vs).bfloat16(), cache, full)
    q = torch.randn(10, 6, HEAD_DIM, generator=gen)
    out = backend.attend(q.bfloat16(), cache, make_metadata(tables, query_lens, seq_lens, 8), HEAD_DIM ** -0.5)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ours32, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16", "fp8"])
@pytest.mark.parametrize("head_dim", [24, 64, 80, 128])  # 64, 128 compiled for; the others at run time
def test_cpp_decode_kernel_matches_gather_path_across_head_dims(head_dim, kv_dtype):
    """Long sequences over many scattered blocks, GQA group 3, each head dim the kernel handles."""
    gen = torch.Generator().manual_seed(head_dim)
    block_size, num_blocks, seq_lens = 16, 96, [1, 17, 300, 512]
    query_dtype = torch.bfloat16 if kv_dtype == "bf16" else torch.float32
    cache_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}[kv_dtype]
    shape = (num_blocks, block_size, 2, head_dim)
    cache = LayerKVCache(torch.randn(shape, generator=gen).to(cache_dtype),
                         torch.randn(shape, generator=gen).to(cache_dtype),
                         *((0.5, 2.0) if kv_dtype == "fp8" else (1.0, 1.0)))
    meta = make_metadata(scattered_block_tables(seq_lens, block_size, num_blocks, seed=1),
                         [1] * 4, seq_lens, block_size)
    q = torch.randn(4, 6, head_dim, generator=gen).to(query_dtype)
    kernel = TorchAttentionBackend(cpu_paged_decode.paged_decode).attend(q, cache, meta, 0.125)
    gather = TorchAttentionBackend().attend(q, cache, meta, 0.125)
    assert kernel.dtype == query_dtype
    tol = 2e-2 if query_dtype == torch.bfloat16 else 1e-5  # bf16: one rounding of the output
    torch.testing.assert_close(kernel.float(), gather.float(), atol=tol, rtol=tol)


def test_cpp_decode_kernel_refuses_what_it_cannot_serve():
    """The engine asks `unsupported` first and keeps the gather path, with the reason, instead."""
    ok = dict(query_dtype=torch.bfloat16, cache_dtype=torch.bfloat16, num_heads=9,
              num_kv_heads=3, head_dim=64, block_size=16)
    assert cpu_paged_decode.unsupported(**ok) is None
    assert cpu_paged_decode.unsupported(**{**ok, "cache_dtype": torch.float8_e4m3fn}) is None
    assert "float16" in cpu_paged_decode.unsupported(**{**ok, "query_dtype": torch.float16,
                                                         "cache_dtype": torch.float16})
    assert "at most 16 per KV head" in cpu_paged_decode.unsupported(**{**ok, "num_heads": 51,
                                                                       "num_kv_heads": 3})
    assert "head dim 512" in cpu_paged_decode.unsupported(**{**ok, "head_dim": 512})


def test_engine_keeps_the_gather_path_with_a_warning_where_the_kernel_cannot_serve(
        monkeypatch, caplog):
    from types import SimpleNamespace

    from raypaged.model.setup import cpu_decode_kernel

    mcfg = SimpleNamespace(num_heads=6, num_kv_heads=2, head_dim=HEAD_DIM)
    cache = empty_cache(block_size=16, num_kv_heads=2, kv_dtype="fp32")
    assert cpu_decode_kernel(mcfg, torch.float32, cache.key.dtype, cache.block_size) is cpu_paged_decode.paged_decode
    assert cpu_decode_kernel(mcfg, torch.float16, cache.key.dtype, cache.block_size) is None  # a dtype it does not take
    assert "dtype torch.float16" in caplog.text and "--no-cpu-decode-kernel" in caplog.text

    def no_compiler():
        raise RuntimeError("the C++ decode attention could not be built (g++: not found)")
    monkeypatch.setattr(cpu_paged_decode, "load", no_compiler)
    caplog.clear()
    assert cpu_decode_kernel(mcfg, torch.float32, cache.key.dtype, cache.block_size) is None
    assert "g++: not found" in caplog.text
