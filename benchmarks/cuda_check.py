"""GPU check of fastattn's CUDA kernel: tests, then timings against torch.

Run on a machine with an NVIDIA GPU, from the repository root, after
``FASTATTN_CUDA=1 pip install .`` (or an in-place build)::

    python benchmarks/cuda_check.py            # tests + timings (< 5 minutes)
    python benchmarks/cuda_check.py --no-tests # timings only

1. runs ``pytest tests/cuda/test_cuda.py`` (the kernel against fastattn.reference);
2. times fastattn.cuda.scaled_dot_product_attention on device-resident data
   against torch.nn.functional.scaled_dot_product_attention (when torch with
   CUDA is installed) for prefill and decode shapes, checking that both agree,
   and prints the GPU name, milliseconds and the ratio torch / fastattn
   (> 1: fastattn is faster).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (name, B, Hq, Hk, L, S, D, causal)
CASES = [
    ("prefill B1 H8 L1024 D64", 1, 8, 8, 1024, 1024, 64, False),
    ("prefill B1 H8 L1024 D64 causal", 1, 8, 8, 1024, 1024, 64, True),
    ("prefill B1 H8 L4096 D64", 1, 8, 8, 4096, 4096, 64, False),
    ("prefill B1 H8 L4096 D64 causal", 1, 8, 8, 4096, 4096, 64, True),
    ("prefill B1 H8 L2048 D128", 1, 8, 8, 2048, 2048, 128, False),
    ("prefill B1 H8 L2048 D128 causal", 1, 8, 8, 2048, 2048, 128, True),
    ("decode B1 H32 S8192 D128", 1, 32, 32, 1, 8192, 128, False),
    ("decode B1 H32/8 (GQA) S8192 D128", 1, 32, 8, 1, 8192, 128, False),
]


def run_tests():
    print("== pytest tests/cuda/test_cuda.py", flush=True)
    env = dict(os.environ)
    try:
        r = subprocess.run(
            [sys.executable, "-m", "pytest", "tests/cuda/test_cuda.py", "-q", "-rs"],
            cwd=ROOT,
            env=env,
            timeout=180,
        )
        return r.returncode
    except subprocess.TimeoutExpired:
        print("pytest timed out after 180 s")
        return 1


def _time(fn, sync, budget_s=2.0, min_reps=5, max_reps=200):
    """Median milliseconds of fn() after warm-up, within about budget_s."""
    for _ in range(3):
        fn()
    sync()
    times = []
    t_end = time.perf_counter() + budget_s
    while len(times) < min_reps or (len(times) < max_reps and time.perf_counter() < t_end):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def run_bench(dtype_name):
    import fastattn.cuda as fcuda

    if not fcuda.is_available():
        print(f"fastattn CUDA backend not available: {fcuda.build_info()}")
        return 1
    info = fcuda.build_info()
    print(
        f"== GPU: {info['devices'][0]} | fastattn._cuda archs {info['archs']}, nvcc {info['nvcc']}, "
        f"runtime {info['runtime_version']}, driver {info['driver_version']}"
    )
    try:
        import torch
        import torch.nn.functional as F

        has_torch = torch.cuda.is_available()
    except ImportError:
        has_torch = False
    if not has_torch:
        print("torch with CUDA not found: timing fastattn alone")
    np_dtype = {"float16": np.float16, "float32": np.float32}[dtype_name]
    rng = np.random.default_rng(0)
    print(f"dtype {dtype_name}; times are medians in ms")
    print(f"{'case':36s} {'fastattn':>10s} {'torch':>10s} {'torch/fa':>9s} {'max|diff|':>10s}")
    status = 0
    for name, B, Hq, Hk, L, S, D, causal in CASES:
        q = rng.standard_normal((B, Hq, L, D)).astype(np_dtype)
        k = rng.standard_normal((B, Hk, S, D)).astype(np_dtype)
        v = rng.standard_normal((B, Hk, S, D)).astype(np_dtype)
        gqa = Hq != Hk
        if has_torch:
            tq, tk, tv = (torch.from_numpy(a).cuda() for a in (q, k, v))
            tout = torch.empty_like(tq)

            def fa(tq=tq, tk=tk, tv=tv, tout=tout, causal=causal, gqa=gqa):
                fcuda.scaled_dot_product_attention(tq, tk, tv, is_causal=causal, enable_gqa=gqa, out=tout)

            def th(tq=tq, tk=tk, tv=tv, causal=causal, gqa=gqa):
                return F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal, enable_gqa=gqa)

            sync = torch.cuda.synchronize
            fa()
            ref = th()
            sync()
            diff = float((tout.float() - ref.float()).abs().max())
            t_fa = _time(fa, sync)
            t_th = _time(th, sync)
            tol = 2e-2 if np_dtype == np.float16 else 2e-3
            flag = "" if diff <= tol else "  MISMATCH"
            status |= diff > tol
            print(f"{name:36s} {t_fa:10.3f} {t_th:10.3f} {t_th / t_fa:9.2f} {diff:10.2e}{flag}", flush=True)
        else:
            dq, dk, dv = (fcuda.to_device(a) for a in (q, k, v))
            dout = fcuda.DeviceArray(q.shape, q.dtype)

            def fa(dq=dq, dk=dk, dv=dv, dout=dout, causal=causal, gqa=gqa):
                fcuda.scaled_dot_product_attention(dq, dk, dv, is_causal=causal, enable_gqa=gqa, out=dout)

            t_fa = _time(fa, fcuda.synchronize)
            print(f"{name:36s} {t_fa:10.3f} {'-':>10s} {'-':>9s} {'-':>10s}", flush=True)
    return int(status)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-tests", action="store_true", help="skip pytest")
    ap.add_argument("--dtype", default="float16", choices=["float16", "float32"])
    a = ap.parse_args()
    t0 = time.time()
    rc = 0 if a.no_tests else run_tests()
    rc |= run_bench(a.dtype)
    print(f"== done in {time.time() - t0:.0f} s, exit status {rc}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
