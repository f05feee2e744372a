"""Compile every Triton kernel variant the engine can launch for sm_80, sm_89 and sm_90, no GPU.

The launches come from the engine's own choices, run through the real launchers (recorded, not
executed: kernels/aot_capture.py), so the variants follow the launchers' tile rules by
construction:

    model dtype  x  kv dtype        x  block size   x  head dim   x  GQA group / kv heads  x  splits
    fp32 bf16 fp16  auto (= model)     8 16 32         64 128 256    1..8 / 1 2 4 8           1..16
                    fp8_e4m3

(less fp32 with fp8, which gpu_support refuses on every GPU). De-duplicated, that is 576 distinct
kernels per target (the launchers map many launches onto one kernel: every group <= 8 pads to 16
query rows in decode, every split count shares one kernel), each compiled for the three targets
by kernels/aot_build.py in parallel, the frontend shared between targets (one AST to TTIR, sm_89
from sm_80's TTGIR; a sample also built per target from the AST must match byte for byte), and
cached by source hash.

Profiles: "full" is all of it and what `make test` runs (1,728 builds; 1,071 CPU s cold with the
shared frontend, 9 minutes on 2 cores; docs/performance.md "Profiles"), reading the committed
record (--record, aot_build's docstring) so that a clean checkout compiles only what it verifies.
"ci" (the name is historical: CI ran it until the full profile's spills were fixed; 232
kernels, 696 builds, 438 CPU s measured cold) is the quicker subset for a local check; it keeps,
for every kernel and target,
  - every variant at the engine's default block size (16): every model/cache dtype pair, head dim,
    GQA group, kv-head count and split count (the default configurations among them), and
  - at block sizes 8 and 32, one probe shape (head dim 128, group 4, 8 kv heads, split 1 and 2)
    with a bf16 model, cache in bf16 and in fp8.
It leaves out block sizes 8 and 32 at the other shapes and dtypes (344 kernels per target). The
block size enters only the kernels' integer address arithmetic (page = pos // BLOCK_SIZE,
slot = pos % BLOCK_SIZE), never a tile shape, a dtype or a matrix product, yet it moves
registers: fp32 prefill spilled at block sizes 8 and 32 only (kernels/paged_prefill.py), which is
why CI builds "full". Every kernel is distinct down to its TTIR, and the LLVM stage cannot be
shared between targets (sm_80 builds with LLVM's SLP vectorizer off), so the full profile costs
what it costs.

    python -m benchmarks.kernel_builds.compile_check [--profile full|ci] [--out results.json]
        [--record benchmarks/kernel_builds/record.json.gz --verify N] [--write-record PATH]
"""
from __future__ import annotations

import argparse
import gzip
import json
import random
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from raypaged.config import BLOCK_SIZES, KV_DTYPES
from raypaged.model.kv_cache import kv_storage_dtype
from raypaged.model.attention.gpu_support import triton_kv_dtype_problem
from raypaged.model.loader import DTYPES

TARGETS = (80, 89, 90)         # A100, L40S/RTX 4090, H100 (built as sm_90a)
HEAD_DIMS = (64, 128, 256)     # SmolLM2-135M: 64; Llama/Mistral/Qwen2: 128; Gemma-style: 256
GROUPS = tuple(range(1, 9))    # query heads per kv head of the Llama-family models we load
STORE_KV_HEADS = (1, 2, 4, 8)  # kv heads per model (store_kv's tile spans all of them)
DECODE_KV_HEADS = 2            # decode/prefill programs own one kv head: the count never matters
DEFAULTS = dict(dtype=torch.bfloat16, block_size=16)  # what the engine picks on a GPU by default
NEWEST = (9, 0)                # the most capable target: what it refuses, every GPU refuses
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
REPO = Path(__file__).resolve().parents[2]
CACHE_DIR = REPO / ".kernel-builds"
RECORD = Path(__file__).with_name("record.json.gz")  # the full profile's results, committed
NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
         torch.float8_e4m3fn: "fp8"}


