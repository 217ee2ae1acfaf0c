"""asv benchmarks: fastattn and the plain NumPy softmax(Q Kᵀ) V over the cases of
``python -m fastattn.bench`` (shapes reduced where a case is too big for asv's
many repetitions).  Self-contained: uses only fastattn's public API, so older
commits can be benchmarked too.

Run from the repository root (see asv.conf.json)::

    asv run --python=same --quick --show-stderr --set-commit-hash $(git rev-parse HEAD)
"""

from __future__ import annotations

import os

import numpy as np

import fastattn
from fastattn import bench as bench_cmd

THREADS = int(os.environ.get("FASTATTN_BENCH_THREADS", "0")) or (os.cpu_count() or 1)

# name: (B, Hq, Hk, L, S, D, causal, window, kv dtype or None)
PREFILL = {
    "B1 H8 L1024 D64": (1, 8, 8, 1024, 1024, 64, False, None, None),
    "B1 H8 L1024 D64 causal": (1, 8, 8, 1024, 1024, 64, True, None, None),
    "B1 H8 L2048 D128": (1, 8, 8, 2048, 2048, 128, False, None, None),
    "B4 H8 L512 D64 causal": (4, 8, 8, 512, 512, 64, True, None, None),
    # reduced from L16384: the NumPy baseline materialises the L×L scores
    "B1 H8 L4096 D64 window512": (1, 8, 8, 4096, 4096, 64, True, (512, 0), None),
    "B1 H8 L16 D64": (1, 8, 8, 16, 16, 64, False, None, None),
}
DECODE = {
    "B1 H32 S8192 D128 decode": (1, 32, 32, 1, 8192, 128, False, None, None),
    "B1 H32/8 S8192 D128 decode": (1, 32, 8, 1, 8192, 128, False, None, None),
    "B8 H32/8 S2048 D128 decode": (8, 32, 8, 1, 2048, 128, False, None, None),
    "B1 H64/8 S8192 D128 decode": (1, 64, 8, 1, 8192, 128, False, None, None),
    "B1 H32 S8192 D128 decode f16kv": (1, 32, 32, 1, 8192, 128, False, None, "float16"),
    "B1 H32 S8192 D128 decode bf16kv": (1, 32, 32, 1, 8192, 128, False, None, "bfloat16"),
    "B1 H32/8 S8192 D128 decode f16kv": (1, 32, 8, 1, 8192, 128, False, None, "float16"),
}
VARLEN_LENGTHS = (1300, 257, 2048, 700, 128, 1024, 512, 1800)


def _dtype(name):
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _inputs(B, Hq, Hk, L, S, D, kv_dtype, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, Hq, L, D), dtype=np.float32)
    k = rng.standard_normal((B, Hk, S, D), dtype=np.float32)
    v = rng.standard_normal((B, Hk, S, D), dtype=np.float32)
    if kv_dtype:
        k, v = k.astype(_dtype(kv_dtype)), v.astype(_dtype(kv_dtype))
    return q, k, v


def _mask(L, S, causal, window):
    """Additive float32 (L, S) mask (bottom-right aligned), or None."""
    ok = bench_cmd.bool_mask(L, S, causal, window)
    return None if ok is None else np.where(ok, 0.0, -np.inf).astype(np.float32)


