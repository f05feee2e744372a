"""Where a kernel build's CPU time goes, and what the compile check's profiles cost cold.

A seeded sample of kernel variants (the same number per kernel) from the full profile is built
in this process for sm_80, sm_89 and sm_90a, exactly as kernels/aot_build.py builds them, with a
CPU-time meter around each Triton stage:

    source -> ttir -> ttgir -> llir (MLIR lowering + LLVM -O3) -> ptx -> cubin (ptxas, a child)

"other" is what triton.compile spends outside the stages (AST to TTIR, writing its cache) plus
our Python. Also printed: what a pool worker pays once (importing triton, torch and the kernels),
how many sm_80/sm_89 PTX pairs are equal apart from the `.target` line (if they were, one
frontend run could serve both), and each profile's cold CPU seconds estimated from the per-kernel
means. CPU seconds, not wall: the machine is shared, compare the shares within one run.

    python benchmarks/kernel_build_time.py [--per-kernel 5] [--seed 0]
"""
from __future__ import annotations

import argparse
import collections
import os
import random
import re
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.pop("TRITON_INTERPRET", None)  # compiled Triton: the interpreter compiles nothing
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
os.environ["TRITON_ALWAYS_COMPILE"] = "1"
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-scratch-")

from benchmarks.report import plot_path, pyplot, table, write  # noqa: E402

WORKER_START = ("import triton, torch, raypaged.kernels: once per pool worker, in a fresh "
                "interpreter")


def cpu(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def worker_start_seconds() -> float:
    code = ("import time; t = time.process_time(); import triton; "
            "import raypaged.kernels.paged_decode, raypaged.kernels.paged_prefill, "
            "raypaged.kernels.store_kv; print(time.process_time() - t)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    return float(out.stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--per-kernel", type=int, default=5, help="variants sampled per kernel")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from triton import knobs

    from raypaged.kernels.aot_build import compile_kernel
    from raypaged.kernels.paged_decode import MAX_SPLITS
    from raypaged.model.attention.compile_check import (PROFILES, TARGETS, engine_launches,
                                                         record_variants)

    launches = engine_launches(MAX_SPLITS)
    variants, users = record_variants(launches)
    by_kernel = collections.defaultdict(list)
    for v in variants:
        by_kernel[v.kernel].append(v)
    rng = random.Random(args.seed)
    sample = [v for vs in by_kernel.values() for v in rng.sample(vs, args.per_kernel)]

    spent = collections.Counter()  # (kernel, stage) -> CPU s, ptxas (a child process) included
    kernel = None  # the kernel being built: the meter books its stages there

    def meter(*hook_args):  # knobs.runtime.add_stages_inspection_hook
        if not hook_args:  # asked for its part of the cache key
            return "stage-meter", ""
        _, stages, *_ = hook_args
        for name, stage in list(stages.items()):
            def timed(src, metadata, stage=stage, name=name):
                start = cpu(resource.RUSAGE_SELF) + cpu(resource.RUSAGE_CHILDREN)
                try:
                    return stage(src, metadata)
                finally:
                    spent[kernel, name] += (cpu(resource.RUSAGE_SELF)
                                            + cpu(resource.RUSAGE_CHILDREN) - start)
            stages[name] = timed

    knobs.runtime.add_stages_inspection_hook = meter
    builds, ptx = collections.Counter(), {}
    for v in sample:
        kernel = v.kernel
        for cap in TARGETS:
            start = cpu(resource.RUSAGE_SELF) + cpu(resource.RUSAGE_CHILDREN)
            try:
                ptx[v.key(), cap] = compile_kernel(v, cap).asm["ptx"]
            except Exception:  # noqa: BLE001 - an fp8 cache on sm_80: a failed build is timed too
                pass
            spent[kernel, "total"] += (cpu(resource.RUSAGE_SELF) + cpu(resource.RUSAGE_CHILDREN)
                                       - start)
            builds[kernel] += 1
    knobs.runtime.add_stages_inspection_hook = None

    rows = []
    for kernel in by_kernel:
        staged = {s: spent[kernel, s] for s in ("ttir", "ttgir", "llir", "ptx", "cubin")}
        other = spent[kernel, "total"] - sum(staged.values())
        rows.append({"kernel": kernel, "builds": builds[kernel],
                     **{s: round(x / builds[kernel], 3) for s, x in staged.items()},
                     "other": round(other / builds[kernel], 3),
                     "cpu_s_per_build": round(spent[kernel, "total"] / builds[kernel], 3)})
    everything = sum(spent[k, "total"] for k in by_kernel)
    shares = {s: round(sum(spent[k, s] for k in by_kernel) / everything, 3)
              for s in ("ttir", "ttgir", "llir", "ptx", "cubin")}
    shares["other"] = round(1 - sum(shares.values()), 3)
    print(table(rows, ["kernel", "builds", "ttir", "ttgir", "llir", "ptx", "cubin", "other",
                       "cpu_s_per_build"]))
    print("share of CPU:", ", ".join(f"{s} {x:.0%}" for s, x in shares.items()))

    pairs = [k for k, cap in ptx if cap == 80 and (k, 89) in ptx]
    untargeted = lambda text: re.sub(r"\.target sm_\w+", "", text)  # noqa: E731
    same = sum(untargeted(ptx[k, 80]) == untargeted(ptx[k, 89]) for k in pairs)
    print(f"sm_80 vs sm_89 PTX equal apart from .target: {same} of {len(pairs)}")
    start_cpu = worker_start_seconds()
    print(f"{WORKER_START}: {start_cpu:.2f} CPU s")

    per_build = {r["kernel"]: r["cpu_s_per_build"] for r in rows}
    estimates = {}
    for name, keep in PROFILES.items():
        kept = [v for v, us in zip(variants, users) if any(map(keep, us))]
        cpu_s = sum(per_build[v.kernel] * len(TARGETS) for v in kept)
        estimates[name] = {"kernels": len(kept), "builds": len(kept) * len(TARGETS),
                           "cpu_s": round(cpu_s), "idle_2_core_min": round(cpu_s / 2 / 60, 1)}
        print(f"profile {name}: {len(kept)} kernels x {len(TARGETS)} targets, about "
              f"{cpu_s:.0f} CPU s cold, {cpu_s / 120:.1f} min on an idle 2-core machine")
    path = write("kernel_build_time", {
        "command": f"python benchmarks/kernel_build_time.py --per-kernel {args.per_kernel} "
                   f"--seed {args.seed}",
        "per_kernel": rows, "shares": shares, "sm80_sm89_ptx_equal": [same, len(pairs)],
        "worker_start_cpu_s": round(start_cpu, 2), "profiles": estimates})
    print(f"wrote {path}")

    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 3.5))
    left = [0.0] * len(rows)
    for stage in ("ttir", "ttgir", "llir", "ptx", "cubin", "other"):
        widths = [r[stage] for r in rows]
        ax.barh([r["kernel"] for r in rows], widths, left=left, label=stage)
        left = [a + b for a, b in zip(left, widths)]
    ax.set_xlabel("CPU seconds per build (mean over sm_80, sm_89, sm_90a)")
    ax.set_title("Where a Triton kernel build's time goes (no GPU)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(plot_path("kernel_build_time"), dpi=110)


if __name__ == "__main__":
    main()
