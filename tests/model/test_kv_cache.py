"""KV cache allocation: shapes, storage dtypes, scales and the bytes-per-token arithmetic."""
from __future__ import annotations

import pytest
import torch

from raypaged.config import EngineArgs
from raypaged.model.kv_cache import allocate_kv_caches, kv_storage_dtype
from raypaged.model.model_config import ModelConfig
from raypaged.model.setup import ModelSetup
from test_model_config import SMOLLM2_135M

CONFIG = ModelConfig.from_dict(SMOLLM2_135M)  # 30 layers, 3 kv heads, head_dim 64


def test_one_zeroed_key_and_value_per_layer_in_block_layout():
    caches = allocate_kv_caches(CONFIG, num_blocks=5, block_size=16, dtype=torch.bfloat16)
    assert len(caches) == 30
    assert caches[0].key.shape == caches[0].value.shape == (5, 16, 3, 64)
    assert caches[0].key.dtype == torch.bfloat16 and caches[0].block_size == 16
    assert not caches[7].value.any()
    assert caches[0].key.data_ptr() != caches[1].key.data_ptr()


def test_fp8_cache_stores_e4m3_with_unit_scales_by_default():
    caches = allocate_kv_caches(CONFIG, 2, 8, kv_storage_dtype(torch.float32, "fp8_e4m3"))
    assert caches[0].key.dtype == torch.float8_e4m3fn
    assert (caches[0].k_scale, caches[0].v_scale) == (1.0, 1.0)


def bytes_per_token(dtype: str, kv_dtype: str = "auto") -> int:
    setup = ModelSetup.decide(EngineArgs(dtype=dtype, kv_dtype=kv_dtype, device="cpu"), CONFIG)
    return setup.kv_shape.bytes_per_token


def test_bytes_per_token():
    # 2 (K and V) * 30 layers * 3 heads * 64 dims * element size
    assert bytes_per_token("float32") == 2 * 30 * 3 * 64 * 4 == 46080
    assert bytes_per_token("bfloat16") == 23040
    assert bytes_per_token("bfloat16", "fp8_e4m3") == 11520


def test_unknown_kv_dtype_lists_the_choices():
    with pytest.raises(ValueError, match="unknown kv_dtype 'int8'; choices: auto, fp8_e4m3"):
        kv_storage_dtype(torch.float32, "int8")
