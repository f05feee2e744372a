"""Where a kernel build's CPU time goes, what sharing the frontend saves, and what the compile
check's profiles cost cold.

A seeded sample of kernel variants (the same number per kernel) from the full profile is built
in this process for sm_80, sm_89 and sm_90a two ways:

- direct: each target alone from the AST, with a CPU-time meter around each Triton stage
      source -> ttir -> ttgir -> llir (MLIR lowering + LLVM -O3) -> ptx -> cubin (ptxas, a child)
  "other" is what triton.compile spends outside the stages (AST to TTIR, writing its cache)
  plus our Python;
- shared: the three targets together as benchmarks/kernel_builds/aot_build.py builds them (build_targets: one
  AST to TTIR, sm_89 from sm_80's TTGIR), whose PTX and cubin must equal the direct builds'
  byte for byte (counted and printed).

The two alternate which goes first per variant. Also printed: what a fresh interpreter pays to
import triton, torch and the kernels (pool workers are forked, so they do not), how many
sm_80/sm_89 PTX pairs are equal apart from the `.target` line (LLVM runs its SLP vectorizer for
sm_89, not sm_80, so the LLVM stage cannot be shared), and each profile's cold CPU seconds
estimated from the per-kernel means, direct and shared. CPU seconds, not wall: the machine is
shared, compare the figures within one run.

    python benchmarks/kernel_build_time.py [--per-kernel 5] [--seed 0]
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import io
import os
import random
import re
import resource
import subprocess
import sys
import tempfile
from hashlib import sha256
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.pop("TRITON_INTERPRET", None)  # compiled Triton: the interpreter compiles nothing
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
os.environ["TRITON_ALWAYS_COMPILE"] = "1"
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-scratch-")
os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"  # build_targets reads ptxas -v

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

    from benchmarks.kernel_builds.aot_build import build_targets, compile_kernel
    from raypaged.kernels.paged_decode import MAX_SPLITS
    from benchmarks.kernel_builds.compile_check import (PROFILES, TARGETS, engine_launches,
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

    builds, ptx, equal, compared = collections.Counter(), {}, 0, 0

    def direct(v):
        out = {}
        knobs.runtime.add_stages_inspection_hook = meter
        for cap in TARGETS:
            start = cpu(resource.RUSAGE_SELF) + cpu(resource.RUSAGE_CHILDREN)
            try:
                with contextlib.redirect_stdout(io.StringIO()):  # the ptxas -v log
                    k = compile_kernel(v, cap)
                ptx[v.key(), cap] = k.asm["ptx"]
                out[cap] = (sha256(k.asm["ptx"].encode()).hexdigest(),
                            sha256(k.asm["cubin"]).hexdigest())
            except Exception:  # noqa: BLE001 - an fp8 cache on sm_80: a failed build is timed too
                out[cap] = None
            spent[kernel, "total"] += (cpu(resource.RUSAGE_SELF) + cpu(resource.RUSAGE_CHILDREN)
                                       - start)
            builds[kernel] += 1
        knobs.runtime.add_stages_inspection_hook = None
        return out

    def shared(v):
        start = cpu(resource.RUSAGE_SELF) + cpu(resource.RUSAGE_CHILDREN)
        results = build_targets(v, TARGETS)
        spent[kernel, "shared"] += (cpu(resource.RUSAGE_SELF) + cpu(resource.RUSAGE_CHILDREN)
                                    - start)
        return {r.capability: (r.ptx_sha256, r.cubin_sha256) if r.compiled else None
                for r in results}

    for i, v in enumerate(sample):
        kernel = v.kernel
        if i % 2:
            b = shared(v)
            a = direct(v)
        else:
            a = direct(v)
            b = shared(v)
        compared += len(TARGETS)
        equal += sum(a[cap] == b[cap] for cap in TARGETS)
        for cap in TARGETS:
            if a[cap] != b[cap]:
                built = {True: "built", False: "failed"}
                print(f"shared != direct: {v.label} sm_{cap}: direct {built[bool(a[cap])]}, "
                      f"shared {built[bool(b[cap])]}")

    rows = []
    for kernel in by_kernel:
        staged = {s: spent[kernel, s] for s in ("ttir", "ttgir", "llir", "ptx", "cubin")}
        other = spent[kernel, "total"] - sum(staged.values())
        rows.append({"kernel": kernel, "builds": builds[kernel],
                     **{s: round(x / builds[kernel], 3) for s, x in staged.items()},
                     "other": round(other / builds[kernel], 3),
                     "cpu_s_per_build": round(spent[kernel, "total"] / builds[kernel], 3),
                     "shared_cpu_s_per_build": round(spent[kernel, "shared"] / builds[kernel], 3),
                     "shared_vs_direct": round(spent[kernel, "shared"] / spent[kernel, "total"],
                                               3)})
    everything = sum(spent[k, "total"] for k in by_kernel)
    shares = {s: round(sum(spent[k, s] for k in by_kernel) / everything, 3)
              for s in ("ttir", "ttgir", "llir", "ptx", "cubin")}
    shares["other"] = round(1 - sum(shares.values()), 3)
    print(table(rows, ["kernel", "builds", "ttir", "ttgir", "llir", "ptx", "cubin", "other",
                       "cpu_s_per_build", "shared_cpu_s_per_build", "shared_vs_direct"]))
    print("share of CPU (direct):", ", ".join(f"{s} {x:.0%}" for s, x in shares.items()))
    print(f"shared builds equal to direct ones (PTX and cubin, or both failed): "
          f"{equal} of {compared}")

    pairs = [k for k, cap in ptx if cap == 80 and (k, 89) in ptx]
    untargeted = lambda text: re.sub(r"\.target sm_\w+", "", text)  # noqa: E731
    same = sum(untargeted(ptx[k, 80]) == untargeted(ptx[k, 89]) for k in pairs)
    print(f"sm_80 vs sm_89 PTX equal apart from .target: {same} of {len(pairs)}")
    start_cpu = worker_start_seconds()
    print(f"{WORKER_START}: {start_cpu:.2f} CPU s")

    estimates = {}
    for name, keep in PROFILES.items():
        kept = [v for v, us in zip(variants, users) if any(map(keep, us))]
        estimates[name] = {"kernels": len(kept), "builds": len(kept) * len(TARGETS)}
        for how, column in (("direct", "cpu_s_per_build"), ("shared", "shared_cpu_s_per_build")):
            per_build = {r["kernel"]: r[column] for r in rows}
            cpu_s = sum(per_build[v.kernel] * len(TARGETS) for v in kept)
            estimates[name][how] = {"cpu_s": round(cpu_s),
                                    "idle_2_core_min": round(cpu_s / 2 / 60, 1)}
            print(f"profile {name}, {how}: {len(kept)} kernels x {len(TARGETS)} targets, about "
                  f"{cpu_s:.0f} CPU s cold, {cpu_s / 120:.1f} min on an idle 2-core machine")
    path = write("kernel_build_time", {
        "command": f"python benchmarks/kernel_build_time.py --per-kernel {args.per_kernel} "
                   f"--seed {args.seed}",
        "per_kernel": rows, "shares": shares, "sm80_sm89_ptx_equal": [same, len(pairs)],
        "shared_equal_to_direct": [equal, compared],
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
