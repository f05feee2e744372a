"""Build and load the C++ kernels for CPUs, one extension: decode attention
(`cpu_paged_decode.cpp`, any x86/ARM CPU; bf16 over a bf16 cache on vector units where the CPU
has AVX512-BF16, `cpu_paged_decode_bf16.cpp`), bf16 prefill attention (`cpu_paged_prefill.cpp`,
CPUs with AVX512-BF16) and a decoder layer's bf16 glue (`cpu_layer_ops.cpp`): RMSNorm, alone or
after the residual add, the rotary embedding and the KV cache write.

Built once per machine with the local C++ compiler through torch's extension mechanism
(`torch.utils.cpp_extension.load`: ninja, cached under torch's default build root,
~/.cache/torch_extensions or $XDG_CACHE_HOME/torch_extensions, rebuilt when the source or flags
change). -march=native compiles for this CPU, so the build's name carries a digest of it
(_build_digest): machines of another kind sharing a home directory build their own copy instead
of loading one that may hold instructions they lack. -ffast-math lets expf vectorize; the kernel keeps its maxima finite, which is what
that flag assumes.

torch guards each build folder with a `lock` file that only its holder removes, and it takes that
lock on every load (to let ninja check the build is current): a process killed inside that window
(a worker SIGKILLed while starting) leaves the file behind and every later load on the machine
waits on it forever. So loads here take an flock first, which the kernel drops when its holder
dies; under it no live process of ours holds torch's lock, and one found is stale.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
from pathlib import Path

import torch

logger = logging.getLogger(__name__)
SOURCES = [Path(__file__).with_name(name) for name in (
    "cpu_paged_decode.cpp", "cpu_paged_decode_bf16.cpp", "cpu_paged_prefill.cpp",
    "cpu_layer_ops.cpp")]
# Mirrors the limits at the top of cpu_paged_decode.cpp.
MAX_GROUP, MAX_DIM, MAX_BLOCK = 16, 256, 64
QUERY_DTYPES = (torch.float32, torch.bfloat16)


def unsupported(query_dtype: torch.dtype, cache_dtype: torch.dtype, num_heads: int,
                num_kv_heads: int, head_dim: int, block_size: int) -> str | None:
    """Why the kernel cannot serve this model and cache, or None when it can."""
    if query_dtype not in QUERY_DTYPES:
        return f"dtype {query_dtype} (the kernel takes fp32 and bf16)"
    if cache_dtype not in (query_dtype, torch.float8_e4m3fn):
        return f"KV cache dtype {cache_dtype} with {query_dtype} queries"
    if num_heads % num_kv_heads or num_heads // num_kv_heads > MAX_GROUP:
        return f"{num_heads} query heads over {num_kv_heads} KV heads (at most {MAX_GROUP} per KV head)"
    if head_dim > MAX_DIM:
        return f"head dim {head_dim} (at most {MAX_DIM})"
    if block_size > MAX_BLOCK:
        return f"block size {block_size} (at most {MAX_BLOCK})"
    return None


def prefill_unsupported(query_dtype: torch.dtype, cache_dtype: torch.dtype, num_heads: int,
                        num_kv_heads: int, head_dim: int) -> str | None:
    """Why the prefill kernel cannot serve this model and cache, or None when it can (checked
    before building: whether this CPU has AVX512-BF16 is prefill_built()'s answer)."""
    if query_dtype != torch.bfloat16 or cache_dtype != torch.bfloat16:
        return f"{query_dtype} queries over a {cache_dtype} cache (the kernel takes bf16 only)"
    if num_heads % num_kv_heads or num_heads // num_kv_heads > MAX_GROUP:
        return f"{num_heads} query heads over {num_kv_heads} KV heads (at most {MAX_GROUP} per KV head)"
    if head_dim not in (64, 128):
        return f"head dim {head_dim} (64 or 128)"
    return None


def prefill_built() -> bool:
    """Whether the build for this CPU has the prefill kernel (it needs AVX512-BF16)."""
    return bool(load().paged_prefill_built())


def _build_digest() -> str:
    """A short digest of what the build is for: the CPU's model and feature flags (-march=native)
    and torch's version (its C++ ABI; torch's own cache key covers only sources and flags)."""
    text = platform.machine() + torch.__version__
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features", "model name")):
                text += line
                if line.startswith(("flags", "Features")):
                    break
    except OSError:
        text += platform.processor()
    return hashlib.sha256(text.encode()).hexdigest()[:12]


@functools.cache
def load():
    """-> the extension module (`paged_decode`, `paged_prefill`). Raises RuntimeError, naming the cause, when
    it cannot be built here (no C++ compiler, no ninja, a compile error)."""
    from torch.utils.cpp_extension import get_default_build_root
    from torch.utils.cpp_extension import load as load_extension

    name = f"raypaged_cpu_paged_decode_{_build_digest()}"
    build_dir = Path(get_default_build_root()) / name
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        with exclusive_flock(build_dir / "raypaged.flock", f"waiting for another process "
                             f"building or loading the C++ attention kernels in {build_dir}"):
            (build_dir / "lock").unlink(missing_ok=True)
            if not (build_dir / f"{name}.so").exists():
                logger.warning("building the C++ attention kernels for this CPU in %s (once "
                               "per machine; a few minutes)", build_dir)
            return load_extension(
                name=name, sources=[str(s) for s in SOURCES], build_directory=str(build_dir),
                extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
                extra_ldflags=["-fopenmp"], verbose=False)
    except (RuntimeError, OSError, ImportError) as e:
        raise RuntimeError(f"the C++ attention kernels could not be built ({e}); it needs a C++ "
                           "compiler (g++) and ninja") from e


@contextlib.contextmanager
def exclusive_flock(path: Path, waiting: str = ""):
    """An exclusive flock on `path` (created if missing) for the block: waits while another process
    holds it (here: builds or loads), saying so first (`waiting`: what it waits for), as that
    can take minutes; the OS drops the lock when its holder dies."""
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if waiting:
                logger.warning("%s", waiting)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def paged_decode(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                 k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """query [n, H, D] (row b = sequence b), key/value [num_blocks, bs, Hkv, D], block_tables
    [n, max_blocks] int32, seq_lens [n] int32 (each >= 1) -> [n, H, D] in query's dtype."""
    return load().paged_decode(query, key, value, block_tables, seq_lens, scale, k_scale, v_scale)


def paged_prefill(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  block_table: torch.Tensor, seq_len: int, scale: float) -> torch.Tensor:
    """One sequence's prefill chunk: query [n, H, D] bf16 at positions seq_len-n .. seq_len-1,
    key/value [num_blocks, bs, Hkv, D] bf16 holding its first seq_len tokens (this chunk's
    included), block_table [>= ceil(seq_len / bs)] int32 -> [n, H, D] bf16, causal."""
    return load().paged_prefill(query, key, value, block_table, seq_len, scale)


def rms_norm_bf16(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H], weight [H], contiguous bf16 -> RMSNorm(x) * weight [T, H] bf16, with the
    rounding of raypaged.model.llama.RMSNorm's torch ops (normalised in fp32, scaled in bf16)."""
    return load().rms_norm_bf16(x, weight, eps)


def add_rms_norm_bf16(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, delta [T, H], weight [H], contiguous bf16 -> (x + delta, rms_norm_bf16(x + delta)): a
    layer's residual add and the RMSNorm after it, with torch's rounding of each."""
    return load().add_rms_norm_bf16(x, delta, weight, eps)


def store_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
             value_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """key/value [T, Hkv, D] (each token's Hkv * D values contiguous) -> the caches [num_blocks,
    block_size, Hkv, D] of the same dtype at flat rows slots [T] int64; slot -1 is skipped."""
    load().store_kv(key, value, key_cache, value_cache, slots)


def rotary_bf16(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, N, D] bf16 (a strided view; its last dim contiguous), cos/sin [T, 1, D/2] bf16 ->
    rotated [T, N, D], contiguous, with the rounding of raypaged.model.llama.apply_rotary."""
    return load().rotary_bf16(x, cos, sin)
