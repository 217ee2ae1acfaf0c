"""Regression tests for the defects of issue 17 (an adversarial probe of the
installed package): scratch overruns with large GQA groups, zero heads,
sinks with split-KV decode, fork safety, masks at finfo.min, window bounds
near 2**63, num_threads bounds, kvcache checks before writes, out= overlap
with converted arrays, the rounding mode of worker threads, and smaller items.

Cases that used to crash the process (heap overrun, SIGFPE, a hang after
fork, libgomp's exit()) run in a child process, so that a regression fails
the test instead of killing the pytest run.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import subprocess
import sys
import textwrap
import threading
import tracemalloc

import numpy as np
import pytest
from conftest import ISAS, assert_close, optional, randn, under_asan

import fastattn
from fastattn import reference as ref

sdpa = fastattn.scaled_dot_product_attention
F32_MIN = float(np.finfo(np.float32).min)


def run_child(code, timeout=120, env=None):
    """Run ``code`` in a fresh interpreter; fail (not crash) on a non-zero exit,
    a signal or a timeout, showing the child's output."""
    e = dict(os.environ)
    e.update(env or {})
    try:
        r = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=e,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(fastattn.__file__))),  # this fastattn
        )
    except subprocess.TimeoutExpired as t:
        pytest.fail(f"child timed out after {timeout} s (a hang); output:\n{t.stdout}\n{t.stderr}")
    assert r.returncode == 0, f"child exited with {r.returncode}:\n{r.stdout}\n{r.stderr[-4000:]}"
    return r.stdout


# ---------------------------------------------------------------- 1. GQA > row block

GQA_CHILD = """
import numpy as np, fastattn
from fastattn import reference as ref
fastattn.set_isa({isa!r})
rng = np.random.default_rng(0)
for dtype, tol in ((np.float32, 2e-4), (np.float64, 1e-10)):
    # G = 33 > 32 (float64 / scalar row block), 97 > 96 (AVX-512), 193 > 192 (AVX2), 256
    for Hq, Hk, L, S in ((33, 1, 1, 40), (64, 1, 2, 70), (97, 1, 1, 130), (128, 1, 3, 50),
                         (200, 1, 1, 20), (193, 1, 2, 1030), (256, 1, 1, 2100), (512, 2, 1, 33)):
        q = rng.standard_normal((1, Hq, L, 24)).astype(dtype)
        k = rng.standard_normal((1, Hk, S, 24)).astype(dtype)
        v = rng.standard_normal((1, Hk, S, 40)).astype(dtype)
        for kw in ({{}}, {{"is_causal": True}}):
            for nt in (1, 2):
                o, lse = fastattn.scaled_dot_product_attention(
                    q, k, v, enable_gqa=True, return_lse=True, num_threads=nt, **kw)
                r, rl = ref.scaled_dot_product_attention(q, k, v, enable_gqa=True, return_lse=True, **kw)
                err = float(np.max(np.abs(o - r)))
                assert err <= tol * max(1.0, np.abs(r).max()), (dtype, Hq, Hk, L, S, kw, err)
                assert np.allclose(lse, rl, atol=tol * 10), (dtype, Hq, Hk, L, S, kw)
# the reported entry points: a float64 KVCache with 64/1 heads, MultiHeadAttention 1024/128/1
cache = fastattn.KVCache(1, 1, 16, 32, dtype=np.float64)
kk = rng.standard_normal((1, 1, 5, 32))
cache.append(kk, kk)
q = rng.standard_normal((1, 64, 1, 32))
o = cache.attend(q)
r = ref.scaled_dot_product_attention(q, kk, kk, enable_gqa=True)
assert np.allclose(o, r, atol=1e-10)
mha = fastattn.MultiHeadAttention(1024, 128, num_kv_heads=1, seed=1)
x = rng.standard_normal((2, 3, 1024)).astype(np.float32)
y = mha(x, need_weights=False)
y = y[0] if isinstance(y, tuple) else y
assert np.all(np.isfinite(y)) and y.shape == (2, 3, 1024)
print("ok")
"""


@pytest.mark.parametrize("isa_name", ISAS)
def test_gqa_group_larger_than_row_block(isa_name):
    run_child(GQA_CHILD.format(isa=isa_name), timeout=300)


# ---------------------------------------------------------------- 2. zero heads


