"""The engine-start rule for what the Triton kernels can run (tests/gpu_builds checks it against
real compiles for sm_80/89/90)."""
import pytest

from raypaged.model.attention.gpu_support import check_triton_kv_dtype, triton_kv_dtype_problem


@pytest.mark.parametrize("capability", [(8, 0), (8, 6), (8, 7)])
def test_fp8_cache_below_sm89_is_refused_naming_the_capability_and_the_alternative(capability):
    with pytest.raises(ValueError) as e:
        check_triton_kv_dtype(capability, "fp8_e4m3", "bfloat16")
    message = str(e.value)
    assert f"compute capability {capability[0]}.{capability[1]}" in message
    assert "8.9 or newer" in message and "kv_dtype 'auto'" in message


@pytest.mark.parametrize("capability", [(8, 9), (9, 0), (10, 0)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_fp8_cache_from_sm89_on_is_accepted(capability, dtype):
    assert triton_kv_dtype_problem(capability, "fp8_e4m3", dtype) is None


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_model_dtype_cache_is_accepted_everywhere(dtype):
    assert triton_kv_dtype_problem((8, 0), "auto", dtype) is None


def test_float32_model_with_fp8_cache_is_refused_with_the_dtype_to_use():
    with pytest.raises(ValueError, match="dtype 'bfloat16' or 'float16'"):
        check_triton_kv_dtype((9, 0), "fp8_e4m3", "float32")
