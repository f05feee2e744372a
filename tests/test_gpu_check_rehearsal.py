"""`make gpu-check` rehearsed on the CPU, so no GPU time is spent on an import or argument error.

The GPU box has torch, triton, transformers and safetensors but none of our serving
dependencies and no install of raypaged (benchmarks/gpu_check.sh runs with PYTHONPATH set to the
checkout). Here those dependencies are made unimportable and every script and test module that
gpu-check runs is imported, its arguments parsed, its tests collected.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# installed here for serving, batch and structured output; absent on the GPU box
ABSENT_THERE = ("ray", "pydantic", "pydantic_core", "fastapi", "starlette", "uvicorn", "openai",
                "xgrammar", "llguidance", "outlines_core", "gguf")
BLOCKER = f"""
import importlib.abc, sys
class _AbsentOnTheGpuBox(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {ABSENT_THERE!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (absent on the GPU box)")
sys.meta_path.insert(0, _AbsentOnTheGpuBox())
"""


def run_as_on_the_gpu_box(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def test_the_blocker_blocks(tmp_path):
    r = run_as_on_the_gpu_box(tmp_path, "-c", "import ray")
    assert r.returncode == 1 and "absent on the GPU box" in r.stderr


def test_benchmarks_import_and_parse_their_arguments(tmp_path):
    for script, flag in (("benchmarks/kernel_bench.py", "--max-kv-tokens"),
                         ("benchmarks/cuda_graph_bench.py", "--configs")):
        r = run_as_on_the_gpu_box(tmp_path, script, "--help")
        assert r.returncode == 0, r.stderr
        assert flag in r.stdout


def test_gpu_tests_collect_and_their_engine_path_imports(tmp_path):
    r = run_as_on_the_gpu_box(tmp_path, "-m", "pytest", "--collect-only", "-q",
                              "-p", "no:cacheprovider", "tests/gpu")
    assert r.returncode in (0, 5), r.stdout + r.stderr  # 5: every module skipped without CUDA
    assert "error" not in r.stdout.lower(), r.stdout
    # what the end-to-end tests and the engine bench build, imported as they import it
    r = run_as_on_the_gpu_box(tmp_path, "-c", "import benchmarks.random_model, "
                              "raypaged.model.setup, raypaged.core.sampling_params, "
                              "benchmarks.kernel_reference, benchmarks._kernels; "
                              "from benchmarks._kernels import kernel_module; "
                              "[kernel_module(k) for k in ('paged_decode', 'paged_prefill', 'store_kv')]")
    assert r.returncode == 0, r.stderr


def test_the_script_parses():
    assert subprocess.run(["bash", "-n", str(ROOT / "benchmarks/gpu_check.sh")]).returncode == 0
