"""Config validation and the "what fits" report."""
import pytest

from raypaged.config import EngineArgs, KVShape, plan_kv_cache

# SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64; fp32 cache.
SMOL = KVShape(num_layers=30, num_kv_heads=3, head_dim=64, dtype_bytes=4)


def test_block_size_must_be_8_16_or_32():
    with pytest.raises(ValueError, match=r"block_size must be one of \[8, 16, 32\], got 12"):
        EngineArgs(block_size=12)


def test_only_one_kv_budget():
    with pytest.raises(ValueError, match=r"at most one KV budget, got \['kv_context_len', 'kv_memory_mb'\]"):
        EngineArgs(kv_memory_mb=100, kv_context_len=1000)


@pytest.mark.parametrize("kw, msg", [
    ({"kv_memory_mb": 0}, "kv_memory_mb must be > 0"),
    ({"kv_memory_fraction": 1.5}, r"kv_memory_fraction must be in \(0, 1\]"),
    ({"kv_context_len": -3}, "kv_context_len must be a positive integer"),
    ({"kv_dtype": "int4"}, r"kv_dtype must be one of \['auto', 'fp8_e4m3'\]"),
])
def test_bad_cache_settings_name_the_setting(kw, msg):
    with pytest.raises(ValueError, match=msg):
        EngineArgs(**kw)


def test_bad_scheduler_settings():
    with pytest.raises(ValueError, match="max_num_seqs must be a positive integer, got 0"):
        EngineArgs(max_num_seqs=0)
    with pytest.raises(ValueError, match="max_model_len must be a positive integer"):
        EngineArgs(max_model_len=-1)


def test_plan_from_memory_budget():
    plan = plan_kv_cache(SMOL, EngineArgs(kv_memory_mb=90), max_model_len=2048, free_device_bytes=None)
    assert SMOL.bytes_per_token == 46080
    assert plan.bytes_per_block == 46080 * 16
    assert plan.num_blocks == 128 and plan.num_tokens == 2048
    assert plan.max_seqs_at_max_model_len == 1


def test_plan_from_context_len_and_cpu_default():
    plan = plan_kv_cache(SMOL, EngineArgs(kv_context_len=10_000), 4096, None)
    assert plan.num_blocks == 625 and plan.max_seqs_at_max_model_len == 2
    default = plan_kv_cache(SMOL, EngineArgs(), 8192, None)
    assert default.kv_budget_bytes == 2 * 1024 ** 3
    gpu = plan_kv_cache(SMOL, EngineArgs(), 8192, free_device_bytes=10 * 1024 ** 3)
    assert gpu.kv_budget_bytes == int(0.9 * 10 * 1024 ** 3)
    assert "sequences of max_model_len that fit concurrently" in default.report()


def test_plan_refuses_when_one_sequence_cannot_fit_and_says_what_would():
    with pytest.raises(ValueError) as err:
        plan_kv_cache(SMOL, EngineArgs(kv_memory_mb=40), max_model_len=2048, free_device_bytes=None)
    msg = str(err.value)
    assert "max_model_len=2048 needs 128 KV blocks (90.0 MiB)" in msg
    assert "holds 56 blocks" in msg
    assert "set max_model_len <= 896" in msg and "kv_memory_mb=90.0" in msg


def test_fraction_needs_a_gpu():
    with pytest.raises(ValueError, match="kv_memory_fraction needs a GPU"):
        plan_kv_cache(SMOL, EngineArgs(kv_memory_fraction=0.5), 2048, None)