def test_zero_heads_give_empty_results():
    out = run_child(
        """
        import numpy as np, fastattn
        for layout, shp in (("bhsd", lambda h, n: (2, h, n, 8)), ("bshd", lambda h, n: (2, n, h, 8))):
            for hq, hk in ((0, 0), (0, 2)):
                q = np.ones(shp(hq, 4), np.float32)
                k = np.ones(shp(hk, 6), np.float32)
                o, lse = fastattn.scaled_dot_product_attention(
                    q, k, k, enable_gqa=True, layout=layout, return_lse=True, num_threads=2)
                assert o.shape == q.shape and o.size == 0 and lse.size == 0
        q = np.ones((5, 0, 8), np.float32)
        cu = np.array([0, 2, 5])
        o = fastattn.varlen_attention(q, q, q, cu, cu)
        assert o.shape == (5, 0, 8)
        try:
            import dask.array as da
        except ImportError:
            pass
        else:
            import fastattn.dask as fd
            q = da.ones((1, 0, 4, 8), dtype=np.float32)
            assert fd.scaled_dot_product_attention(q, q, q).compute().shape == (1, 0, 4, 8)
        print("ok")
        """
    )
    assert "ok" in out


# ---------------------------------------------------------------- 3. sinks with split-KV


@pytest.mark.parametrize("S", [1023, 1024, 4097, 16384])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sinks_with_split_kv_decode(isa, rng, S, dtype):
    q, k, v = (
        randn(rng, (1, 2, 1, 32), dtype),
        randn(rng, (1, 2, S, 32), dtype),
        randn(rng, (1, 2, S, 16), dtype),
    )
    sinks = np.array([8.0, -1.5])
    for nt in (1, 2):
        o, lse = sdpa(q, k, v, sinks=sinks, return_lse=True, num_threads=nt)
        r, rl = ref.scaled_dot_product_attention(q, k, v, sinks=sinks, return_lse=True)
        assert_close(o, r, dtype)
        assert_close(lse, rl, dtype, what="lse")


def test_sinks_split_kv_lengths_and_varlen(rng):
    # rows past query_lengths stay zeros with LSE -inf; a row with no visible key gets the sink's LSE
    S = 3000
    q, k, v = randn(rng, (2, 2, 2, 16)), randn(rng, (2, 2, S, 16)), randn(rng, (2, 2, S, 16))
    kw = dict(sinks=np.array([3.0, 0.5]), key_lengths=np.array([2999, 1100]), query_lengths=np.array([1, 2]))
    o, lse = sdpa(q, k, v, return_lse=True, is_causal=True, window=(1500, 0), **kw)
    r, rl = ref.scaled_dot_product_attention(q, k, v, return_lse=True, is_causal=True, window=(1500, 0), **kw)
    assert_close(o, r)
    assert_close(lse, rl, what="lse")
    # varlen: one long sequence (split) and one short
    cq, ck = np.array([0, 1, 3]), np.array([0, 5000, 5100])
    qv, kv = randn(rng, (3, 4, 16)), randn(rng, (5100, 2, 16))
    sk = np.array([6.0, -2.0, 1.0, 9.0])
    o, lse = fastattn.varlen_attention(qv, kv, kv, cq, ck, sinks=sk, enable_gqa=True, return_lse=True)
    r, rl = ref.varlen_attention(
        qv, np.repeat(kv, 2, axis=1), np.repeat(kv, 2, axis=1), cq, ck, sinks=sk, return_lse=True
    )
    assert_close(o, r)
    assert_close(lse, rl, what="lse")


# ---------------------------------------------------------------- 4. fork safety

