"""The C++ decode attention's bf16 path (kernels/cpu_paged_decode_bf16.cpp: a bf16 query over a
bf16 cache on AVX512-BF16) against a float64 per-token reference, over scattered paged blocks:
sequences that end inside, at and just past a 16-key group, and groups that span blocks (block
size 8), fill one (16) or fill half of one (32)."""
from __future__ import annotations

import pytest
import torch

from raypaged.kernels import cpu_paged_decode
from raypaged.model.attention.torch_backend import TorchAttentionBackend
from test_cpu_prefill_kernel import needs_bf16_dot, paged_step

SEQ_LENS = [1, 15, 16, 17, 33, 300, 513]


@needs_bf16_dot
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (4, 4), (16, 1)])  # groups 3, 1, 16
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_bf16_decode_matches_float64_reference(head_dim, num_heads, num_kv_heads, block_size):
    cache, q, meta, scale, expected = paged_step(SEQ_LENS, [1] * len(SEQ_LENS), block_size,
                                                 num_heads, num_kv_heads, head_dim,
                                                 seed=head_dim + num_heads + block_size)
    ours = cpu_paged_decode.paged_decode(q, cache.key, cache.value, meta.block_tables,
                                         meta.seq_lens, scale)
    sdpa = TorchAttentionBackend().attend(q, cache, meta, scale)  # the gather + SDPA path
    assert ours.dtype == torch.bfloat16 and ours.shape == q.shape
    # bf16: the output rounded once; the scores and probabilities stay in fp32
    torch.testing.assert_close(ours.float(), expected, atol=1e-2, rtol=1e-2)
    err, sdpa_err = (ours.float() - expected).abs().max(), (sdpa.float() - expected).abs().max()
    assert err <= 1.5 * sdpa_err, (err, sdpa_err)


@needs_bf16_dot
def test_bf16_decode_reads_only_each_sequences_own_keys():
    """A key past a sequence's length, in the tail of its last group, must not count: poison
    every cache slot no sequence owns, and the output stays finite and equal to the reference."""
    cache, q, meta, scale, expected = paged_step([5, 21], [1, 1], 16, 9, 3, 64, seed=3)
    owned = torch.zeros(cache.key.shape[0] * cache.key.shape[1], dtype=torch.bool)
    for table, length in zip(meta.block_tables.tolist(), meta.seq_lens.tolist()):
        for p in range(length):
            owned[table[p // 16] * 16 + p % 16] = True
    for part in (cache.key, cache.value):
        part.view(-1, *part.shape[2:])[~owned] = 1e4
    ours = cpu_paged_decode.paged_decode(q, cache.key, cache.value, meta.block_tables,
                                         meta.seq_lens, scale)
    torch.testing.assert_close(ours.float(), expected, atol=1e-2, rtol=1e-2)
