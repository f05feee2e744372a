"""What the Triton kernels can run on a given NVIDIA GPU, decided before the first step.

The rule is what the compile check measures (tests/gpu_builds): with an fp8 e4m3 cache the
paged decode/prefill kernels and store_kv compile for sm_89 and sm_90 but not for sm_80, where
Triton has no e4m3 type ("type fp8e4nv not supported in this architecture. The supported fp8
dtypes are (fp8e4b15, fp8e5)"). Refusing at engine start turns that first-step compiler crash
into a message that says what to change.

A float32 model with an fp8 cache compiles everywhere fp8 does, but its kernels cannot use tensor
cores (fp32 dots) and spill KBs per thread (benchmarks/kernel_resources.py): refused too.
"""
from __future__ import annotations

FP8_E4M3_MIN_CAPABILITY = (8, 9)  # Ada (sm_89) and Hopper (sm_90) have e4m3; Ampere does not


def triton_kv_dtype_problem(capability: tuple[int, int], kv_dtype: str, dtype: str) -> str | None:
    """Why the Triton backend cannot run a `dtype` model with a `kv_dtype` cache on a GPU of
    `capability` (major, minor), or None if it can."""
    if kv_dtype == "fp8_e4m3" and dtype == "float32":
        return ("kv_dtype 'fp8_e4m3' with dtype 'float32' is refused on the Triton backend: its "
                "kernels spill tens of KB per thread and miss the tensor cores. Use dtype "
                "'bfloat16' or 'float16' with fp8 (--dtype bfloat16), or kv_dtype 'auto'")
    if kv_dtype == "fp8_e4m3" and tuple(capability) < FP8_E4M3_MIN_CAPABILITY:
        major, minor = capability
        need = ".".join(map(str, FP8_E4M3_MIN_CAPABILITY))
        return (f"kv_dtype 'fp8_e4m3' needs a GPU of compute capability {need} or newer "
                f"(sm_89 Ada, sm_90 Hopper); this GPU has compute capability {major}.{minor}, "
                f"where Triton cannot compile an e4m3 cache. Use kv_dtype 'auto' "
                f"(--kv-dtype auto: the cache in the model's dtype, half as many tokens as fp8)")
    return None


def check_triton_kv_dtype(capability: tuple[int, int], kv_dtype: str, dtype: str) -> None:
    """Raise ValueError naming the capability and the alternative when the pair cannot run."""
    problem = triton_kv_dtype_problem(capability, kv_dtype, dtype)
    if problem is not None:
        raise ValueError(problem)
