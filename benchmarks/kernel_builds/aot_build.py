"""Compile recorded kernel variants for NVIDIA targets with no GPU, and read their resources.

    KernelVariant x capabilities ──triton.compile, frontend shared between targets──>
        PTX + cubin (ptxas from the Triton wheel; sm_90 builds as sm_90a)
        -> BuildResult: compiled or the compiler's error; registers/thread, spill bytes,
           stack bytes (ptxas -v), shared memory (Triton's launch metadata), whether the PTX
           uses tensor-core instructions (mma.sync: sm_80+, wgmma: sm_90a), and hashes of the
           PTX and cubin

One variant's targets are built together, and the frontend runs once (build_targets):

    AST ──codegen + make_ttir──> TTIR ──make_ttgir(sm_80)──> TTGIR ──> LLIR, PTX, cubin  sm_80
                                  │                           └─"cuda:89"─> LLIR, PTX, cubin  sm_89
                                  └──make_ttgir(sm_90)──> TTGIR ──> LLIR, PTX, cubin       sm_90a

The TTIR is target-independent for these kernels (make_ttir's passes differ only in rewriting
tensor descriptors, which they do not use; the options that differ between targets, the fp8
dtypes a target accepts and fp8 x fp8 dot accumulation, only refuse fp8 on sm_80 or touch dots
they do not have), and make_ttgir takes the same branches for every 8.x capability, so sm_89
lowers sm_80's TTGIR with its target attribute changed. Where the first target's frontend
refuses the variant (an fp8 cache on sm_80) the next one starts from the AST. That this changes
nothing is checked, not assumed: `direct_build` compiles a sample from the AST for each target
alone, and the compile check requires its PTX and cubin to equal the shared builds' byte for
byte (README "Kernel builds"). It saves the skipped AST/TTIR and sm_89 TTGIR work, about a
ninth of the CPU (benchmarks/kernel_build_time.py); LLVM, PTX and ptxas stay per target.

Results are cached as JSON files named by a hash of everything that decides the build: Triton's
version, the kernel's source hash (Triton's `cache_key`, which covers the @triton.jit functions it
calls), signature, constants, attributes, options and target. A source edit misses the cache;
anything else is a file read. Builds run in a process pool, one variant (all its targets) per
task (each one is single-threaded LLVM + ptxas work).

A clean checkout has no cache, and the full profile costs ~10 minutes on 2 cores, a third of CI's
time. So the results are also committed, as one record (record.json.gz: cache key -> result,
written by `compile_check --write-record`), read where the cache misses. A record answers only
for the exact Triton version, kernel source and specialisation it was built from (the same key),
and it is not trusted: `verify` variants drawn at random from those it answered, all their
targets, are compiled again, and must be equal in every field but the CPU seconds and the PTX
and cubin hashes (`record_mismatches`): those follow the checkout's path, which Triton's line
info names, so they are compared only between builds of one run (the sharing check's `direct`
builds and the `fresh` variants they are checked against are never taken from the record). A
kernel edit misses the record and compiles what it changed.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib
import io
import json
import os
import random
import re
import resource
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Sequence

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
    seconds: float              # CPU seconds of this target's part of the build (0 from cache)
    built_from: str             # "ast", or the IR of another target it started from: "ttir@80"
    ptx_sha256: str | None      # what the sharing check compares with a build from the AST
    cubin_sha256: str | None
    # a failed build is retried once (_with_retry): the first attempt's error, when it failed;
    # set with compiled=True, the build was flaky
    retry_of: str | None = None


def _jit_function(variant: KernelVariant):
    return getattr(importlib.import_module(variant.module), variant.kernel)


def cache_key(variant: KernelVariant, capability: int, how: str = "shared") -> str:
    import triton
    parts = [triton.__version__, _jit_function(variant).cache_key, repr(variant.key()),
             str(capability), how]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def _options(variant: KernelVariant) -> dict:
    return dict(num_warps=variant.num_warps, num_stages=variant.num_stages)


def _target(capability: int):
    from triton.backends.compiler import GPUTarget
    return GPUTarget("cuda", capability, 32)


def compile_kernel(variant: KernelVariant, capability: int):
    """triton.compile of one variant for one target from its AST: a CompiledKernel, or raises."""
    import triton
    from triton.compiler import ASTSource

    src = ASTSource(_jit_function(variant), dict(variant.signature), dict(variant.constants),
                    {k: [list(a) for a in v] for k, v in variant.attrs})
    return triton.compile(src, target=_target(capability), options=_options(variant))


def _compile_ir(variant: KernelVariant, text: str, ext: str, capability: int):
    """triton.compile from IR text ("ttir": from make_ttgir on; "ttgir": from make_llir on)."""
    import triton

    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / f"{variant.kernel}.{ext}"
        path.write_text(text)
        return triton.compile(str(path), target=_target(capability), options=_options(variant))


def _retarget_ttgir(ttgir: str, capability: int) -> str:
    # module attributes {..., ttg.target = "cuda:80", ...}
    new, count = re.subn(r'(\bttg\.target"? = )"cuda:\d+"', rf'\1"cuda:{capability}"', ttgir)
    if count != 1:
        raise RuntimeError(f"expected one ttg.target attribute in the TTGIR, found {count}")
    return new


# make_ttgir (nvidia backend) branches on capability // 10 only: every 8.x target gets the same
# passes, so sm_89 starts from sm_80's TTGIR. sm_90 has its own (wgmma, TMA).
_SAME_TTGIR = {89: 80}


def _measured(variant: KernelVariant, capability: int, how: str, build):
    """(BuildResult, the CompiledKernel or None) of build(), timed in CPU seconds."""
    log = io.StringIO()
    start = _cpu_seconds()
    try:
        with contextlib.redirect_stdout(log):  # TRITON_DUMP_PTXAS_LOG prints ptxas -v here
            k = build()
    except Exception as e:  # noqa: BLE001 - any compiler failure is the result being measured
        # Triton's message opens with the kernel's source; the reason is at the end.
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        return BuildResult(variant.kernel, variant.label, capability, False,
                           f"{type(e).__name__}: " + " | ".join(lines[-2:])[-400:],
                           None, None, None, None, None, None, None, variant.num_warps,
                           _cpu_seconds() - start, how, None, None), None
    seconds = _cpu_seconds() - start
    text = log.getvalue()
    regs, frame = _REGISTERS.search(text), _FRAME.search(text)
    if regs is None or frame is None:
        raise RuntimeError(f"no ptxas -v report for {variant.kernel} sm_{capability}; "
                           "is TRITON_DUMP_PTXAS_LOG honoured by this Triton?\n" + text[-500:])
    ptx = k.asm["ptx"]
    return BuildResult(variant.kernel, variant.label, capability, True, None,
                       int(regs.group(1)), int(frame.group(2)), int(frame.group(3)),
                       int(frame.group(1)), int(k.metadata.shared),
                       "mma.sync" in ptx, "wgmma.mma_async" in ptx, variant.num_warps, seconds,
                       how, hashlib.sha256(ptx.encode()).hexdigest(),
                       hashlib.sha256(k.asm["cubin"]).hexdigest()), k


def build_targets(variant: KernelVariant, capabilities: tuple[int, ...]) -> list[BuildResult]:
    """One variant for each capability (ascending), the frontend shared (module docstring)."""
    results, first, kernels = [], None, {}  # first: (capability, kernel) built from the AST
    for cap in sorted(capabilities):
        if first is None:
            how, build = "ast", lambda cap=cap: compile_kernel(variant, cap)
        elif _SAME_TTGIR.get(cap) in kernels:
            base = _SAME_TTGIR[cap]
            ttgir = _retarget_ttgir(kernels[base].asm["ttgir"], cap)
            how, build = f"ttgir@{base}", lambda cap=cap, ir=ttgir: _compile_ir(variant, ir,
                                                                               "ttgir", cap)
        else:
            ttir = first[1].asm["ttir"]
            how, build = f"ttir@{first[0]}", lambda cap=cap, ir=ttir: _compile_ir(variant, ir,
                                                                                "ttir", cap)
        result, k = _with_retry(variant, cap, how, build)
        results.append(result)
        if k is not None:
            kernels[cap] = k
            if first is None:
                first = (cap, k)
    return results


def _with_retry(variant: KernelVariant, capability: int, how: str, build):
    """_measured, once more when it fails or raises. Twice a build failed and then passed when
    run again (cause not found); a deterministic failure (fp8 on sm_80) fails both times, in a
    few milliseconds, and stays a failure. The first error is kept on the result (retry_of)."""
    try:
        result, k = _measured(variant, capability, how, build)
        if result.compiled:
            return result, k
        first = result.error
    except Exception as e:  # noqa: BLE001 - e.g. no ptxas report: the retry raises it again
        first = f"{type(e).__name__}: {str(e)[-400:]}"
    result, k = _measured(variant, capability, how, build)
    return replace(result, retry_of=first), k


def direct_build(variant: KernelVariant, capability: int) -> BuildResult:
    """The same target alone, from the AST: what the sharing is checked against."""
    return _with_retry(variant, capability, "ast",
                       lambda: compile_kernel(variant, capability))[0]


def _worker_init(triton_cache: str) -> None:
    # Triton's own cache is bypassed (always compile: a cached build prints no ptxas log) and
    # sent to a scratch folder; ours keeps the results.
    os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"
    os.environ["TRITON_ALWAYS_COMPILE"] = "1"
    os.environ["TRITON_CACHE_DIR"] = triton_cache
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, stated


def _build_job(job: tuple[KernelVariant, tuple[int, ...], bool]) -> list[BuildResult]:
    variant, capabilities, direct = job
    if direct:
        return [direct_build(variant, cap) for cap in capabilities]
    return build_targets(variant, capabilities)


def _cpu_seconds() -> float:
    # this process and the ptxas processes it reaped
    return sum(t for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for t in resource.getrusage(who)[:2])


def _children_cpu_seconds() -> float:
    # reaped workers, and the ptxas processes they reaped, count here
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def build_all(variants: list[KernelVariant], capabilities: tuple[int, ...], cache_dir: Path,
              workers: int | None = None, direct: list[tuple[KernelVariant, int]] = (),
              record: dict[str, dict] | None = None, verify: int = 0, seed: int = 0,
              fresh: Sequence[KernelVariant] = ()
              ) -> tuple[list[BuildResult], list[BuildResult], dict]:
    """Every variant for every capability, from the cache or else the record where they hold
    the result; and the `direct` (variant, capability) pairs built alone from the AST, to check
    the sharing against. `verify` variants the record answered, drawn with `seed`, and the
    `fresh` ones are built again and compared with it (module docstring).

    Returns (results in variant x capability order, direct results in their order, stats:
    builds, cache and record hits, record mismatches, wall seconds and the CPU seconds of the
    workers and their ptxas runs: on a shared machine the wall time says more about the
    neighbours, CPU seconds / cores is the time on an idle one)."""
    start, cpu_start = time.perf_counter(), _children_cpu_seconds()
    cache_dir.mkdir(parents=True, exist_ok=True)
    record = record or {}
    keys = [(v, cap, "shared") for v in variants for cap in capabilities]
    keys += [(v, cap, "direct") for v, cap in direct]
    found: dict[tuple, BuildResult] = {}
    from_record: dict[tuple, BuildResult] = {}
    cache_hits = 0
    for v, cap, how in keys:
        key = cache_key(v, cap, how)
        path = cache_dir / f"{key}.json"
        if path.is_file():
            cache_hits += 1
            found[v.key(), cap, how] = BuildResult(**{**json.loads(path.read_text()),
                                                      "label": v.label})
        elif key in record and how == "shared":
            found[v.key(), cap, how] = from_record[v.key(), cap, how] = BuildResult(
                **{**record[key], "label": v.label})
    # whole variants, every target, as they were built: a shared build's fields depend on its
    # neighbours (built_from)
    answered = sorted({v.key(): v for v, cap, how in keys if how == "shared"
                       and all((v.key(), c, how) in from_record for c in capabilities)}.items(),
                      key=lambda kv: repr(kv[0]))
    forced = {v.key() for v in fresh}
    rechecked = [v for k, v in answered if k in forced]
    drawn_from = [kv for kv in answered if kv[0] not in forced]
    rechecked += [v for _, v in random.Random(seed).sample(drawn_from,
                                                           min(verify, len(drawn_from)))]
    for v in rechecked:
        for cap in capabilities:
            del found[v.key(), cap, "shared"]
    jobs: dict[tuple, tuple] = {}  # one task per variant and kind: its missing targets
    for v, cap, how in keys:
        if (v.key(), cap, how) not in found:
            _, caps, _ = jobs.setdefault((v.key(), how), (v, [], how == "direct"))
            caps.append(cap)
    tasks = [(v, tuple(caps), d) for v, caps, d in jobs.values()]
    builds = sum(len(caps) for _, caps, _ in tasks)
    if tasks:
        # slowest kernels first, one variant per task: the pool ends together
        tasks.sort(key=lambda t: _EXPECTED_COST.get(t[0].kernel, 1.0) * len(t[1]), reverse=True)
        with tempfile.TemporaryDirectory() as scratch, ProcessPoolExecutor(
                workers or os.cpu_count() or 1, initializer=_worker_init,
                initargs=(scratch,)) as pool:
            for (v, _, d), rs in zip(tasks, pool.map(_build_job, tasks)):
                how = "direct" if d else "shared"
                for r in rs:
                    found[v.key(), r.capability, how] = r
                    path = cache_dir / f"{cache_key(v, r.capability, how)}.json"
                    path.write_text(json.dumps(asdict(r)))
    results = [found[v.key(), cap, "shared"] for v in variants for cap in capabilities]
    direct_results = [found[v.key(), cap, "direct"] for v, cap in direct]
    mismatches = [f"{v.label} sm_{cap}" for v in rechecked for cap in capabilities
                  if not same_result(found[v.key(), cap, "shared"],
                                     from_record[v.key(), cap, "shared"])]
    verified = len(rechecked) * len(capabilities)
    stats = dict(builds=builds, cache_hits=cache_hits,
                 record_hits=len(from_record) - verified,
                 record_verified=verified, record_seed=seed,
                 record_missing=sum(cache_key(v, cap) not in record
                                    for v, cap, how in keys if how == "shared"),
                 record_mismatches=mismatches,
                 seconds=round(time.perf_counter() - start, 1),
                 cpu_seconds=round(_children_cpu_seconds() - cpu_start, 1),
                 **retries(results + direct_results))
    print(f"kernel builds: {stats['builds']} compiled, {stats['cache_hits']} from cache, "
          f"{stats['record_hits']} from the record ({stats['record_verified']} more compiled "
          f"again to check it, seed {seed}: {len(mismatches)} differ), "
          f"{stats['seconds']} s ({stats['cpu_seconds']} CPU s); {stats['retried']} retried, "
          f"{stats['flaky']} compiled on the retry", file=sys.stderr)
    return results, direct_results, stats


def same_result(built: BuildResult, recorded: BuildResult) -> bool:
    """Equal in everything but the CPU seconds, the first error of a retried build (which
    need not recur), and the hashes (the checkout's path is in them)."""
    ignore = {"seconds": 0.0, "retry_of": None, "ptx_sha256": None, "cubin_sha256": None}
    return replace(built, **ignore) == replace(recorded, **ignore)


def retries(results: list[BuildResult]) -> dict:
    """How many builds were retried (failed once: _with_retry), how many of those compiled the
    second time (flaky: they pass, but show here), and the first flaky build's first error.
    Cached results keep what happened when they were built."""
    flaky = [r for r in results if r.compiled and r.retry_of is not None]
    return dict(retried=sum(r.retry_of is not None for r in results), flaky=len(flaky),
                first_flaky_error=(f"{flaky[0].label} sm_{flaky[0].capability}: "
                                   f"{flaky[0].retry_of}" if flaky else None))


# CPU seconds per build relative to store_kv's (benchmarks/kernel_build_time.py): only orders
# the pool's tasks, so a prefill build does not start last.
_EXPECTED_COST = {"_paged_prefill_kernel": 15.0, "_paged_decode_kernel": 4.5,
                  "_merge_kernel": 1.5, "_store_kv_kernel": 1.0}