FORK_CHILD = """
import os, sys, multiprocessing as mp
import numpy as np, fastattn
fastattn.set_isa({isa!r})
rng = np.random.default_rng(0)
q = rng.standard_normal((1, 4, 256, 32)).astype(np.float32)
k = rng.standard_normal((1, 4, 2048, 32)).astype(np.float32)
d = rng.standard_normal((1, 4, 1, 32)).astype(np.float32)

def work(_=None):
    res = (fastattn.scaled_dot_product_attention(q, k, k, num_threads=2),
           fastattn.scaled_dot_product_attention(d, k, k, num_threads=2))  # split-KV: two teams
    bwd = getattr(fastattn, "scaled_dot_product_attention_backward", None)
    if bwd is not None:  # the backward driver's teams too
        o, lse = fastattn.scaled_dot_product_attention(q, k, k, return_lse=True, num_threads=2)
        res += tuple(bwd(o, q, k, k, o, lse, num_threads=2))
    return res

want = work()  # the parent has started a thread team
pid = os.fork()
if pid == 0:
    got = work()
    ok = all(np.array_equal(a, b) for a, b in zip(got, want))
    os._exit(0 if ok else 3)
_, status = os.waitpid(pid, 0)
assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
with mp.get_context("fork").Pool(2) as pool:
    for got in pool.map(work, range(4)):
        assert all(np.array_equal(a, b) for a, b in zip(got, want))
assert all(np.array_equal(a, b) for a, b in zip(work(), want))  # the parent keeps its threads
print("ok")
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
@pytest.mark.parametrize("isa_name", ISAS)
def test_fork_after_threaded_use(isa_name):
    assert "ok" in run_child(FORK_CHILD.format(isa=isa_name), timeout=120)


# ---------------------------------------------------------------- 5. masks at finfo.min


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("mdtype", [np.float32, np.float64])
def test_finfo_min_mask_gives_the_softmax(isa, rng, dtype, mdtype):
    L, S = 5, 300
    q, k, v = (
        randn(rng, (1, 2, L, 16), dtype),
        randn(rng, (1, 2, S, 16), dtype),
        randn(rng, (1, 2, S, 8), dtype),
    )
    lo = float(np.finfo(mdtype).min)
    m = np.zeros((L, S), mdtype)
    m[0] = lo  # a row masked only by finfo.min: the softmax is uniform over its keys
    m[1, ::2] = lo  # half the keys at finfo.min: the others take all the weight
    m[2, : S - 1] = lo
    o, lse = sdpa(q, k, v, m, return_lse=True)
    r, rl = ref.scaled_dot_product_attention(q, k, v, m, return_lse=True)
    assert_close(o, r, dtype)
    assert np.all(np.isfinite(lse))
    assert_close(lse[:, :, 1:], rl[:, :, 1:], dtype, what="lse")  # row 0: see docs/hardening.md
    # torch (HF padding masks) agrees, where the mask is finite in the inputs' dtype
    with np.errstate(over="ignore"):
        if not np.all(np.isfinite(m.astype(dtype))):
            return
    torch = optional("torch")
    t = torch.nn.functional.scaled_dot_product_attention(
        *(torch.from_numpy(np.ascontiguousarray(a)) for a in (q, k, v)),
        attn_mask=torch.from_numpy(m.astype(dtype)),
    )
    assert_close(o, t.numpy().astype(np.float64), dtype)


# ---------------------------------------------------------------- 6. window / block_size near 2**63


@pytest.mark.parametrize(
    "window,causal",
    [
        ((-1, sys.maxsize), False),
        ((sys.maxsize, -1), False),
        ((sys.maxsize, sys.maxsize), True),
        ((sys.maxsize, 0), True),
    ],
)
@pytest.mark.parametrize("L,S", [(4, 9), (9, 4)])
def test_window_bounds_saturate(isa, rng, window, causal, L, S):
    q, k, v = randn(rng, (1, 2, L, 8)), randn(rng, (1, 2, S, 8)), randn(rng, (1, 2, S, 8))
    o, lse = sdpa(q, k, v, is_causal=causal, window=window, return_lse=True)
    r, rl = ref.scaled_dot_product_attention(q, k, v, is_causal=causal, return_lse=True)  # unbounded
    assert_close(o, r)
    assert_close(lse, rl, what="lse")
    cu = np.array([0, L])
    o = fastattn.varlen_attention(
        q[0].swapaxes(0, 1),
        k[0].swapaxes(0, 1),
        v[0].swapaxes(0, 1),
        cu,
        np.array([0, S]),
        is_causal=causal,
        window=window,
    )
    assert_close(o.swapaxes(0, 1)[None], r)


@pytest.mark.parametrize("big", [2**63, 2**64 + 5, 10**30])
def test_int64_overflowing_bounds_are_value_errors(big):
    q = np.ones((1, 1, 2, 4), np.float32)
    for kw, name in (
        (dict(window=(big, 0)), r"window\[0\]"),
        (dict(window=(0, big)), r"window\[1\]"),
        (dict(block_mask=np.ones((1, 1), bool), block_size=(big, 1)), r"block_size\[0\]"),
        (dict(block_mask=np.ones((1, 1), bool), block_size=(1, big)), r"block_size\[1\]"),
    ):
        with pytest.raises(ValueError, match=name):
            sdpa(q, q, q, **kw)
    with pytest.raises(ValueError, match=r"window\[1\]"):
        fastattn.varlen_attention(q[0], q[0], q[0], np.array([0, 1]), np.array([0, 1]), window=(0, big))


# ---------------------------------------------------------------- 7. num_threads


def test_num_threads_bound():
    q = np.ones((1, 1, 2, 4), np.float32)
    sdpa(q, q, q, num_threads=fastattn._checks.MAX_THREADS)
    for n in (fastattn._checks.MAX_THREADS + 1, 2**31 - 1, 2**40):
        with pytest.raises(ValueError, match="num_threads"):
            sdpa(q, q, q, num_threads=n)
        with pytest.raises(ValueError, match="num_threads"):
            fastattn.set_num_threads(n)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses RLIMIT_AS")
@pytest.mark.skipif(not fastattn._kernels.openmp_enabled(), reason="no OpenMP")
def test_thread_start_failure_is_an_error():
    # With little address space left, thread stacks cannot be mapped: libgomp
    # would exit(1); fastattn must raise and stay usable.
    out = run_child(
        """
        import resource, numpy as np, fastattn
        q = np.ones((1, 64, 64, 16), np.float32)
        ref = fastattn.scaled_dot_product_attention(q, q, q, num_threads=1)
        with open("/proc/self/status") as f:
            vm = [int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:")][0]
        resource.setrlimit(resource.RLIMIT_AS, (vm + (96 << 20), resource.RLIM_INFINITY))
        try:
            fastattn.scaled_dot_product_attention(q, q, q, num_threads=64)
        except RuntimeError as e:
            assert "num_threads=64" in str(e), e
            print("raised")
        else:
            print("ran")  # the OS gave us the threads after all: also fine
        o = fastattn.scaled_dot_product_attention(q, q, q, num_threads=1)
        assert np.array_equal(o, ref)
        print("ok")
        """,
        env={"OMP_STACKSIZE": "16M"},
    )
    assert "ok" in out


# ---------------------------------------------------------------- 8. attention_with_kvcache checks


def _caches(D=8, Dv=8, S=16):
    kc = np.zeros((1, 2, S, D), np.float32)
    vc = np.zeros((1, 2, S, Dv), np.float32)
    return kc, vc


@pytest.mark.parametrize(
    "case,exc,match",
    [
        ("value_dim0", ValueError, "value_dim"),
        ("head_dim0", ValueError, "head_dim"),
        ("huge_window", ValueError, r"window\[1\]"),
        ("causal_array", TypeError, "is_causal"),
        ("lse_array", TypeError, "return_lse"),
        ("layout_array", ValueError, "layout"),
        ("scale_huge", ValueError, "scale"),
    ],
)
def test_kvcache_checks_before_writes(case, exc, match):
    D, Dv = (0, 8) if case == "head_dim0" else (8, 0) if case == "value_dim0" else (8, 8)
    kc, vc = _caches(D, Dv)
    kc0, vc0 = kc.copy(), vc.copy()
    q = np.ones((1, 2, 1, D), np.float32)
    kn, vn = np.ones((1, 2, 1, D), np.float32), np.ones((1, 2, 1, Dv), np.float32)
    kw = {
        "huge_window": dict(window=(0, 2**64)),
        "causal_array": dict(is_causal=np.array([True, False])),
        "lse_array": dict(return_lse=np.array([True, True])),
        "layout_array": dict(layout=np.array(["bhsd"])),
        "scale_huge": dict(scale=1e300),
    }.get(case, {})
    with pytest.raises(exc, match=match):
        fastattn.attention_with_kvcache(q, kc, vc, 3, kn, vn, **kw)
    np.testing.assert_array_equal(kc, kc0)
    np.testing.assert_array_equal(vc, vc0)


# ---------------------------------------------------------------- 9. out= overlap on converted arrays


def test_out_overlap_with_non_ndarray_mask():
    q = np.ones((1, 1, 4, 4), np.float32)
    out = np.zeros((1, 1, 4, 4), np.float32)  # Dv == S: out can be read as a mask
    with pytest.raises(ValueError, match="attn_mask"):
        sdpa(q, q, q, memoryview(out), out=out)
    torch = optional("torch")
    with pytest.raises(ValueError, match="attn_mask"):
        sdpa(q, q, q, torch.from_numpy(out), out=out)
    with pytest.raises(ValueError, match="attn_mask"):
        sdpa(q, q, q, torch.from_numpy(out[0, 0, :1]), out=out)  # a broadcast row of out


# ---------------------------------------------------------------- 10. rounding modes

_FE = {"downward": 0x400, "upward": 0x800, "towardzero": 0xC00}  # x86 <fenv.h>


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 fenv constants")
def test_bit_identical_under_rounding_modes(isa, rng):
    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    cases = [
        (randn(rng, (1, 4, 200, 32)), randn(rng, (1, 2, 300, 32)), dict(is_causal=True, enable_gqa=True)),
        (randn(rng, (1, 2, 1, 64)), randn(rng, (1, 2, 4000, 64)), dict(sinks=np.array([1.0, 2.0]))),  # split
        (randn(rng, (1, 2, 50, 16), np.float64), randn(rng, (1, 2, 3000, 16), np.float64), {}),
    ]
    want = [sdpa(q, k, k, return_lse=True, num_threads=1, **kw) for q, k, kw in cases]
    for mode in _FE.values():
        assert libm.fesetround(mode) == 0
        try:
            got = [
                [sdpa(q, k, k, return_lse=True, num_threads=nt, **kw) for q, k, kw in cases]
                for nt in (1, 2, 3)
            ]
            assert libm.fegetround() == mode  # the caller's mode is restored
        finally:
            libm.fesetround(0)
        for per_nt in got:
            for (o, lse), (wo, wl) in zip(per_nt, want):
                np.testing.assert_array_equal(o, wo)
                np.testing.assert_array_equal(lse, wl)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 fenv constants")
@pytest.mark.skipif(not hasattr(fastattn, "scaled_dot_product_attention_backward"), reason="no backward")
def test_backward_bit_identical_under_rounding_modes(isa, rng):
    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    bwd = fastattn.scaled_dot_product_attention_backward
    q, k = randn(rng, (1, 4, 64, 32)), randn(rng, (1, 2, 300, 32))
    o, lse = sdpa(q, k, k, return_lse=True, is_causal=True, enable_gqa=True)
    want = bwd(o, q, k, k, o, lse, is_causal=True, enable_gqa=True, num_threads=1)
    for mode in _FE.values():
        assert libm.fesetround(mode) == 0
        try:
            got = [
                bwd(o, q, k, k, o, lse, is_causal=True, enable_gqa=True, num_threads=nt) for nt in (1, 2, 3)
            ]
        finally:
            libm.fesetround(0)
        for g in got:
            for a, b in zip(g, want):
                np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------- 11. smaller items


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.skipif(under_asan(), reason="ASan's quarantine keeps freed memory resident by design")
def test_large_scratch_is_not_kept():
    out = run_child(
        """
        import resource, numpy as np, fastattn
        def rss():
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * resource.getpagesize()
        D = 65536
        q = np.ones((1, 1, 96, D), np.float32)
        k = np.ones((1, 1, 2, D), np.float32)
        out = np.empty((1, 1, 96, D), np.float32)
        out.fill(1.0)  # touch its pages before measuring
        fastattn.scaled_dot_product_attention(q[:, :, :1], k, k, num_threads=1)  # warm up
        before = rss()
        fastattn.scaled_dot_product_attention(q, k, k, out=out, num_threads=1)
        grown = rss() - before
        assert grown < 24 << 20, f"resident memory grew by {grown >> 20} MiB after the call"
        print("ok")
        """
    )
    assert "ok" in out


def test_kvcache_lse_dtype_with_scattered_batch_index(rng):
    cache = fastattn.KVCache(4, 2, 16, 8, dtype=np.float64)
    kk = rng.standard_normal((4, 2, 5, 8))
    cache.append(kk, kk)
    q = rng.standard_normal((3, 4, 1, 8))
    o, lse = cache.attend(q, batch_index=[3, 0, 1], return_lse=True)  # not a progression
    o2, lse2 = cache.attend(q[[1, 2]], batch_index=[0, 1], return_lse=True)  # a view
    assert lse.dtype == lse2.dtype == np.float64
    np.testing.assert_array_equal(lse[1:], lse2)
    np.testing.assert_array_equal(o[1:], o2)


@pytest.mark.parametrize("name", ["is_causal", "return_lse"])
def test_array_valued_flags_name_the_argument(name):
    q = np.ones((1, 1, 2, 4), np.float32)
    with pytest.raises(TypeError, match=name):
        sdpa(q, q, q, **{name: np.array([True, False])})
    with pytest.raises(TypeError, match=name):
        fastattn.varlen_attention(q[0], q[0], q[0], np.array([0, 1]), np.array([0, 1]), **{name: [1, 0]})
    with pytest.raises(ValueError, match="layout"):
        sdpa(q, q, q, layout=np.array(["bhsd", "bshd"]))


def test_huge_scale():
    q = np.ones((1, 1, 2, 4), np.float32)
    with pytest.raises(ValueError, match="scale"):
        sdpa(q, q, q, scale=1e300)
    with pytest.raises(ValueError, match="scale"):
        sdpa(q.astype(np.float16), q.astype(np.float16), q.astype(np.float16), scale=-1e39)
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 1, 3, 4)) for _ in range(3))
    assert_close(sdpa(q, k, v, scale=1e300), ref.scaled_dot_product_attention(q, k, v, scale=1e300))


def test_masked_arrays_are_rejected():
    q = np.ones((1, 1, 2, 4), np.float32)
    m = np.ma.masked_array(np.zeros((2, 2), np.float32), mask=[[True, False], [False, False]])
    with pytest.raises(TypeError, match="attn_mask.*MaskedArray"):
        sdpa(q, q, q, m)
    with pytest.raises(TypeError, match="query.*MaskedArray"):
        sdpa(np.ma.masked_array(q), q, q)


def test_kvcache_append_from_threads_loses_nothing():
    n_threads, per = 8, 40
    cache = fastattn.KVCache(1, 1, n_threads * per, 1, dtype=np.float32)
    barrier = threading.Barrier(n_threads)

    def worker(t):
        barrier.wait()
        for i in range(per):
            x = np.full((1, 1, 1, 1), t * per + i, np.float32)
            cache.append(x, x)

    ts = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert cache.lengths[0] == n_threads * per
    assert sorted(cache.k[0, 0, :, 0].tolist()) == list(range(n_threads * per))


def test_need_weights_memory_bound(monkeypatch):
    from fastattn import modules

    mha = fastattn.MultiHeadAttention(8, 2, seed=0)
    x = np.ones((5, 1, 8), np.float32)  # (L, B, E), torch's default layout
    limit = 1 * 2 * 5 * 5 * 4  # (B, H, L, S) float32
    monkeypatch.setattr(modules, "NEED_WEIGHTS_MAX_BYTES", limit)
    mha(x, need_weights=True)  # at the limit: fine
    monkeypatch.setattr(modules, "NEED_WEIGHTS_MAX_BYTES", limit - 1)
    with pytest.raises(ValueError, match="need_weights"):
        mha(x, need_weights=True)
    mha(x, need_weights=False)  # without weights: no limit


def test_block_mask_is_not_expanded(rng):
    B, H, L, S = 64, 64, 64, 64
    q = randn(rng, (B, H, L, 8))
    bm = rng.random((1, 1, L, S)) > 0.5
    bm[..., 0] = True
    out = np.empty_like(q)
    tracemalloc.start()
    try:
        sdpa(q, q, q, block_mask=bm, block_size=(1, 1), out=out, num_threads=1)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < (B * H * L * S) // 4, f"peak {peak} bytes: the block mask was expanded"
    r = ref.scaled_dot_product_attention(q[:2, :2], q[:2, :2], q[:2, :2], block_mask=bm, block_size=(1, 1))
    assert_close(out[:2, :2], r)


# ---------------------------------------------------------------- property tests

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_PROP = settings(
    max_examples=int(os.environ.get("FASTATTN_RELIABILITY_EXAMPLES", "12")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@_PROP
@given(
    G=st.sampled_from([2, 7, 31, 32, 33, 95, 96, 97, 129, 191, 192, 193, 256]),
    Hk=st.integers(1, 2),
    L=st.integers(1, 3),
    S=st.sampled_from([1, 17, 64, 130, 1100]),
    f64=st.booleans(),
    causal=st.booleans(),
    threads=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_gqa_groups_property(isa, G, Hk, L, S, f64, causal, threads, seed):
    dt = np.float64 if f64 else np.float32
    rng = np.random.default_rng(seed)
    q, k, v = (
        randn(rng, (1, G * Hk, L, 16), dt),
        randn(rng, (1, Hk, S, 16), dt),
        randn(rng, (1, Hk, S, 8), dt),
    )
    o, lse = sdpa(q, k, v, enable_gqa=True, is_causal=causal, return_lse=True, num_threads=threads)
    r, rl = ref.scaled_dot_product_attention(q, k, v, enable_gqa=True, is_causal=causal, return_lse=True)
    assert_close(o, r, dt)
    assert_close(lse, rl, dt, what="lse")


@_PROP
@given(
    S=st.sampled_from([1000, 1024, 2047, 5000, 16384]),
    L=st.integers(1, 2),
    sink=st.floats(-20, 20),
    f64=st.booleans(),
    klen=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_sinks_split_kv_property(isa, S, L, sink, f64, klen, seed):
    dt = np.float64 if f64 else np.float32
    rng = np.random.default_rng(seed)
    q, k, v = randn(rng, (1, 2, L, 8), dt), randn(rng, (1, 1, S, 8), dt), randn(rng, (1, 1, S, 8), dt)
    kw = dict(sinks=np.array([sink, -sink]), enable_gqa=True, return_lse=True, is_causal=True)
    if klen:
        kw["key_lengths"] = np.array([int(rng.integers(L, S + 1))])
    o, lse = sdpa(q, k, v, **kw)
    r, rl = ref.scaled_dot_product_attention(q, k, v, **kw)
    assert_close(o, r, dt)
    assert_close(lse, rl, dt, what="lse")


@_PROP
@given(
    frac=st.floats(0, 1),
    whole_row=st.booleans(),
    mf64=st.booleans(),
    f64=st.booleans(),
    S=st.sampled_from([3, 64, 129, 700]),
    seed=st.integers(0, 2**16),
)
def test_finfo_min_masks_property(isa, frac, whole_row, mf64, f64, S, seed):
    dt = np.float64 if f64 else np.float32
    rng = np.random.default_rng(seed)
    q, k, v = randn(rng, (1, 2, 4, 8), dt), randn(rng, (1, 2, S, 8), dt), randn(rng, (1, 2, S, 8), dt)
    m = np.where(rng.random((4, S)) < frac, F32_MIN, 0.0).astype(np.float64 if mf64 else np.float32)
    if whole_row:
        m[1] = F32_MIN
    o, lse = sdpa(q, k, v, m, return_lse=True)
    r, rl = ref.scaled_dot_product_attention(q, k, v, m, return_lse=True)
    assert_close(o, r, dt)
    assert np.all(np.isfinite(lse))
    if not dt == np.float64:  # the LSE of an all-finfo.min row saturates in float32 (docs/hardening.md)
        ok = ~np.all(m == F32_MIN, axis=-1)
        assert_close(lse[..., ok], rl[..., ok], dt, what="lse")
    else:
        assert_close(lse, rl, dt, what="lse")


@pytest.mark.parametrize("S", [1024, 4096])
def test_sinks_and_finfo_min_bfloat16_prefill(isa, rng, S):
    # bfloat16 prefill takes the AMX tile kernel under isa "amx" (elsewhere the float32 kernels):
    # its split-KV parts must leave the sink to the merge, and finite masks must stay finite.
    import ml_dtypes

    bf = ml_dtypes.bfloat16
    q, k, v = (randn(rng, s).astype(bf) for s in ((1, 8, 64, 32), (1, 1, S, 32), (1, 1, S, 32)))
    m = np.zeros((64, S), np.float32)
    m[0] = F32_MIN
    m[1, ::2] = F32_MIN
    kw = dict(sinks=np.linspace(-4, 8, 8), enable_gqa=True, return_lse=True)
    o, lse = sdpa(q, k, v, m, **kw)
    r, rl = ref.scaled_dot_product_attention(q, k, v, m, **kw)
    assert_close(o.astype(np.float32), r, tol=2e-2)
    assert_close(lse[:, :, 1:], rl[:, :, 1:], tol=2e-2, what="lse")
