#!/bin/bash
# One prepared GPU check of the CUDA backend, for a machine with an NVIDIA GPU,
# nvcc, and numpy/Cython/ml_dtypes/pytest already installed (no network needed).
# Builds fastattn in place with FASTATTN_CUDA=1, then runs benchmarks/cuda_check.py
# (tests/cuda/test_cuda.py against the reference, then timings against torch if present).
#   bash tools/gpu_check.sh [ARCHS]        ARCHS default "90" (FASTATTN_CUDA_ARCHS)
# Logs go to $OUT (default /tmp/fastattn_gpu) as build.log and check.log.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/fastattn_gpu}
mkdir -p "$OUT"
cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee "$OUT/gpu.txt"
nvcc --version | tail -2
$PY -c "import sys, numpy, ml_dtypes, Cython; print(sys.version.split()[0], numpy.__version__, ml_dtypes.__version__, Cython.__version__)" || exit 1
t0=$(date +%s)
if ! FASTATTN_CUDA=1 FASTATTN_CUDA_ARCHS="${1:-90}" $PY setup.py build_ext --inplace -j 8 >"$OUT/build.log" 2>&1; then
    tail -60 "$OUT/build.log"
    exit 1
fi
echo "build: $(( $(date +%s) - t0 )) s"
grep -E "ptxas|spill|registers" "$OUT/build.log" | head -20
$PY -c "import fastattn.cuda as c; print('available:', c.is_available()); print(c.build_info())" || exit 1
timeout 420 $PY benchmarks/cuda_check.py 2>&1 | tee "$OUT/check.log"
timeout 120 $PY benchmarks/cuda_check.py --no-tests --dtype float32 2>&1 | tee "$OUT/check_f32.log"
