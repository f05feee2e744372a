"""Compile recorded kernel variants for NVIDIA targets with no GPU, and read their resources.

    KernelVariant x capability ──triton.compile(ASTSource, GPUTarget("cuda", cap, 32))──>
        PTX + cubin (ptxas from the Triton wheel; sm_90 builds as sm_90a)
        -> BuildResult: compiled or the compiler's error; registers/thread, spill bytes,
           stack bytes (ptxas -v), shared memory (Triton's launch metadata), and whether the PTX
           uses tensor-core instructions (mma.sync: sm_80+, wgmma: sm_90a)

Results are cached as JSON files named by a hash of everything that decides the build: Triton's
version, the kernel's source hash (Triton's `cache_key`, which covers the @triton.jit functions it
calls), signature, constants, attributes, options and target. A source edit misses the cache;
anything else is a file read. Builds run in a process pool (each one is single-threaded LLVM +
ptxas work).
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib
import io
import json
import os
import re
import resource
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from .aot_capture import KernelVariant

# ptxas -v, per entry function:
#   "ptxas info    : Used 184 registers, used 1 barriers, 680 bytes cmem[0]"
#   "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads"
_REGISTERS = re.compile(r"Used (\d+) registers")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


@dataclass(frozen=True)
class BuildResult:
    kernel: str
    label: str
    capability: int
    compiled: bool
    error: str | None           # first lines of the compiler's message when not compiled
    registers: int | None       # per thread
    spill_stores: int | None    # bytes per thread
    spill_loads: int | None
    stack_bytes: int | None
    shared_bytes: int | None    # dynamic shared memory per program
    mma: bool | None            # mma.sync in the PTX (Ampere-style tensor cores)
    wgmma: bool | None          # wgmma.mma_async in the PTX (Hopper warpgroup tensor cores)
    num_warps: int
    seconds: float              # compile time when built (0 from the cache)


def _jit_function(variant: KernelVariant):
    return getattr(importlib.import_module(variant.module), variant.kernel)


def cache_key(variant: KernelVariant, capability: int) -> str:
    import triton
    parts = [triton.__version__, _jit_function(variant).cache_key, repr(variant.key()),
             str(capability)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def compile_kernel(variant: KernelVariant, capability: int):
    """triton.compile of one variant for one target: a CompiledKernel, or the compiler's error."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(_jit_function(variant), dict(variant.signature), dict(variant.constants),
                    {k: [list(a) for a in v] for k, v in variant.attrs})
    return triton.compile(src, target=GPUTarget("cuda", capability, 32),
                          options=dict(num_warps=variant.num_warps,
                                       num_stages=variant.num_stages))


def _compile(variant: KernelVariant, capability: int) -> BuildResult:
    log = io.StringIO()
    start = time.perf_counter()
    try:
        with contextlib.redirect_stdout(log):  # TRITON_DUMP_PTXAS_LOG prints ptxas -v here
            k = compile_kernel(variant, capability)
    except Exception as e:  # noqa: BLE001 - any compiler failure is the result being measured
        # Triton's message opens with the kernel's source; the reason is at the end.
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        return BuildResult(variant.kernel, variant.label, capability, False,
                           f"{type(e).__name__}: " + " | ".join(lines[-2:])[-400:],
                           None, None, None, None, None, None, None, variant.num_warps,
                           time.perf_counter() - start)
    seconds = time.perf_counter() - start
    text = log.getvalue()
    regs, frame = _REGISTERS.search(text), _FRAME.search(text)
    if regs is None or frame is None:
        raise RuntimeError(f"no ptxas -v report for {variant.kernel} sm_{capability}; "
                           "is TRITON_DUMP_PTXAS_LOG honoured by this Triton?\n" + text[-500:])
    ptx = k.asm["ptx"]
    return BuildResult(variant.kernel, variant.label, capability, True, None,
                       int(regs.group(1)), int(frame.group(2)), int(frame.group(3)),
                       int(frame.group(1)), int(k.metadata.shared),
                       "mma.sync" in ptx, "wgmma.mma_async" in ptx, variant.num_warps, seconds)


def _worker_init(triton_cache: str) -> None:
    # Triton's own cache is bypassed (always compile: a cached build prints no ptxas log) and
    # sent to a scratch folder; ours keeps the results.
    os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"
    os.environ["TRITON_ALWAYS_COMPILE"] = "1"
    os.environ["TRITON_CACHE_DIR"] = triton_cache
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, stated


def _build_one(job: tuple[KernelVariant, int]) -> BuildResult:
    return _compile(*job)


def _children_cpu_seconds() -> float:
    # reaped workers, and the ptxas processes they reaped, count here
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def build_all(variants: list[KernelVariant], capabilities: tuple[int, ...], cache_dir: Path,
              workers: int | None = None) -> tuple[list[BuildResult], dict]:
    """Every variant for every capability, from the cache where it holds the result.

    Returns (results in variant x capability order, stats: builds, cache hits, wall seconds and
    the CPU seconds of the workers and their ptxas runs: on a shared machine the wall time says
    more about the neighbours, CPU seconds / cores is the time on an idle one)."""
    start, cpu_start = time.perf_counter(), _children_cpu_seconds()
    cache_dir.mkdir(parents=True, exist_ok=True)
    jobs = [(v, cap) for v in variants for cap in capabilities]
    results: list[BuildResult | None] = [None] * len(jobs)
    todo = []
    for i, (v, cap) in enumerate(jobs):
        path = cache_dir / f"{cache_key(v, cap)}.json"
        if path.is_file():
            results[i] = BuildResult(**{**json.loads(path.read_text()), "label": v.label})
        else:
            todo.append(i)
    if todo:
        with tempfile.TemporaryDirectory() as scratch, ProcessPoolExecutor(
                workers or os.cpu_count() or 1, initializer=_worker_init,
                initargs=(scratch,)) as pool:
            for i, r in zip(todo, pool.map(_build_one, [jobs[i] for i in todo], chunksize=4)):
                results[i] = r
                path = cache_dir / f"{cache_key(*jobs[i])}.json"
                path.write_text(json.dumps(asdict(r)))
    stats = dict(builds=len(todo), cache_hits=len(jobs) - len(todo),
                 seconds=round(time.perf_counter() - start, 1),
                 cpu_seconds=round(_children_cpu_seconds() - cpu_start, 1))
    print(f"kernel builds: {stats['builds']} compiled, {stats['cache_hits']} from cache, "
          f"{stats['seconds']} s ({stats['cpu_seconds']} CPU s)", file=sys.stderr)
    return results, stats
