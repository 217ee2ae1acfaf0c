"""The machine's limits the cases are compared with: GEMM rates and read bandwidth.

- :func:`measure_gemm` (fp32, NumPy's BLAS) and :func:`measure_gemm_bf16` (``torch.mm``):
  the compute limit, measured before and after the cases;
- :func:`gemm_reader` (``gemm``): the fp32 GEMM as a callable timed in the interleaved
  rounds of each float32 prefill case, the limit its rate is compared with;
- :func:`measure_bandwidth`: the best-of read bandwidth, measured before and after;
- :func:`kv_reader` (``kv-read``) and :func:`mem_reader` (``bw``): callables timed in the
  interleaved rounds of each decode case, so that their medians meet the same moments of
  a shared machine's memory traffic as the implementations.
"""

from __future__ import annotations

import datetime
import importlib
import math
import os
import platform
import sys
import threading
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

import fastattn
from fastattn.bench.cases import Array

if TYPE_CHECKING:
    from fastattn.bench.inputs import Inputs

T = TypeVar("T")


class blas_limit:
    """threadpoolctl limit on BLAS threads, when threadpoolctl is installed.  The
    controller (which scans the loaded libraries, ~3 ms; NumPy's BLAS is loaded
    before the first limit) is made once, so that a limit costs ~0.05 ms and can
    sit inside a timed call."""

    _controller: Any = None

    def __init__(self, n: int) -> None:
        self.n = n
        self.ctx: Any = None

    def __enter__(self) -> blas_limit:
        if blas_limit._controller is None:
            try:
                threadpoolctl: Any = importlib.import_module("threadpoolctl")  # optional, untyped
            except ImportError:
                return self
            blas_limit._controller = threadpoolctl.ThreadpoolController()
        self.ctx = blas_limit._controller.limit(limits=self.n, user_api="blas")
        self.ctx.__enter__()
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.ctx is not None:
            self.ctx.__exit__(t, e, tb)


def in_threads(fn: Callable[[T], object], parts: Sequence[T]) -> None:
    """fn(part) for every part, each in its own thread; returns when all are done."""
    ts = [threading.Thread(target=fn, args=(p,)) for p in parts]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def gemv_reader(shares: list[list[Array]]) -> Callable[[], None]:
    """A callable in which thread i reads the 2-D float32 arrays of ``shares[i]``
    (at most 4096 columns) with single-threaded BLAS GEMVs against ones."""
    ones = np.ones(4096, dtype=np.float32)

    def read(parts: list[Array]) -> None:
        # 8-bit K/V read as float32 words holds inf/NaN patterns: only the speed matters
        # (errstate is per thread: set here, in the reading thread)
        with np.errstate(all="ignore"):
            for p in parts:
                p @ ones[: p.shape[1]]

    def run() -> None:
        with blas_limit(1):
            in_threads(read, shares)

    return run


