#!/usr/bin/env bash
# `make gpu-check`: everything issue 31 asks of a GPU machine, in one command that a bare one can
# run (python3 with torch + triton + transformers + safetensors, no ray, no install, no internet).
# Each phase has its own time limit and a failure does not stop the next, so one short lease
# returns every result it can. Results land in benchmarks/results/, and also in $OUT when set
# (the device tool's return folder), with the whole log.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
PY=${PY:-python3}
OUT=${OUT:-}
failed=0
stamp=$(mktemp)  # only results written by this run go to $OUT, not the committed ones

phase() {  # phase <seconds> <command...>
    local limit=$1 rc=0
    shift
    echo "== $* (limit ${limit} s)"
    timeout -k 15 "$limit" "$@" || rc=$?
    [ "$rc" = 0 ] || { echo "== FAILED (rc $rc): $*"; failed=1; }
    [ -z "$OUT" ] || find benchmarks/results -maxdepth 1 -newer "$stamp" \
        \( -name 'kernels_*' -o -name 'engine_decode_*' \) -exec cp {} "$OUT"/ \;
    return 0
}

main() {
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
    # kernels in parallel (compiles dominate); the end-to-end tests one at a time (8B models)
    xdist=$($PY -c "import xdist" 2>/dev/null && echo "-n 4")
    # 540 s in all: one call of the device tool allows 600
    phase 90 $PY -m pytest tests/gpu/test_kernels_cuda.py -q -p no:cacheprovider $xdist
    phase 130 $PY -m pytest tests/gpu/test_e2e_backends.py -q -s -p no:cacheprovider
    phase 150 $PY benchmarks/kernel_bench.py
    phase 170 $PY benchmarks/cuda_graph_bench.py
    return $failed
}

if [ -n "$OUT" ]; then main 2>&1 | tee "$OUT/gpu_check.log"; exit "${PIPESTATUS[0]}"; else main; fi
