"""paged_decode against the torch reference: GQA groups, head dims, page sizes, dtypes, split-K."""
from __future__ import annotations

import pytest
import torch

from raypaged.kernels.paged_decode import DecodeWorkspace, choose_num_splits, paged_decode
from benchmarks.kernel_reference import make_paged_batch, paged_attention_ref

NUM_KV_HEADS = 2
FP16, FP32, FP8 = torch.float16, torch.float32, torch.float8_e4m3fn
TOL = {FP16: dict(atol=3e-3, rtol=1e-2), FP32: dict(atol=1e-5, rtol=1e-5)}
NAMES = {FP16: "fp16", FP32: "fp32", FP8: "fp8"}


def case_id(v):
    return NAMES.get(v, str(v))


def decode_batch(group, head_dim, block_size, dtype, kv_dtype, num_padding=1, seed=0):
    # Context lengths: a multiple of the page size, one more than that, a single token, and one
    # spanning three 64-position KV tiles; plus a padding row (seq_len 0).
    seq_lens = [4 * block_size, 4 * block_size + 1, 1, 129]
    return make_paged_batch([s - 1 for s in seq_lens], [1] * len(seq_lens),
                            NUM_KV_HEADS * group, NUM_KV_HEADS, head_dim, block_size, dtype,
                            kv_dtype, num_padding=num_padding, seed=seed)


def reference(batch, scale):
    return paged_attention_ref(batch.query, batch.key_cache, batch.value_cache,
                               batch.query_start_loc, batch.seq_lens, batch.block_tables, scale,
                               batch.k_scale, batch.v_scale)


def run(batch, scale, **kw):
    return paged_decode(batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
                        batch.seq_lens, scale, batch.k_scale, batch.v_scale, **kw)


# A pruned cross product: every group size, head dim, page size, dtype and split path appears,
# not every combination.
@pytest.mark.parametrize("group,head_dim,block_size,dtype,kv_dtype,num_splits", [
    (1, 64, 16, FP16, FP16, 1),
    (3, 128, 8, FP32, FP32, 1),
    (4, 64, 32, FP16, FP16, 3),
    (8, 128, 16, FP16, FP8, 2),
    (4, 128, 8, FP32, FP8, 1),
    (8, 64, 8, FP32, FP32, 4),
    (3, 64, 32, FP16, FP8, 16),  # more splits than tiles: some splits are empty
    (1, 128, 32, FP32, FP32, 2),
], ids=case_id)
def test_decode_matches_reference(group, head_dim, block_size, dtype, kv_dtype, num_splits):
    batch = decode_batch(group, head_dim, block_size, dtype, kv_dtype)
    scale = head_dim ** -0.5
    out = run(batch, scale, num_splits=num_splits)
    assert out.dtype == dtype and out.shape == batch.query.shape
    torch.testing.assert_close(out, reference(batch, scale), **TOL[dtype])
    assert bool((out[-1] == 0).all()), "the padding row must come out as zeros"


def test_split_and_unsplit_agree_and_reuse_a_larger_workspace():
    batch = decode_batch(4, 64, 16, FP32, FP32)
    scale = 0.125
    workspace = DecodeWorkspace.allocate(max_batch=16, num_heads=8, head_dim=64, device="cpu")
    workspace.part_out.fill_(float("nan"))  # stale scratch must never leak into results
    workspace.part_lse.fill_(float("nan"))
    out = torch.full_like(batch.query, float("nan"))
    split = run(batch, scale, num_splits=5, workspace=workspace, out=out)
    assert split.data_ptr() == out.data_ptr()
    again = run(batch, scale, num_splits=5, workspace=workspace)
    torch.testing.assert_close(split, run(batch, scale, num_splits=1), atol=1e-6, rtol=1e-6)
    assert torch.equal(split, again)


def test_a_batch_of_only_padding_rows_is_all_zeros():
    batch = make_paged_batch([], [], 8, 2, 64, 16, FP16, num_padding=3)
    for splits in (1, 2):
        assert bool((run(batch, 0.125, num_splits=splits) == 0).all())


@pytest.mark.parametrize("num_seqs,num_kv_heads,max_seq_len,num_sms,expected", [
    (64, 8, 8192, 132, 1),      # 512 programs already fill 132 SMs
    (1, 8, 8192, 132, 16),      # 8 programs: split as deep as the workspace allows
    (16, 8, 8192, 132, 3),      # 128 programs: aim for >= 2 per SM
    (1, 8, 512, 132, 2),        # short context: each split keeps >= 256 positions
    (1, 8, 100, 132, 1),
    (0, 8, 100, 132, 1),
])
def test_split_rule(num_seqs, num_kv_heads, max_seq_len, num_sms, expected):
    assert choose_num_splits(num_seqs, num_kv_heads, max_seq_len, num_sms) == expected