def kv_reader(inp: Inputs, threads: int) -> Callable[[], None]:
    """The decode yardstick: a callable in which ``threads`` Python threads each
    read a share of the case's own K and V bytes with a single-threaded BLAS
    GEMV against a cached vector of ones (the fastest NumPy read measured here:
    faster than a sum or an integer OR-reduce).  The bytes are viewed as float32
    whatever the dtype (16-bit pairs read as float32 are ordinary numbers; only
    the speed matters; 8-bit bytes read as float32 hold a few denormal, inf and NaN
    words, which the GEMV reads at the same speed on the CPUs measured).  8-bit K/V: their
    per-token scales are read too, as the kernel reads them."""
    shares: list[list[Array]] = [[] for _ in range(threads)]
    for a in (inp.k, inp.v, inp.k_scale, inp.v_scale):
        if a is None:  # no scales (float K/V)
            continue
        assert not isinstance(a, list)  # decode cases only
        flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8)  # the arrays are contiguous: no copy
        words = flat[: flat.size // 4 * 4].view(np.float32)
        rows = words.size // 4096
        for i, part in enumerate(np.array_split(np.arange(rows), threads)):
            if part.size:
                shares[i].append(words[part[0] * 4096 : (part[-1] + 1) * 4096].reshape(-1, 4096))
        if words.size > rows * 4096:
            shares[-1].append(words[rows * 4096 :].reshape(1, -1))
    return gemv_reader(shares)


def read_parts(threads: int, nbytes: int) -> list[Array]:
    """A float32 array of ``nbytes`` as ``threads`` row blocks of 4096 values."""
    a = np.ones(nbytes // 4, dtype=np.float32)
    return np.array_split(a.reshape(-1, 4096), threads)


def mem_reader(threads: int, nbytes: int) -> Callable[[], None]:
    """The machine-bandwidth yardstick of decode cases, timed in their interleaved
    rounds: a callable in which ``threads`` Python threads each read a share of one
    ``nbytes`` float32 array with a single-threaded GEMV against ones (the faster of
    the two reads ``measure_bandwidth`` tries, on every run here)."""
    return gemv_reader([[p] for p in read_parts(threads, nbytes)])


def measure_bandwidth(threads: int, nbytes: int = 1 << 30, repeat: int = 3) -> float:
    """Read bandwidth (GB/s): ``threads`` Python threads each reduce a part of a
    ``nbytes`` float32 array (NumPy releases the GIL), best of a sum and a GEMV
    against a cached vector."""
    parts = read_parts(threads, nbytes)
    ones = np.ones(4096, dtype=np.float32)
    best = math.inf

    def go(fn: Callable[[Array], object]) -> float:
        t0 = time.perf_counter()
        in_threads(fn, parts)
        return time.perf_counter() - t0

    readers: list[Callable[[Array], object]] = [lambda p: np.add.reduce(p, axis=None), lambda p: p @ ones]
    with blas_limit(1):
        for fn in readers:
            go(fn)
            for _ in range(repeat):
                best = min(best, go(fn))
    return nbytes / best / 1e9


def measure_gemm(threads: int, n: int = 2048, repeat: int = 5) -> float:
    """fp32 GEMM rate (GFLOP/s) of NumPy's BLAS, n×n×n: the best of ``repeat``
    back-to-back calls of :func:`gemm_reader`'s product after a warm-up call."""
    run, flops = gemm_reader(threads, n)
    run()
    best = math.inf
    for _ in range(repeat):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return flops / best / 1e9


def gemm_reader(threads: int, n: int = 2048) -> tuple[Callable[[], None], float]:
    """The prefill yardstick timed in each float32 prefill case's interleaved rounds
    (``gemm``), so that its median meets the same moments of a shared machine as the
    implementations (a GEMM measured only before and after the cases moved by 20%
    between the two on the 2-vCPU VMs): ``(call, flops)``, the call one n×n×n
    ``np.matmul`` of NumPy's BLAS limited to ``threads`` threads (:func:`measure_gemm`
    times the same call back to back)."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    c = np.empty((n, n), dtype=np.float32)

    def run() -> None:
        with blas_limit(threads):
            np.matmul(a, b, out=c)

    return run, 2.0 * n**3


def measure_gemm_bf16(threads: int, n: int = 2048, repeat: int = 5) -> float | None:
    """bfloat16 GEMM rate (GFLOP/s) of ``torch.mm``, n×n×n: the machine's 16-bit
    limit (oneDNN uses AMX or AVX512-BF16 where present); None without torch, and
    None on a CPU without bf16 arithmetic (neither AVX512-BF16 nor AMX): there
    torch.mm emulates bf16 at a fraction of the float32 rate (0.3 GFLOP/s measured on
    a Zen 3), which is no limit of the machine, and took minutes to measure."""
    from fastattn import _kernels

    if not (_kernels.cpu_has("avx512bf16") or _kernels.cpu_has("amx")):
        return None
    try:
        import torch
    except ImportError:
        return None
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(0)
        a = torch.randn(n, n, generator=g).to(torch.bfloat16)
        b = torch.randn(n, n, generator=g).to(torch.bfloat16)
        torch.mm(a, b)
        best = math.inf
        for _ in range(repeat):
            t0 = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(prev)
    return 2.0 * n**3 / best / 1e9


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what :mod:`platform` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(threads: int, gemm: float | None, bw: float | None) -> dict[str, Any]:
    """The ``machine`` object of the JSON output."""
    versions = {"numpy": np.__version__, "fastattn": fastattn.__version__}
    for mod in ("torch", "onnxruntime", "onnx"):
        try:
            versions[mod] = importlib.import_module(mod).__version__
        except ImportError:
            pass
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "isa": fastattn.get_isa(),
        "threads": threads,
        "gemm_gflops": gemm,
        "bandwidth_gbps": bw,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "versions": versions,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "OPENBLAS_CORETYPE": os.environ.get("OPENBLAS_CORETYPE"),
        "OPENBLAS_L2_SIZE": os.environ.get("OPENBLAS_L2_SIZE"),
    }