def _blas_limit(n):
    """Limit NumPy's BLAS to n threads for the NumPy baseline, through threadpoolctl when it
    is installed (asv's virtualenvs get it from asv.conf.json).  Without it (``pip install
    asv .`` and ``--python=same``) BLAS keeps its default, all cores, which is what n is
    unless FASTATTN_BENCH_THREADS asks for fewer: only then is threadpoolctl needed, and
    the row is skipped (NotImplementedError) rather than timed with the wrong thread count."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        if n < (os.cpu_count() or 1):
            raise NotImplementedError(
                f"FASTATTN_BENCH_THREADS={n} needs threadpoolctl to limit NumPy's BLAS "
                "(pip install threadpoolctl)"
            ) from None
        return None
    return threadpool_limits(limits=n, user_api="blas")


class _Cases:
    cases: dict = {}
    params = ([], ["fastattn", "numpy"])
    param_names = ["case", "impl"]

    def setup(self, case, impl):
        B, Hq, Hk, L, S, D, causal, window, kv = self.cases[case]
        q, k, v = _inputs(B, Hq, Hk, L, S, D, kv)
        if impl == "fastattn":
            gqa = Hq != Hk
            self.fn = lambda: fastattn.scaled_dot_product_attention(
                q, k, v, is_causal=causal, window=window, enable_gqa=gqa, num_threads=THREADS
            )
        else:
            add = _mask(L, S, causal, window)
            self.limits = _blas_limit(THREADS)
            self.fn = lambda: bench_cmd.numpy_attention(q, k, v, add)

    def teardown(self, case, impl):
        limits = getattr(self, "limits", None)
        if limits is not None:
            limits.restore_original_limits()


class Prefill(_Cases):
    """Prefill (L query rows against S keys), float32."""

    cases = PREFILL
    params = (list(PREFILL), ["fastattn", "numpy"])
    timeout = 120

    def time_attention(self, case, impl):
        self.fn()


class Decode(_Cases):
    """Decode: one query row against a KV cache of S keys (16-bit caches for f16kv/bf16kv)."""

    cases = DECODE
    params = (list(DECODE), ["fastattn", "numpy"])
    timeout = 120

    def time_attention(self, case, impl):
        self.fn()


class Varlen:
    """8 packed causal sequences (H8 D64): one varlen call against a per-sequence loop."""

    params = (["fastattn varlen", "fastattn loop", "numpy loop"],)
    param_names = ["impl"]

    def setup(self, impl):
        rng = np.random.default_rng(0)
        T = sum(VARLEN_LENGTHS)
        self.q, self.k, self.v = (rng.standard_normal((T, 8, 64), dtype=np.float32) for _ in range(3))
        self.cu = np.concatenate([[0], np.cumsum(VARLEN_LENGTHS)]).astype(np.int64)
        self.seqs = [
            tuple(np.ascontiguousarray(a[s:e].transpose(1, 0, 2)) for a in (self.q, self.k, self.v))
            for s, e in zip(self.cu[:-1], self.cu[1:])
        ]
        self.masks = [_mask(n, n, True, None) for n in VARLEN_LENGTHS]

    def time_varlen(self, impl):
        if impl == "fastattn varlen":
            fastattn.varlen_attention(
                self.q, self.k, self.v, self.cu, self.cu, is_causal=True, num_threads=THREADS
            )
        elif impl == "fastattn loop":
            for q, k, v in self.seqs:
                fastattn.scaled_dot_product_attention(q, k, v, is_causal=True, num_threads=THREADS)
        else:
            for (q, k, v), m in zip(self.seqs, self.masks):
                bench_cmd.numpy_attention(q[None], k[None], v[None], m)


class Memory:
    """Peak memory of one call.  At L=32768 the NumPy baseline would need 4 GiB of
    scores and is skipped; fastattn's extra memory stays a few MiB above its
    inputs and output (see ``track_extra_mib``)."""

    params = ([8192, 32768], ["fastattn", "numpy"])
    param_names = ["L", "impl"]
    timeout = 300

    def setup(self, L, impl):
        if impl == "numpy" and L > 8192:
            raise NotImplementedError("the NumPy baseline would materialise 4 GiB of scores")
        self.q, self.k, self.v = _inputs(1, 1, 1, L, L, 64, None)
        self.out = np.zeros_like(self.q)

    def _call(self, impl):
        if impl == "fastattn":
            fastattn.scaled_dot_product_attention(self.q, self.k, self.v, out=self.out, num_threads=THREADS)
        else:
            self.out[...] = bench_cmd.numpy_attention(self.q, self.k, self.v)

    def peakmem_attention(self, L, impl):
        """Whole-process peak RSS (includes the interpreter and the inputs)."""
        self._call(impl)

    def track_extra_mib(self, L, impl):
        """Peak RSS during the call above the RSS before it (inputs and output
        already allocated and touched), in MiB; Linux only."""
        return extra_peak_mib(lambda: self._call(impl))

    track_extra_mib.unit = "MiB"


def extra_peak_mib(fn) -> float:
    """Run fn and return the peak resident memory it added, in MiB (resets the
    kernel's high-water mark through /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        raise NotImplementedError("needs Linux /proc/self/clear_refs") from None
    before = _status_kib("VmRSS")
    fn()
    return (_status_kib("VmHWM") - before) / 1024.0


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise NotImplementedError(f"no {field} in /proc/self/status")
