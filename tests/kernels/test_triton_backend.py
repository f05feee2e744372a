"""The whole TritonAttentionBackend on CPU (interpreted): write_kv then attend, step after step,
against the torch backend and the kernels' reference."""
from __future__ import annotations

import pytest
import torch

from benchmarks.kernel_reference import paged_attention_ref
from raypaged.model.attention.base import AttentionMetadata, LayerKVCache
from raypaged.model.attention.torch_backend import TorchAttentionBackend
from raypaged.model.attention.triton_backend import TritonAttentionBackend

BLOCK_SIZE = 16
NUM_BLOCKS = 48
HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64


def metadata(tables: list[list[int]], query_lens: list[int],
             seq_lens: list[int]) -> AttentionMetadata:
    """Sequence b computes its last query_lens[b] of seq_lens[b] positions; seq_len 0 = padding."""
    slots, starts = [], [0]
    for table, q, s in zip(tables, query_lens, seq_lens):
        slots += ([table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(s - q, s)]
                  if s else [-1] * q)
        starts.append(starts[-1] + q)
    width = max(len(t) for t in tables)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_lens_cpu=list(query_lens), seq_lens_cpu=list(seq_lens))


def caches(kv_dtype: torch.dtype) -> tuple[LayerKVCache, LayerKVCache]:
    shape = (NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    scales = (0.02, 0.015) if kv_dtype == torch.float8_e4m3fn else (1.0, 1.0)
    make = lambda: LayerKVCache(torch.zeros(shape, dtype=kv_dtype),  # noqa: E731
                                torch.zeros(shape, dtype=kv_dtype), *scales)
    return make(), make()


def step(backends, caches_, meta, gen, dtype=torch.float32):
    """One layer step on both backends with the same new K/V and queries; returns both outputs."""
    T = meta.slot_mapping.shape[0]
    k = torch.randn(T, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    v = torch.randn(T, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    q = torch.randn(T, HEADS, HEAD_DIM, generator=gen).to(dtype)
    outs = []
    for backend, cache in zip(backends, caches_):
        backend.write_kv(k, v, cache, meta)
        outs.append(backend.attend(q, cache, meta, HEAD_DIM ** -0.5))
    return q, outs


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float8_e4m3fn], ids=["fp32", "fp8"])
def test_prefill_then_decode_steps_match_the_torch_backend(kv_dtype):
    gen = torch.Generator().manual_seed(0)
    triton_backend = TritonAttentionBackend(max_num_seqs=4)
    backends = (triton_backend, TorchAttentionBackend())
    cs = caches(kv_dtype)
    # Scattered pages: sequence 0 owns 20 pages (long enough to split), sequence 1 owns 3.
    order = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    tables = [order[:20], order[20:23]]

    # Step 1, chunked prefill of a long prompt beside a short one; step 2, both extend.
    for query_lens, seq_lens in (([250, 30], [250, 30]), ([60, 1], [310, 31])):
        meta = metadata(tables, query_lens, seq_lens)
        _, (ours, torch_out) = step(backends, cs, meta, gen)
        torch.testing.assert_close(ours, torch_out, atol=1e-4, rtol=1e-4)
    assert bool((cs[0].key.float() == cs[1].key.float()).all()), "caches diverged"

    # Decode steps, with split-K: sequence 0 is past 256 positions.
    for s0, s1 in ((311, 32), (312, 33)):
        meta = metadata(tables, [1, 1], [s0, s1])
        assert triton_backend.num_splits(2, KV_HEADS, meta.max_seq_len, torch.device("cpu")) > 1
        q, (ours, torch_out) = step(backends, cs, meta, gen)
        torch.testing.assert_close(ours, torch_out, atol=1e-4, rtol=1e-4)
        ref = paged_attention_ref(q, cs[0].key, cs[0].value, meta.query_start_loc, meta.seq_lens,
                                  meta.block_tables, HEAD_DIM ** -0.5, cs[0].k_scale, cs[0].v_scale)
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    workspace = triton_backend.workspace(2, HEADS, HEAD_DIM, torch.device("cpu"))
    assert workspace.max_batch == 4, "the workspace is allocated once, for max_num_seqs"


def test_a_padded_decode_batch_writes_nothing_for_padding_and_returns_zeros():
    gen = torch.Generator().manual_seed(1)
    backend = TritonAttentionBackend(max_num_seqs=8)
    cache, _ = caches(torch.float16)
    meta = metadata([[3, 4], [0], [0]], [1, 1, 1], [20, 0, 0])  # two CUDA-graph padding rows
    before = cache.key.clone()
    q, (out,) = step([backend], [cache], meta, gen, dtype=torch.float16)
    assert bool((out[1:] == 0).all())
    changed = (cache.key != before).any(dim=(2, 3)).nonzero().tolist()
    assert changed == [[4, 3]], "only position 19 (page 4, slot 3) may be written"


def test_split_k_can_be_switched_off():
    backend = TritonAttentionBackend(split_k=False)
    assert backend.num_splits(1, 1, 100_000, torch.device("cpu")) == 1
