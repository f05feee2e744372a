"""The kernel checks of tests/kernels, compiled for CUDA, plus what only a GPU shows: bf16, the
hardware fp8 cast, and split-K decode captured in a CUDA graph.

Skipped without CUDA, and under TRITON_INTERPRET (tests/kernels/conftest.py sets it for the
whole process, so run this folder on its own: `pytest tests/gpu`). The kernels are loaded by
path (benchmarks/_kernels.py), so this also runs on a GPU box with torch + triton and the
checkout on PYTHONPATH but no raypaged install; the backend test then skips.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") or not torch.cuda.is_available():
    pytest.skip("needs CUDA, compiled (not under TRITON_INTERPRET)", allow_module_level=True)
pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import kernel_reference as ref  # noqa: E402
from benchmarks._kernels import kernel_module  # noqa: E402

decode_k = kernel_module("paged_decode")
prefill_k = kernel_module("paged_prefill")
store_k = kernel_module("store_kv")

FP16, BF16, FP32, FP8 = torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn
TOL = {FP16: dict(atol=3e-3, rtol=1e-2), BF16: dict(atol=2e-2, rtol=2e-2),
       FP32: dict(atol=1e-4, rtol=1e-4)}
NAMES = {FP16: "fp16", BF16: "bf16", FP32: "fp32", FP8: "fp8"}
KV_HEADS = 2
# Triton has no e4m3 type below sm_89 (the engine refuses fp8 there: gpu_support.py).
FP8_ON_THIS_GPU = torch.cuda.get_device_capability() >= (8, 9)


@pytest.fixture(autouse=True)
def _skip_fp8_cases_below_sm89(request):
    callspec = getattr(request.node, "callspec", None)
    if not FP8_ON_THIS_GPU and callspec and FP8 in callspec.params.values():
        pytest.skip("fp8 e4m3 needs compute capability >= 8.9")


def case_id(v):
    return NAMES.get(v, str(v))


def same_bytes(a, b):
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def attention_ref(b, scale):
    return ref.paged_attention_ref(b.query, b.key_cache, b.value_cache, b.query_start_loc,
                                   b.seq_lens, b.block_tables, scale, b.k_scale, b.v_scale)


@pytest.mark.parametrize("dtype,cache_dtype,block_size,num_kv_heads,head_dim", [
    (FP16, FP16, 8, 1, 64), (BF16, BF16, 16, 8, 128), (FP32, FP32, 32, 3, 64),
    (BF16, FP8, 16, 8, 128), (FP16, FP8, 32, 2, 64), (FP32, FP8, 8, 4, 128),
], ids=case_id)
def test_store_kv_matches_reference(dtype, cache_dtype, block_size, num_kv_heads, head_dim):
    gen = torch.Generator(device="cuda").manual_seed(0)
    num_blocks = 16
    qkv = torch.randn(40, (2 + 2 * num_kv_heads) * head_dim, device="cuda", generator=gen) * 2
    k, v = qkv.to(dtype)[:, 2 * head_dim:].split(num_kv_heads * head_dim, dim=1)
    k, v = k.view(40, num_kv_heads, head_dim), v.view(40, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, device="cuda", generator=gen)[:40]
    slots[::7] = -1
    scales = (0.011, 0.007) if cache_dtype == FP8 else (1.0, 1.0)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    caches = [torch.full(shape, 3.0, device="cuda").to(cache_dtype) for _ in range(4)]
    store_k.store_kv(k, v, caches[0], caches[1], slots, *scales)
    ref.store_kv_ref(k, v, caches[2], caches[3], slots, *scales)
    if cache_dtype != FP8:
        assert same_bytes(caches[0], caches[2]) and same_bytes(caches[1], caches[3])
        return
    # value / scale may differ from torch's by an fp32 ulp if the GPU divides approximately,
    # which can move a value sitting on an e4m3 rounding boundary to the neighbouring code.
    for ours, theirs in ((caches[0], caches[2]), (caches[1], caches[3])):
        codes = (ours.view(torch.uint8).int() - theirs.view(torch.uint8).int()).abs()
        assert codes.max().item() <= 1 and codes.bool().float().mean().item() < 1e-3


@pytest.mark.skipif(not FP8_ON_THIS_GPU, reason="fp8 e4m3 needs compute capability >= 8.9")
def test_fp8_store_rounds_like_torch_on_every_tie():
    grid = torch.arange(0, 127, dtype=torch.uint8).view(FP8).float()
    mid = (grid[1:] + grid[:-1]) / 2
    values = torch.cat([grid, mid, mid.nextafter(torch.tensor(0.0)),
                        mid.nextafter(torch.tensor(1e9)), torch.tensor([449.0, 500.0, 1e6])])
    values = torch.cat([values, -values])
    values = torch.cat([values, values.new_zeros(-len(values) % 64)]).cuda()
    rows = values.view(-1, 1, 64)
    slots = torch.arange(rows.shape[0], device="cuda")
    kc = torch.zeros(rows.shape[0], 1, 1, 64, dtype=FP8, device="cuda")
    vc = torch.zeros_like(kc)
    store_k.store_kv(rows, rows, kc, vc, slots, 1.0, 1.0)
    ours, torchs = kc.view(-1).view(torch.uint8), values.clamp(-448, 448).to(FP8).view(torch.uint8)
    wrong = (ours != torchs).nonzero().flatten().tolist()
    assert wrong == [], "value -> our byte / torch's byte: " + ", ".join(
        f"{values[i].item()!r} -> {ours[i].item():#04x} / {torchs[i].item():#04x}" for i in wrong[:20])


@pytest.mark.parametrize("group,head_dim,block_size,dtype,kv_dtype,num_splits", [
    (1, 64, 16, FP16, FP16, 1), (3, 128, 8, FP32, FP32, 1), (4, 64, 32, BF16, BF16, 3),
    (8, 128, 16, BF16, FP8, 2), (4, 128, 8, FP16, FP8, 1), (8, 64, 8, BF16, BF16, 4),
    (3, 64, 32, BF16, FP8, 16), (1, 128, 32, FP32, FP32, 2), (4, 128, 16, BF16, BF16, 8),
    (8, 128, 16, BF16, BF16, 1),
], ids=case_id)
def test_decode_matches_reference(group, head_dim, block_size, dtype, kv_dtype, num_splits):
    seq_lens = [4 * block_size, 4 * block_size + 1, 1, 129, 1000]
    b = ref.make_paged_batch([s - 1 for s in seq_lens], [1] * len(seq_lens), KV_HEADS * group,
                             KV_HEADS, head_dim, block_size, dtype, kv_dtype, device="cuda",
                             num_padding=1)
    scale = head_dim ** -0.5
    out = decode_k.paged_decode(b.query, b.key_cache, b.value_cache, b.block_tables, b.seq_lens,
                                scale, b.k_scale, b.v_scale, num_splits=num_splits)
    torch.testing.assert_close(out, attention_ref(b, scale), **TOL[dtype])
    assert bool((out[-1] == 0).all())


@pytest.mark.parametrize("group,head_dim,block_size,dtype,kv_dtype", [
    (1, 64, 16, FP16, FP16), (3, 128, 8, FP32, FP32), (4, 64, 32, BF16, FP8),
    (8, 128, 16, BF16, BF16), (8, 64, 8, FP16, FP8), (4, 128, 16, BF16, BF16),
], ids=case_id)
def test_prefill_matches_reference_on_a_mixed_batch(group, head_dim, block_size, dtype, kv_dtype):
    bs = block_size
    b = ref.make_paged_batch([0, 4 * bs, 2 * bs + 1, 40, 0, 300], [300, 5, 17, 1, 1, 129],
                             KV_HEADS * group, KV_HEADS, head_dim, block_size, dtype, kv_dtype,
                             device="cuda", num_padding=1)
    scale = head_dim ** -0.5
    out = prefill_k.paged_prefill(b.query, b.key_cache, b.value_cache, b.block_tables,
                                  b.query_start_loc, b.seq_lens, b.max_query_len, scale,
                                  b.k_scale, b.v_scale)
    torch.testing.assert_close(out, attention_ref(b, scale), **TOL[dtype])
    assert bool((out[-1] == 0).all())


def test_split_k_decode_replays_from_a_cuda_graph():
    """Capture once with the workspace given, then change the step's data and replay."""
    b = ref.make_paged_batch([700, 33, 0], [1, 1, 1], 32, 8, 128, 16, BF16, device="cuda")
    workspace = decode_k.DecodeWorkspace.allocate(4, 32, 128, "cuda")
    out = torch.empty_like(b.query)
    args = (b.query, b.key_cache, b.value_cache, b.block_tables, b.seq_lens, 0.088)

    def run():
        decode_k.paged_decode(*args, num_splits=5, workspace=workspace, out=out)

    run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    b.query.normal_()
    b.seq_lens.copy_(torch.tensor([650, 34, 12], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, attention_ref(b, 0.088), **TOL[BF16])


def test_triton_backend_matches_the_torch_backend_on_cuda():
    triton_backend = pytest.importorskip("raypaged.model.attention.triton_backend")
    from raypaged.model.attention.base import AttentionMetadata, LayerKVCache
    from raypaged.model.attention.torch_backend import TorchAttentionBackend

    for kv_dtype, scales in ((BF16, (1.0, 1.0)), (FP8, (0.02, 0.015)))[:2 if FP8_ON_THIS_GPU else 1]:
        shape = (64, 16, 8, 128)
        caches = [LayerKVCache(torch.zeros(shape, dtype=kv_dtype, device="cuda"),
                               torch.zeros(shape, dtype=kv_dtype, device="cuda"), *scales)
                  for _ in range(2)]
        backends = (triton_backend.TritonAttentionBackend(), TorchAttentionBackend())
        tables = [list(range(0, 30)), list(range(30, 34))]
        for query_lens, seq_lens in (([400, 50], [400, 50]), ([1, 1], [401, 51])):
            slots = [t[p // 16] * 16 + p % 16 for t, q, s in zip(tables, query_lens, seq_lens)
                     for p in range(s - q, s)]
            meta = AttentionMetadata(
                slot_mapping=torch.tensor(slots, device="cuda"),
                query_start_loc=torch.tensor([0, query_lens[0], sum(query_lens)],
                                             dtype=torch.int32, device="cuda"),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
                block_tables=torch.tensor([t + [0] * (30 - len(t)) for t in tables],
                                          dtype=torch.int32, device="cuda"),
                max_query_len=max(query_lens), max_seq_len=max(seq_lens),
                query_lens_cpu=query_lens, seq_lens_cpu=seq_lens)
            T = len(slots)
            k, v = (torch.randn(T, 8, 128, device="cuda", dtype=BF16) for _ in range(2))
            q = torch.randn(T, 32, 128, device="cuda", dtype=BF16)
            outs = []
            for backend, cache in zip(backends, caches):
                backend.write_kv(k, v, cache, meta)
                outs.append(backend.attend(q, cache, meta, 0.088))
            torch.testing.assert_close(outs[0], outs[1], **TOL[BF16])