@dataclass(frozen=True)
class Launch:
    """One call of a launcher with the engine's settings; tensors are tiny CPU stand-ins."""

    op: str                # "store_kv", "decode" or "prefill"
    dtype: torch.dtype     # model (query / new K, V) dtype
    kv_dtype: str          # engine setting: "auto" or "fp8_e4m3"
    block_size: int
    head_dim: int
    group: int = 1         # query heads per kv head (decode, prefill)
    kv_heads: int = DECODE_KV_HEADS
    num_splits: int = 1    # decode split-K segments

    @property
    def cache_dtype(self) -> torch.dtype:
        return kv_storage_dtype(self.dtype, self.kv_dtype)

    @property
    def label(self) -> str:
        text = (f"{self.op} {NAMES[self.dtype]}/{NAMES[self.cache_dtype]} bs{self.block_size} "
                f"d{self.head_dim}")
        if self.op == "store_kv":
            return text + f" kvh{self.kv_heads}"
        split = f" split{self.num_splits}" if self.op == "decode" else ""
        return text + f" g{self.group}" + split

    def run(self) -> None:
        """Call the launcher (under aot_capture.recording: records, compiles nothing)."""
        from raypaged.kernels.paged_decode import DecodeWorkspace, paged_decode
        from raypaged.kernels.paged_prefill import paged_prefill
        from raypaged.kernels.store_kv import store_kv

        heads = self.kv_heads * self.group
        cache = torch.zeros(2, self.block_size, self.kv_heads, self.head_dim,
                            dtype=self.cache_dtype)
        # block-table rows as wide as max_model_len / block_size usually is: a multiple of 16
        tables = torch.zeros(2, 32, dtype=torch.int32)
        seq_lens = torch.ones(2, dtype=torch.int32)
        if self.op == "store_kv":
            new = torch.zeros(2, self.kv_heads, self.head_dim, dtype=self.dtype)
            store_kv(new, new.clone(), cache, cache.clone(), torch.zeros(2, dtype=torch.int64))
        elif self.op == "decode":
            q = torch.zeros(2, heads, self.head_dim, dtype=self.dtype)
            # the backend's workspace: sized for max_splits, whatever this step's split count
            ws = DecodeWorkspace.allocate(2, heads, self.head_dim, "cpu")
            paged_decode(q, cache, cache.clone(), tables, seq_lens, 1.0,
                         num_splits=self.num_splits, workspace=ws)
        else:
            q = torch.zeros(2, heads, self.head_dim, dtype=self.dtype)
            starts = torch.tensor([0, 1, 2], dtype=torch.int32)
            paged_prefill(q, cache, cache.clone(), tables, starts, seq_lens, 1, 1.0)


def engine_launches(max_splits: int) -> list[Launch]:
    """Every launch the engine can make, over the settings it offers (module docstring)."""
    out = []
    for dtype_name, dtype in DTYPES.items():
        for kv_dtype in KV_DTYPES:
            if triton_kv_dtype_problem(NEWEST, kv_dtype, dtype_name):
                continue  # refused on every GPU: never launched
            for bs in BLOCK_SIZES:
                for d in HEAD_DIMS:
                    out += [Launch("store_kv", dtype, kv_dtype, bs, d, kv_heads=h)
                            for h in STORE_KV_HEADS]
                    out += [Launch("decode", dtype, kv_dtype, bs, d, g, num_splits=s)
                            for g in GROUPS for s in range(1, max_splits + 1)]
                    out += [Launch("prefill", dtype, kv_dtype, bs, d, g) for g in GROUPS]
    return out


def is_default(launch: Launch) -> bool:
    return (launch.dtype == DEFAULTS["dtype"] and launch.kv_dtype == "auto"
            and launch.block_size == DEFAULTS["block_size"])


def in_ci_profile(launch: Launch) -> bool:
    """The quicker "ci" subset (module docstring): everything at block size 16, a probe at 8 and 32."""
    probe = (launch.head_dim == 128 and launch.num_splits <= 2 and launch.dtype == DEFAULTS["dtype"]
             and (launch.kv_heads == 8 if launch.op == "store_kv" else launch.group == 4))
    return launch.block_size == DEFAULTS["block_size"] or probe


def record_variants(launches: list[Launch]):
    """(distinct KernelVariants, for each the Launches that produce it)."""
    from benchmarks.kernel_builds import aot_capture

    variants, users = {}, {}
    with aot_capture.recording() as take:
        for launch in launches:
            launch.run()
            for v in take(launch.label):
                variants.setdefault(v.key(), v)
                users.setdefault(v.key(), []).append(launch)
    return list(variants.values()), [users[k] for k in variants]


