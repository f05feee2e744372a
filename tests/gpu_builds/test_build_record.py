"""benchmarks/kernel_builds/aot_build reads a committed record where its cache misses, and does
not trust it: a variant drawn for verification is compiled again, and a recorded result that
differs from the compiler's (here: registers and spills edited) is reported, naming the build.

Two store_kv variants (bf16 and fp8 cache) for sm_80 and sm_90, compiled for real in a fresh
interpreter (tests/gpu_builds/test_compile_check.py says why), a few seconds.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)
ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r'''
import json, sys, tempfile
from dataclasses import asdict
from pathlib import Path

import torch
from benchmarks.kernel_builds import aot_build
from benchmarks.kernel_builds.compile_check import Launch, record_variants

targets = (80, 90)
launches = [Launch("store_kv", torch.bfloat16, kv, 16, 64, kv_heads=1)
            for kv in ("auto", "fp8_e4m3")]
variants, _ = record_variants(launches)
results, _, built = aot_build.build_all(variants, targets, Path(tempfile.mkdtemp()), workers=1)
record = {aot_build.cache_key(v, cap): {k: x for k, x in asdict(r).items() if k != "label"}
          for (v, cap), r in zip([(v, c) for v in variants for c in targets], results)}
_, _, read = aot_build.build_all(variants, targets, Path(tempfile.mkdtemp()), workers=1,
                                 record=record)
bf16 = aot_build.cache_key(variants[0], 90)
record[bf16] = {**record[bf16], "registers": record[bf16]["registers"] + 100, "spill_stores": 8}
again, _, verified = aot_build.build_all(variants, targets, Path(tempfile.mkdtemp()), workers=1,
                                         record=record, verify=2)
print(json.dumps({"built": built, "read": read, "verified": verified,
                  "registers": [r.registers for r in again], "compiled": [r.compiled for r in again],
                  "labels": [v.label for v in variants]}))
'''


def test_a_record_is_read_where_the_cache_misses_and_an_edited_entry_is_caught(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    built, read, verified = out["built"], out["read"], out["verified"]
    assert (built["builds"], built["record_hits"], built["record_missing"]) == (4, 0, 4)
    # an empty cache, the whole record: nothing compiled
    assert (read["builds"], read["record_hits"], read["record_missing"]) == (0, 4, 0)
    assert read["record_mismatches"] == []
    # both variants drawn: all four builds again, the edited one named
    assert (verified["builds"], verified["record_verified"], verified["record_hits"]) == (4, 4, 0)
    assert verified["record_mismatches"] == [f"{out['labels'][0]} sm_90"]
    # what the run returns is the compiler's result, not the edited record's
    assert out["compiled"] == [True, True, False, True]  # fp8 cache: not on sm_80
    assert out["registers"][1] < 100
