"""paged_prefill against the torch reference over batches that mix fresh prompts, extends after
a cached prefix, decode rows and padding, in one launch."""
from __future__ import annotations

import pytest
import torch

from raypaged.kernels.paged_decode import paged_decode
from raypaged.kernels.paged_prefill import paged_prefill
from benchmarks.kernel_reference import make_paged_batch, paged_attention_ref

NUM_KV_HEADS = 2
FP16, FP32, FP8 = torch.float16, torch.float32, torch.float8_e4m3fn
TOL = {FP16: dict(atol=3e-3, rtol=1e-2), FP32: dict(atol=1e-5, rtol=1e-5)}
NAMES = {FP16: "fp16", FP32: "fp32", FP8: "fp8"}


def case_id(v):
    return NAMES.get(v, str(v))


def mixed_batch(group, head_dim, block_size, dtype, kv_dtype):
    bs = block_size
    context_lens = [0,   4 * bs, 2 * bs + 1, 40, 0]
    query_lens = [70,  5,      17,         1,  1]
    #             |    |       |           |   a one-token prompt
    #             |    |       |           a decode row
    #             |    |       extend after a partly filled page
    #             |    extend after whole pages
    #             a fresh prompt over several query tiles (BLOCK_M = 64 // group)
    return make_paged_batch(context_lens, query_lens, NUM_KV_HEADS * group, NUM_KV_HEADS,
                            head_dim, block_size, dtype, kv_dtype, num_padding=1)


def run(batch, scale):
    return paged_prefill(batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
                         batch.query_start_loc, batch.seq_lens, batch.max_query_len, scale,
                         batch.k_scale, batch.v_scale)


def reference(batch, scale):
    return paged_attention_ref(batch.query, batch.key_cache, batch.value_cache,
                               batch.query_start_loc, batch.seq_lens, batch.block_tables, scale,
                               batch.k_scale, batch.v_scale)


@pytest.mark.parametrize("group,head_dim,block_size,dtype,kv_dtype", [
    (1, 64, 16, FP16, FP16),
    (3, 128, 8, FP32, FP32),
    (4, 64, 32, FP16, FP8),
    (8, 128, 16, FP16, FP16),
    (8, 64, 8, FP32, FP8),
    (1, 256, 16, FP16, FP8),  # the fp8 tile above head dim 128 (BLOCK_N 16)
    (1, 128, 32, FP32, FP32),  # the fp32 tile at head dim 128 (BLOCK_N 16)
    (5, 256, 8, FP32, FP32),   # fp32 at head dim 256 (2 stages)
], ids=case_id)
def test_prefill_matches_reference_on_a_mixed_batch(group, head_dim, block_size, dtype, kv_dtype):
    batch = mixed_batch(group, head_dim, block_size, dtype, kv_dtype)
    scale = head_dim ** -0.5
    out = run(batch, scale)
    assert out.dtype == dtype and out.shape == batch.query.shape
    torch.testing.assert_close(out, reference(batch, scale), **TOL[dtype])
    assert bool((out[-1] == 0).all()), "the padding row must come out as zeros"


def test_prefill_of_decode_rows_matches_the_decode_kernel():
    batch = make_paged_batch([31, 16, 0], [1, 1, 1], 8, 2, 64, 16, FP32, num_padding=1)
    prefill = run(batch, 0.125)
    decode = paged_decode(batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
                          batch.seq_lens, 0.125, num_splits=1)
    torch.testing.assert_close(prefill, decode, atol=1e-6, rtol=1e-6)


def test_each_token_sees_only_its_past():
    # Changing the cache at the last position must change only the last query's output.
    batch = make_paged_batch([3], [20], 4, 4, 64, 8, FP32)
    before = run(batch, 0.125)
    last = batch.seq_lens[0].item() - 1
    page = batch.block_tables[0, last // 8]
    batch.value_cache[page, last % 8] += 10.0
    after = run(batch, 0.125)
    assert torch.equal(before[:-1], after[:-1])
    assert not torch.allclose(before[-1], after[-1])