def check(profile: str = "full", targets: tuple[int, ...] = TARGETS,
          cache_dir: Path = CACHE_DIR, record: dict | None = None, verify: int = 0,
          seed: int = 0, write_record: Path | None = None) -> dict:
    """Record, compile for every target (or read the cache, or the committed record: verify
    variants of it compiled again), and return a JSON-ready report."""
    from benchmarks.kernel_builds.aot_build import build_all, cache_key
    from raypaged.kernels.paged_decode import MAX_SPLITS

    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}; choices: {', '.join(PROFILES)}")
    launches = [launch for launch in engine_launches(MAX_SPLITS) if PROFILES[profile](launch)]
    variants, users = record_variants(launches)
    sample = sharing_sample(variants, users)
    direct = [(v, cap) for v in sample for cap in targets[1:]]
    results, direct_results, stats = build_all(variants, targets, cache_dir, direct=direct,
                                               record=record, verify=verify, seed=seed,
                                               fresh=sample)
    if write_record is not None:
        built = [(v, cap) for v in variants for cap in targets]
        # the label is the variant's (recomputed on reading), the CPU seconds this machine's
        entries = {cache_key(v, cap): {**{k: val for k, val in asdict(r).items()
                                          if k != "label"}, "seconds": 0.0}
                   for (v, cap), r in zip(built, results)}
        write_record_file(write_record, entries)
    shared = {(r.kernel, r.label, r.capability): r for r in results}
    sharing = [{"kernel": d.kernel, "label": d.label, "capability": d.capability,
                "built_from": shared[d.kernel, d.label, d.capability].built_from,
                "equal": _same_build(d, shared[d.kernel, d.label, d.capability])}
               for d in direct_results]
    rows = []
    for i, r in enumerate(results):
        launched_by = users[i // len(targets)]
        first = launched_by[0]  # names the row; the others differ only where the kernel doesn't
        rows.append({**asdict(r),
                     "op": first.op, "dtype": NAMES[first.dtype], "kv_dtype": first.kv_dtype,
                     "cache_dtype": NAMES[first.cache_dtype], "block_size": first.block_size,
                     "head_dim": first.head_dim, "group": first.group, "kv_heads": first.kv_heads,
                     "default": any(map(is_default, launched_by)), "launches": len(launched_by),
                     # refused by gpu_support for every launch that needs it: must equal
                     # `not compiled` (the split merge, say, serves fp8 and bf16 caches alike)
                     "refused": all(triton_kv_dtype_problem(divmod(r.capability, 10), u.kv_dtype,
                                                            DTYPE_NAMES[u.dtype])
                                    for u in launched_by)})
    return {"profile": profile, "launches": len(launches), "variants": len(variants),
            "targets": list(targets), **stats, "results": rows, "sharing_check": sharing}


def read_record(path: Path) -> dict:
    with gzip.open(path, "rt") as f:
        return json.load(f)


def write_record_file(path: Path, entries: dict) -> None:
    # gzip, mtime 0: ~195 KB for the full profile instead of ~900, and the same bytes for the
    # same builds (a rerun changes nothing in git)
    text = "{\n" + ",\n".join(f"{json.dumps(k)}: {json.dumps(entries[k], sort_keys=True)}"
                              for k in sorted(entries)) + "\n}\n"
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
        f.write(text.encode())


def sharing_sample(variants: list, users: list[list[Launch]]) -> list:
    """The variants also built from the AST for each target alone, to check that the shared
    frontend (kernels/aot_build.py) changes nothing: per kernel, the first variant at the default
    block size, head dim 128 and a bf16 model, with a bf16 cache and with an fp8 one."""
    sample = {}
    for v, launched_by in zip(variants, users):
        for u in launched_by:
            if (u.block_size, u.head_dim, u.dtype) == (16, 128, torch.bfloat16):
                sample.setdefault((v.kernel, NAMES[u.cache_dtype]), v)
    return list({v.key(): v for v in sample.values()}.values())


def _same_build(direct, shared) -> bool:
    """Byte-identical PTX and cubin, or the same failure."""
    if not (direct.compiled and shared.compiled):
        return direct.compiled == shared.compiled and direct.error == shared.error
    return (direct.ptx_sha256, direct.cubin_sha256) == (shared.ptx_sha256, shared.cubin_sha256)


PROFILES = {"ci": in_ci_profile, "full": lambda launch: True}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", choices=list(PROFILES), default="full")  # what CI builds
    parser.add_argument("--out", type=Path, help="write the JSON report here")
    parser.add_argument("--cache-dir", type=Path, default=CACHE_DIR)
    parser.add_argument("--record", type=Path, help="a committed record to read where the cache "
                        f"misses (aot_build's docstring); the repository's: {RECORD}")
    parser.add_argument("--verify", type=int, default=0,
                        help="variants the record answers to compile again and compare")
    parser.add_argument("--seed", type=int, help="draws the variants verified (default: random)")
    parser.add_argument("--write-record", type=Path,
                        help="write every result of this run as a record")
    args = parser.parse_args(argv)
    seed = random.randrange(2**31) if args.seed is None else args.seed
    record = read_record(args.record) if args.record else None
    report = check(args.profile, cache_dir=args.cache_dir, record=record, verify=args.verify,
                   seed=seed, write_record=args.write_record)
    bad = [r for r in report["results"] if not r["compiled"]]
    print(f"{report['launches']} launches -> {report['variants']} kernel variants x "
          f"{len(report['targets'])} targets: {len(bad)} did not compile, "
          f"{report['builds']} built in {report['seconds']} s ({report['cpu_seconds']} CPU s); "
          f"shared frontend equal to a build from the AST in "
          f"{sum(c['equal'] for c in report['sharing_check'])} of {len(report['sharing_check'])} "
          f"sampled builds; {report['flaky']} compiled only on the retry"
          + (f" (first: {report['first_flaky_error']})" if report["flaky"] else ""))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    sys.exit(main())
