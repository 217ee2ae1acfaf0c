#!/usr/bin/env python
"""Coverage-guided fuzzing of fastattn's argument space with atheris (libFuzzer).

Each input is decoded into one call of ``scaled_dot_product_attention``,
``varlen_attention``, ``attention_with_kvcache`` or ``KVCache``: shapes with
zero and large sizes (GQA groups up to 300 heads over 1 kv head), every
storage dtype, bool/float masks (finfo.min, +-inf, NaN, masked arrays,
memoryviews), windows and block sizes up to and beyond 2**63, sinks, lengths,
``out=`` buffers that may alias a mask, extreme scales, thread counts and ISA
paths.  A call must either raise ``TypeError``/``ValueError`` (bad input,
before any C code runs) or return a result that matches ``fastattn.reference``
wherever the reference is finite, with inputs left unmodified.  Anything else
(another exception, a wrong result, a crash, a hang) is a finding.

    python tools/fuzz_args.py -max_total_time=60          # what .ci/run does
    python tools/fuzz_args.py -runs=100000 corpus_dir/    # longer, keeping a corpus
    python tools/fuzz_args.py --no-atheris 2000           # random bytes, no atheris

Without atheris installed (``pip install atheris``) the same decoder runs on
random bytes (``--no-atheris N``: N inputs), which finds less but checks the
same properties.  Under tools/sanitize.sh the C kernels run with ASan/UBSan.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

try:
    import atheris
except ImportError:  # pragma: no cover - optional
    atheris = None

if atheris is not None and "--no-atheris" not in sys.argv:
    with atheris.instrument_imports():
        import fastattn
        from fastattn import reference as ref
else:
    import fastattn
    from fastattn import reference as ref

import ml_dtypes

DTYPES = [np.float32, np.float64, np.float16, ml_dtypes.bfloat16]
ISAS = [i for i in ("scalar", "avx2", "avx512") if fastattn._kernels.cpu_has(i)]
SPECIAL_INTS = [
    0,
    1,
    2,
    3,
    7,
    31,
    32,
    33,
    96,
    97,
    192,
    193,
    2**31 - 1,
    2**31,
    2**62,
    2**63 - 1,
    2**63,
    2**64,
    -1,
    -2,
]
F32_MIN = float(np.finfo(np.float32).min)
SPECIAL_FLOATS = [
    0.0,
    -0.0,
    1.0,
    -1.0,
    1e-40,
    1e-310,
    3e38,
    -3.4028234663852886e38,
    1e300,
    -1e300,
    float("inf"),
    float("-inf"),
    float("nan"),
    2.0**-149,
]


class Decoder:
    """Turns fuzzer bytes into argument choices (atheris' provider, or a plain RNG)."""

    def __init__(self, data: bytes):
        if atheris is not None and "--no-atheris" not in sys.argv:
            self.p = atheris.FuzzedDataProvider(data)
            self.rng = None
        else:
            self.p = None
            self.rng = np.random.default_rng(int.from_bytes(data[:8].ljust(8, b"\0"), "little"))

    def int(self, lo, hi):
        if self.p is not None:
            return self.p.ConsumeIntInRange(lo, hi)
        return int(self.rng.integers(lo, hi + 1))

    def pick(self, seq):
        return seq[self.int(0, len(seq) - 1)]

    def bool(self, p_true=0.5):
        return self.int(0, 999) < p_true * 1000

    def seed(self):
        return self.int(0, 2**31)


def _value(d: Decoder, kind):
    """An argument value: usually sensible, sometimes an edge case or junk."""
    r = d.int(0, 9)
    if kind == "int":
        return d.pick(SPECIAL_INTS) if r < 3 else d.int(-1, 40)
    if kind == "float":
        return d.pick(SPECIAL_FLOATS) if r < 3 else d.int(-1000, 1000) / 100.0
    return None


def _junk(d: Decoder):
    return d.pick([None, "x", [1, 2], (1,), 1.5, True, np.array([1, 2]), object(), {}, -1, 2**70])


def one_input(data: bytes) -> None:
    d = Decoder(data)
    fastattn.set_isa(d.pick(ISAS))
    what = d.int(0, 9)
    if what <= 6:
        _sdpa_case(d)
    elif what == 7:
        _varlen_case(d)
    else:
        _kvcache_case(d)


def _arr(rng, shape, dtype, special=None):
    a = rng.standard_normal(shape)
    if special is not None and a.size:
        flat = a.reshape(-1)
        flat[rng.integers(0, flat.size, size=max(1, flat.size // 8))] = special
    with np.errstate(over="ignore"):
        return a.astype(dtype)


def _sdpa_case(d: Decoder):
    rng = np.random.default_rng(d.seed())
    big_group = d.bool(0.15)
    Hk = 1 if big_group else d.int(0, 3)
    G = d.pick([33, 64, 97, 128, 193, 256, 300]) if big_group else d.int(1, 3)
    Hq = Hk * G if d.bool(0.95) else d.int(0, 5)
    B, L = d.int(0, 2), d.int(0, 6)
    S = d.pick([0, 1, 5, 63, 64, 129, 1024, 2100]) if d.bool(0.3) else d.int(0, 40)
    D, Dv = d.pick([1, 3, 8, 16, 17, 64]), d.pick([1, 4, 16, 33])
    dt = d.pick(DTYPES)
    dtk = dt if dt == np.float64 or d.bool(0.7) else d.pick(DTYPES)
    q = _arr(rng, (B, Hq, L, D), dt)
    k = _arr(rng, (B, Hk, S, D), dtk)
    v = _arr(rng, (B, Hk, S, Dv), dtk)
    kw = {}
    if d.bool(0.5):
        kw["is_causal"] = d.pick([True, False, 1, 0, np.bool_(True)]) if d.bool(0.95) else _junk(d)
    if d.bool(0.3):
        mkind = d.int(0, 5)
        shape = d.pick([(L, S), (1, S), (Hq, L, S), (B, Hq, L, S), (B, 1, 1, S)])
        if mkind == 0:
            m = rng.random(shape) > 0.3
        elif mkind in (1, 2):
            special = d.pick(
                [float(np.finfo(np.float32).min), float("-inf"), -1e30, 1e30, float("nan"), -1e300]
            )
            m = _arr(rng, shape, np.float32 if mkind == 1 else np.float64, special)
        elif mkind == 3:
            m = np.ma.masked_array(np.zeros(shape, np.float32), mask=rng.random(shape) > 0.5)
        elif mkind == 4:
            m = memoryview(np.ascontiguousarray(_arr(rng, shape, np.float32)))
        else:
            m = _junk(d)
        kw["attn_mask"] = m
    if d.bool(0.3):
        kw["window"] = (_value(d, "int"), _value(d, "int")) if d.bool(0.9) else _junk(d)
    if d.bool(0.2):
        kw["sinks"] = rng.standard_normal(Hq) * 4 if d.bool(0.9) else _junk(d)
    if d.bool(0.2):
        kw["scale"] = _value(d, "float") if d.bool(0.9) else _junk(d)
    if d.bool(0.15):
        kw["softcap"] = abs(_value(d, "float")) if d.bool(0.9) else _junk(d)
    if d.bool(0.2) and B:
        kw["key_lengths"] = rng.integers(0, S + 1, size=B) if d.bool(0.9) else _junk(d)
    if d.bool(0.15) and B:
        kw["query_lengths"] = rng.integers(0, L + 1, size=B)
    if d.bool(0.15):
        bq, bk = d.pick([1, 2, 3, 64, 2**63 - 1, 2**63]), d.pick([1, 2, 5, 2**40])
        nbq = -(-L // bq) if 0 < bq < 2**63 else 1
        nbk = -(-S // bk) if 0 < bk < 2**63 else 1
        kw["block_mask"] = rng.random((1, 1, nbq, nbk)) > 0.3
        kw["block_size"] = (bq, bk)
    if d.bool(0.2):
        kw["num_threads"] = d.pick([1, 2, 3, 4, 1024, 1025, 0, 2**31]) if d.bool(0.9) else _junk(d)
    if d.bool(0.1):
        kw["return_lse"] = _junk(d)
    else:
        kw["return_lse"] = True
    enable_gqa = Hq != Hk or d.bool(0.2)
    out = None
    if d.bool(0.15):
        out = np.empty((B, Hq, L, Dv), dtype=dt)
        if d.bool(0.3) and Dv == S and "attn_mask" in kw:
            # aliasing: must be refused (memoryview only for dtypes the buffer protocol knows)
            kw["attn_mask"] = memoryview(out) if d.bool(0.5) and dt in (np.float32, np.float64) else out
    _check_call(
        fastattn.scaled_dot_product_attention,
        ref.scaled_dot_product_attention,
        (q, k, v),
        dict(kw, enable_gqa=enable_gqa, out=out),
    )


def _varlen_case(d: Decoder):
    rng = np.random.default_rng(d.seed())
    nb = d.int(0, 3)
    lq = rng.integers(0, 4, size=nb)
    lk = rng.integers(0, 1500 if d.bool(0.2) else 20, size=nb)
    cq, ck = np.concatenate([[0], np.cumsum(lq)]), np.concatenate([[0], np.cumsum(lk)])
    Hk = d.int(0, 2)
    Hq = Hk * d.pick([1, 2, 40])
    dt = d.pick([np.float32, np.float64])
    q, k, v = _arr(rng, (cq[-1], Hq, 8), dt), _arr(rng, (ck[-1], Hk, 8), dt), _arr(rng, (ck[-1], Hk, 8), dt)
    kw = dict(return_lse=True, enable_gqa=True)
    if d.bool(0.5):
        kw["is_causal"] = True
    if d.bool(0.3):
        kw["sinks"] = rng.standard_normal(Hq) * 4
    if d.bool(0.3):
        kw["window"] = (_value(d, "int"), _value(d, "int"))
    try:
        o, lse = fastattn.varlen_attention(q, k, v, cq, ck, **kw)
    except (TypeError, ValueError):
        return
    if Hk == 0 or Hq == 0:
        assert o.size == 0
        return
    g = Hq // Hk
    win = kw.get("window")
    rkw = {key: val for key, val in kw.items() if key not in ("enable_gqa",)}
    if win is not None and max(win) > 2**40:  # the reference's int64 arithmetic wraps
        return
    r, rl = ref.varlen_attention(q, np.repeat(k, g, axis=1), np.repeat(v, g, axis=1), cq, ck, **rkw)
    _compare(o, r, lse, rl, dt)


def _kvcache_case(d: Decoder):
    rng = np.random.default_rng(d.seed())
    B, Hk, S = d.int(1, 2), d.int(1, 2), d.int(1, 12)
    D, Dv = d.pick([0, 1, 8]), d.pick([0, 1, 8])
    kc, vc = np.zeros((B, Hk, S, max(D, 0)), np.float32), np.zeros((B, Hk, S, max(Dv, 0)), np.float32)
    before = (kc.copy(), vc.copy())
    T = d.int(0, 3)
    seq = d.int(0, S) if d.bool(0.9) else _junk(d)
    kw = {}
    if d.bool(0.3):
        kw["window"] = (_value(d, "int"), _value(d, "int"))
    if d.bool(0.2):
        kw["scale"] = _value(d, "float")
    if d.bool(0.1):
        kw["is_causal"] = _junk(d)
    q = _arr(rng, (B, Hk * d.pick([1, 2, 64]), d.int(1, 2), D), np.float32)
    kn, vn = _arr(rng, (B, Hk, T, D), np.float32), _arr(rng, (B, Hk, T, Dv), np.float32)
    try:
        fastattn.attention_with_kvcache(q, kc, vc, seq, kn, vn, **kw)
    except (TypeError, ValueError):
        # every check runs before the first write
        assert np.array_equal(kc, before[0]) and np.array_equal(vc, before[1]), (
            "cache written before an error"
        )


def _check_call(fn, reffn, arrays, kw):
    copies = [np.array(a, copy=True) for a in arrays]
    m = kw.get("attn_mask")
    # The mask as it was before the call (it may alias out, which the call writes).
    mref = np.array(m, copy=True) if isinstance(m, (np.ndarray, memoryview)) else m
    try:
        res = fn(*arrays, **kw)
    except (TypeError, ValueError, NotImplementedError, MemoryError):
        return
    for a, c in zip(arrays, copies):
        assert np.array_equal(a, c, equal_nan=True), "an input was modified"
    o, lse = res if isinstance(res, tuple) else (res, None)  # return_lse may be any falsy value
    q, k, v = arrays
    if q.size == 0 or o.size == 0:
        return
    rkw = {key: val for key, val in kw.items() if key not in ("out", "num_threads", "return_lse")}
    if m is not None:
        rkw["attn_mask"] = mref
    win = rkw.get("window")
    if win is not None and max(win) > 2**40:  # the reference's int64 arithmetic wraps
        return
    sc = rkw.get("scale")
    if sc is not None and abs(sc) > 1e6:  # logits beyond float32's absolute precision
        return
    if isinstance(mref, np.ndarray) and mref.dtype != np.bool_ and mref.size:
        mf = mref.astype(np.float64)
        if np.any(np.isfinite(mf) & (np.abs(mf) > 1e6) & (mf != F32_MIN)):
            return  # huge finite mask values cost ~eps * |logit| (docs/hardening.md)
    if any(a.dtype != np.float64 and np.any(np.abs(a[np.isfinite(a)]) < 1.2e-38) for a in arrays if a.size):
        return  # denormals are flushed inside the kernel
    with np.errstate(all="ignore"):
        r, rl = reffn(q, k, v, return_lse=True, **rkw)
    _compare(o, r, lse, rl, q.dtype)


def _compare(o, r, lse, rl, dt):
    dt = np.dtype(dt)
    tol = 1e-9 if dt == np.float64 else 2e-3 if dt == np.float32 else 5e-2
    o = np.asarray(o, np.float64)
    fin = np.isfinite(r)
    scale = max(1.0, float(np.abs(r[fin]).max())) if fin.any() else 1.0
    if fin.any():
        err = float(np.max(np.abs(o[fin] - r[fin])))
        assert err <= tol * scale, f"output error {err} > {tol} * {scale}"
    assert np.array_equal(np.isnan(o), np.isnan(r)), "NaN positions differ from the reference"
    if lse is None:
        return
    lf = np.isfinite(rl) & (np.abs(rl) < 1e30)
    if lf.any():
        lerr = float(np.max(np.abs(np.asarray(lse, np.float64)[lf] - rl[lf])))
        assert lerr <= tol * 10 * max(1.0, float(np.abs(rl[lf]).max())), f"LSE error {lerr}"


def main() -> int:
    if atheris is None or "--no-atheris" in sys.argv:
        n = int(sys.argv[-1]) if len(sys.argv) > 1 and sys.argv[-1].isdigit() else 1000
        budget = float(os.environ.get("FASTATTN_FUZZ_SECONDS", "60"))
        t0 = time.monotonic()
        done = 0
        for i in range(n):
            if time.monotonic() - t0 > budget:
                break
            one_input(os.urandom(16) if i else b"\0" * 16)
            done += 1
        print(f"fuzz_args (random bytes): {done} inputs, no findings in {time.monotonic() - t0:.0f} s")
        return 0
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()
    return 0


if __name__ == "__main__":
    sys.exit(main())
