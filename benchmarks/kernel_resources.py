"""Registers, spills, shared memory and tensor-core use of every Triton kernel, per NVIDIA target.

No GPU needed: the compile check (benchmarks/kernel_builds/compile_check.py) builds each kernel
variant for sm_80, sm_89 and sm_90a with the ptxas shipped in the Triton wheel. Printed: the
engine's default configuration (bf16, block size 16), one row per kernel and head dim, the worst
case over GQA groups, kv-head counts and split counts; per target "registers/thread, spill
bytes, shared KiB, tensor cores (mma = mma.sync, wgmma = Hopper warpgroup MMA, - = none)".
The JSON holds every variant and target of the profile.

    python benchmarks/kernel_resources.py [--profile ci|full] [--cache-dir EMPTY_DIR_FOR_COLD]
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.pop("TRITON_INTERPRET", None)  # compiled Triton: the interpreter compiles nothing
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

from benchmarks.report import plot_path, pyplot, table, write  # noqa: E402
from benchmarks.kernel_builds.compile_check import CACHE_DIR, PROFILES, TARGETS, check  # noqa: E402

KERNELS = {"_store_kv_kernel": "store_kv", "_paged_decode_kernel": "decode",
           "_merge_kernel": "split merge", "_paged_prefill_kernel": "prefill"}


def default_summary(results: list[dict]) -> list[dict]:
    """One row per (kernel, head dim) of the default configuration, worst case per target."""
    rows = []
    for kernel, name in KERNELS.items():
        for head_dim in (64, 128, 256):
            row = {"kernel": name, "head_dim": head_dim}
            for cap in TARGETS:
                rs = [r for r in results if r["kernel"] == kernel and r["head_dim"] == head_dim
                      and r["capability"] == cap and r["default"] and r["compiled"]]
                if not rs:
                    continue
                tc = ("wgmma" if any(r["wgmma"] for r in rs)
                      else "mma" if any(r["mma"] for r in rs) else "-")
                row[f"sm_{cap}"] = (f"{max(r['registers'] for r in rs)}/"
                                    f"{max(r['spill_stores'] + r['spill_loads'] for r in rs)}/"
                                    f"{max(r['shared_bytes'] for r in rs) / 1024:.1f}/{tc}")
                row[f"regs_{cap}"] = max(r["registers"] for r in rs)
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", choices=list(PROFILES), default="ci")
    parser.add_argument("--cache-dir", type=Path, default=CACHE_DIR,
                        help="build cache; an empty folder measures a cold build")
    args = parser.parse_args()
    report = check(args.profile, cache_dir=args.cache_dir)
    results = report["results"]
    summary = default_summary(results)
    print("default configuration (bf16 model and cache, block size 16), worst case over groups, "
          "kv heads and splits; per target: registers/spill bytes/shared KiB/tensor cores")
    print(table(summary, ["kernel", "head_dim", *(f"sm_{c}" for c in TARGETS)]))
    failed = [r for r in results if not r["compiled"]]
    spilling = [r for r in results if r["compiled"] and (r["spill_stores"] or r["spill_loads"])]
    print(f"\n{report['variants']} kernel variants x {len(TARGETS)} targets "
          f"({report['launches']} launches, profile {args.profile}): {len(failed)} did not "
          f"compile (all refused by gpu_support: "
          f"{all(r['refused'] for r in failed)}), {len(spilling)} spill; "
          f"{report['builds']} built + {report['cache_hits']} cached in {report['seconds']} s "
          f"({report['cpu_seconds']} CPU s)")
    for r in spilling:
        print(f"  spills: {r['label']} sm_{r['capability']}: {r['registers']} registers, "
              f"{r['spill_stores']} B stores / {r['spill_loads']} B loads")
    # one row per build as a list under "columns": the same data, a third of the bytes (less
    # the PTX/cubin hashes, there for the compile check's sharing check: they would double it)
    columns = [c for c in results[0] if not c.endswith("_sha256")] if results else []
    compact = {**report, "results": {"columns": columns,
                                     "rows": [[r[c] for c in columns] for r in results]}}
    path = write("kernel_resources", {
        "command": f"python benchmarks/kernel_resources.py --profile {args.profile}",
        "summary": summary, "not_compiled": len(failed), "spilling": len(spilling), **compact},
        indent=None)
    print(f"wrote {path}")

    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(9, 4))
    labels = ["\n".join([*r["kernel"].split(), f"d{r['head_dim']}"]) for r in summary]
    width = 0.8 / len(TARGETS)
    for i, cap in enumerate(TARGETS):
        ax.bar([x + i * width for x in range(len(summary))],
               [r.get(f"regs_{cap}", 0) for r in summary], width, label=f"sm_{cap}")
    ax.axhline(255, color="red", linestyle="--", linewidth=1,
               label="255: ptxas limit, spills beyond")
    ax.set_xticks([x + width for x in range(len(summary))], labels, fontsize=7)
    ax.set_ylabel("registers per thread (max over variants)")
    ax.set_title("Triton kernels, default configuration (bf16, block 16), compiled without a GPU")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(plot_path("kernel_resources"), dpi=110)


if __name__ == "__main__":
    main()
