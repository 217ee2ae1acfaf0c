"""Tests of the optional CUDA backend (fastattn.cuda, fastattn._cuda).

Three layers:

- ``gpu``: the real kernel against fastattn.reference; skipped (not failed)
  without the extension or a GPU.
- ``emulated``: the same tests run through fastattn.cuda's Python layer
  (argument checks, uploads, layouts, broadcast strides, the fa_params record
  handed to C) with fastattn._cuda replaced by the emulator of
  cuda_emulator.py, which treats device pointers as host addresses, reads the
  record with module.c's own field table and computes the fa_params contract
  of csrc/cuda/fastattn_cuda.h in float64.  This runs everywhere and checks
  everything but the CUDA code itself.
- the build: nvcc compiles the extension from this tree (when nvcc exists),
  and the CUDA toolkit lookup fails clearly without nvcc.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from conftest import optional
from cuda_emulator import FIELDS, EmulatedCuda, fa_params_fields, read_record

import fastattn
import fastattn.cuda as fcuda
from fastattn import reference

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD_PY = os.path.join(ROOT, "csrc", "cuda", "build.py")
BF16 = np.dtype(ml_dtypes.bfloat16)


class HostCAI:
    """A stand-in for a device array under the emulator: host memory exposed
    through __cuda_array_interface__ (like a CuPy array would be)."""

    def __init__(self, a, readonly=False, stream=None):
        self.a = a
        self.readonly = readonly
        self.stream = stream

    @property
    def __cuda_array_interface__(self):
        a = self.a
        return {
            "shape": a.shape,
            "typestr": a.dtype.str,
            "data": (a.ctypes.data, self.readonly),
            "strides": a.strides,
            "version": 3,
            "stream": self.stream,
        }


def _emulate(monkeypatch, emu=None):
    """Replace fastattn._cuda by the emulator.  CuPy is hidden too: with CuPy
    installed (as on GPU machines) fastattn.cuda allocates results with it,
    and the emulator would then write host-side into real device memory."""
    emu = EmulatedCuda() if emu is None else emu
    monkeypatch.setattr(fcuda, "_cuda", emu)
    monkeypatch.setitem(sys.modules, "cupy", None)
    return emu


@pytest.fixture(params=["emulated", "gpu"])
def backend(request, monkeypatch):
    if request.param == "emulated":
        return _emulate(monkeypatch)
    if not fcuda.is_available():
        pytest.skip("no CUDA device (or fastattn built without FASTATTN_CUDA=1)")
    return None


def _tol(dtype):
    return {np.dtype(np.float32): 2e-4, np.dtype(np.float16): 4e-3, BF16: 3e-2}[np.dtype(dtype)]


def _rand(rng, shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def _check(out, ref, dtype):
    out = np.asarray(out).astype(np.float64)
    assert out.shape == ref.shape
    tol = _tol(dtype)
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol * max(1.0, float(np.abs(ref).max(initial=0))))


# ---------------------------------------------------------------------------
# Numerics against the reference (emulated everywhere, real on a GPU)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("L,S,D", [(1, 70, 64), (37, 37, 32), (20, 90, 80), (5, 3, 256)])
def test_matches_reference(backend, dtype, causal, L, S, D):
    rng = np.random.default_rng(L * 1000 + S + D)
    q, k, v = (
        _rand(rng, (2, 3, L, D), dtype),
        _rand(rng, (2, 3, S, D), dtype),
        _rand(rng, (2, 3, S, D), dtype),
    )
    out, lse = fastattn.scaled_dot_product_attention(
        q, k, v, is_causal=causal, return_lse=True, device="cuda"
    )
    ref, rlse = reference.scaled_dot_product_attention(q, k, v, is_causal=causal, return_lse=True)
    assert isinstance(out, np.ndarray) and out.dtype == np.dtype(dtype) and lse.dtype == np.float32
    _check(out, ref, dtype)
    fin = np.isfinite(rlse)
    np.testing.assert_array_equal(np.isfinite(lse), fin)
    np.testing.assert_allclose(lse[fin], rlse[fin], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kv_dtype", [np.float16, BF16])
def test_float32_query_16bit_kv(backend, kv_dtype):
    rng = np.random.default_rng(1)
    q = _rand(rng, (1, 2, 9, 16))
    k, v = _rand(rng, (1, 2, 13, 16), kv_dtype), _rand(rng, (1, 2, 13, 24), kv_dtype)
    out = fcuda.scaled_dot_product_attention(q, k, v)
    assert out.dtype == np.float32 and out.shape == (1, 2, 9, 24)
    _check(out, reference.scaled_dot_product_attention(q, k, v), np.float32)


def test_variants_gqa_window_alibi_softcap_lengths_masks(backend):
    rng = np.random.default_rng(2)
    B, Hq, Hk, L, S, D, Dv = 3, 4, 2, 7, 19, 24, 40
    q, k, v = _rand(rng, (B, Hq, L, D)), _rand(rng, (B, Hk, S, D)), _rand(rng, (B, Hk, S, Dv))
    bmask = rng.random((L, S)) < 0.8  # broadcast over batch and heads
    fmask = _rand(rng, (B, 1, 1, S))
    slopes = rng.random(Hq)
    klens = np.array([19, 11, 0])
    for kw in (
        dict(attn_mask=bmask, is_causal=True),
        dict(attn_mask=fmask, window=(3, 2)),
        dict(alibi_slopes=slopes, softcap=5.0, key_lengths=klens, is_causal=True),
        dict(attn_mask=bmask.astype(np.float64) * -3.0, window=(-1, 0), scale=0.3),
    ):
        out, lse = fcuda.scaled_dot_product_attention(q, k, v, enable_gqa=True, return_lse=True, **kw)
        ref, rlse = reference.scaled_dot_product_attention(q, k, v, enable_gqa=True, return_lse=True, **kw)
        _check(out, ref, np.float32)
        np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(rlse))
        fin = np.isfinite(rlse)
        np.testing.assert_allclose(lse[fin], rlse[fin], rtol=1e-4, atol=1e-4)
    # key_lengths 0: the whole batch element sees nothing -> zeros, LSE -inf
    out, lse = fcuda.scaled_dot_product_attention(
        q, k, v, enable_gqa=True, return_lse=True, key_lengths=klens
    )
    assert np.all(out[2] == 0) and np.all(lse[2] == -np.inf)


def test_layouts_2d_and_out(backend):
    rng = np.random.default_rng(3)
    q, k, v = _rand(rng, (2, 6, 3, 16)), _rand(rng, (2, 10, 3, 16)), _rand(rng, (2, 10, 3, 16))  # bshd
    ref = reference.scaled_dot_product_attention(q, k, v, layout="bshd", is_causal=True)
    out = np.full(q.shape, 7.0, np.float32)
    got = fcuda.scaled_dot_product_attention(q, k, v, layout="bshd", is_causal=True, out=out)
    assert got is out
    _check(out, ref, np.float32)
    q2, k2, v2 = q[0, :, 0], k[0, :, 0], v[0, :, 0]  # (L, D): one head
    o2, l2 = fcuda.scaled_dot_product_attention(q2, k2, v2, return_lse=True)
    r2, rl2 = reference.scaled_dot_product_attention(q2, k2, v2, return_lse=True)
    assert l2.shape == (6,)
    _check(o2, r2, np.float32)
    np.testing.assert_allclose(l2, rl2, rtol=1e-4, atol=1e-4)


def test_fully_masked_rows_empty_keys_and_nan(backend):
    rng = np.random.default_rng(7)
    q, k, v = _rand(rng, (1, 2, 4, 8)), _rand(rng, (1, 2, 6, 8)), _rand(rng, (1, 2, 6, 8))
    m = np.ones((4, 6), bool)
    m[1] = False
    out, lse = fcuda.scaled_dot_product_attention(q, k, v, attn_mask=m, return_lse=True)
    assert np.all(out[:, :, 1] == 0) and np.all(lse[:, :, 1] == -np.inf)
    _check(out, reference.scaled_dot_product_attention(q, k, v, attn_mask=m), np.float32)
    e = np.zeros((1, 2, 0, 8), np.float32)
    out, lse = fcuda.scaled_dot_product_attention(q, e, e, return_lse=True)
    assert out.shape == (1, 2, 4, 8) and np.all(out == 0) and np.all(lse == -np.inf)
    kn = k.copy()
    kn[0, 0, 2, 3] = np.nan  # poisons the rows of head 0 only
    out = fcuda.scaled_dot_product_attention(q, kn, v)
    assert np.all(np.isnan(out[0, 0])) and np.all(np.isfinite(out[0, 1]))


def test_gpu_torch_tensors_in_place():
    """Real device arrays: strided torch CUDA tensors, a broadcast device mask, out=, a side stream."""
    if not fcuda.is_available():
        pytest.skip("no CUDA device (or fastattn built without FASTATTN_CUDA=1)")
    torch = optional("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    rng = np.random.default_rng(8)
    q, k, v = _rand(rng, (2, 9, 4, 32)), _rand(rng, (2, 13, 2, 32)), _rand(rng, (2, 13, 2, 48))  # bshd
    m = rng.random((9, 13)) < 0.7
    tq, tk, tv, tm = (torch.from_numpy(a).cuda() for a in (q, k, v, m))
    tq_h = tq.transpose(1, 2)  # bhsd view of bshd storage: strided, read in place
    ref = reference.scaled_dot_product_attention(q, k, v, attn_mask=m, layout="bshd", enable_gqa=True)
    tout = torch.full((2, 9, 4, 48), 5.0, device="cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        fcuda.scaled_dot_product_attention(
            tq_h.transpose(1, 2), tk, tv, attn_mask=tm, layout="bshd", enable_gqa=True, out=tout
        )
    torch.cuda.synchronize()
    _check(tout.cpu().numpy(), ref, np.float32)
    res = fcuda.scaled_dot_product_attention(tq, tk, tv, attn_mask=tm, layout="bshd", enable_gqa=True)
    host = res.get() if isinstance(res, fcuda.DeviceArray) else __import__("cupy").asnumpy(res)
    _check(host, ref, np.float32)
    tq16, tk16, tv16 = tq.half(), tk.half(), tv.half()
    r16 = reference.scaled_dot_product_attention(
        q.astype(np.float16),
        k.astype(np.float16),
        v.astype(np.float16),
        layout="bshd",
        enable_gqa=True,
        is_causal=True,
    )
    o16 = torch.empty((2, 9, 4, 48), dtype=torch.float16, device="cuda")
    fcuda.scaled_dot_product_attention(
        tq16, tk16, tv16, layout="bshd", enable_gqa=True, is_causal=True, out=o16
    )
    _check(o16.cpu().numpy(), r16, np.float16)


def test_inputs_not_modified_and_no_leaks(backend):
    rng = np.random.default_rng(4)
    q, k, v = _rand(rng, (1, 2, 5, 8)), _rand(rng, (1, 2, 5, 8)), _rand(rng, (1, 2, 5, 8))
    m = rng.random((5, 5)) < 0.5
    copies = [a.copy() for a in (q, k, v, m)]
    fcuda.scaled_dot_product_attention(q, k, v, attn_mask=m, alibi_slopes=np.ones(2))
    for a, c in zip((q, k, v, m), copies):
        np.testing.assert_array_equal(a, c)
    if backend is not None:
        import gc

        gc.collect()
        assert backend.blocks == {}, "device temporaries were not freed"


# ---------------------------------------------------------------------------
# GPU only: the split-KV path (decode), the LSE merge and the two tile loaders.
# FASTATTN_CUDA_SPLITS=N (read by launch.cu at each launch) forces N key
# chunks so that the split path also runs on small shapes; "1" disables it.


def _gpu_or_skip():
    if not fcuda.is_available():
        pytest.skip("no CUDA device (or fastattn built without FASTATTN_CUDA=1)")


def _splits(monkeypatch, splits):
    if splits is None:
        monkeypatch.delenv("FASTATTN_CUDA_SPLITS", raising=False)
    else:
        monkeypatch.setenv("FASTATTN_CUDA_SPLITS", splits)


def _check_lse(lse, rlse):
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(rlse))
    np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(rlse))
    np.testing.assert_array_equal(lse[np.isinf(rlse)], rlse[np.isinf(rlse)])
    fin = np.isfinite(rlse)
    np.testing.assert_allclose(lse[fin], rlse[fin], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("splits", [None, "1", "7"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16])
@pytest.mark.parametrize("S", [1, 255, 257, 8192, 20000])
def test_gpu_split_kv_decode(monkeypatch, S, dtype, splits):
    """Decode with few blocks: the keys are split over chunks and merged (automatically
    for the long S; forced with "7"; off with "1").  Batch 1 sees a third of the keys,
    batch 2 none (zeros, LSE -inf)."""
    _gpu_or_skip()
    _splits(monkeypatch, splits)
    rng = np.random.default_rng(S)
    B, (Hq, Hk), D = 3, ((32, 8) if S < 8192 else (4, 1)), 64
    q, k, v = (
        _rand(rng, (B, Hq, 1, D), dtype),
        _rand(rng, (B, Hk, S, D), dtype),
        _rand(rng, (B, Hk, S, D), dtype),
    )
    klens = np.array([S, S // 3, 0])
    kw = dict(enable_gqa=True, key_lengths=klens, return_lse=True)
    out, lse = fcuda.scaled_dot_product_attention(q, k, v, **kw)
    ref, rlse = reference.scaled_dot_product_attention(q, k, v, **kw)
    assert out.dtype == np.dtype(dtype)
    _check(out, ref, dtype)
    _check_lse(lse, rlse)
    assert np.all(out[2] == 0) and np.all(lse[2] == -np.inf)
    # no key lengths, MHA: every chunk is visible
    out = fcuda.scaled_dot_product_attention(q[:, :Hk], k, v)
    _check(out, reference.scaled_dot_product_attention(q[:, :Hk], k, v), dtype)


@pytest.mark.parametrize("splits", [None, "3", "64"])
def test_gpu_split_kv_variants(monkeypatch, splits):
    """Causal L > 1, a bool mask that blocks whole chunks, rows that see nothing, windows,
    ALiBi, softcap, float masks, key lengths, Dv != D and NaN poisoning through the split
    path (chunks of 32 keys with "64")."""
    _gpu_or_skip()
    _splits(monkeypatch, splits)
    rng = np.random.default_rng(11)
    B, Hq, Hk, L, S, D, Dv = 2, 4, 2, 3, 200, 40, 24
    q, k, v = _rand(rng, (B, Hq, L, D)), _rand(rng, (B, Hk, S, D)), _rand(rng, (B, Hk, S, Dv))
    bmask = rng.random((L, S)) < 0.7
    bmask[:, 32:160] = False  # whole chunks (of 32 or 67 keys) see nothing
    bmask[1] = False  # query 1 sees no key at all
    fmask = _rand(rng, (B, 1, L, S)) * 3.0
    for kw in (
        dict(attn_mask=bmask, is_causal=True),
        dict(attn_mask=bmask, window=(40, 0)),
        dict(window=(5, 0), alibi_slopes=rng.random(Hq), softcap=4.0),
        dict(attn_mask=fmask, key_lengths=np.array([200, 33]), is_causal=True),
        dict(attn_mask=fmask.astype(np.float64), window=(70, 3), scale=0.2),
    ):
        out, lse = fcuda.scaled_dot_product_attention(q, k, v, enable_gqa=True, return_lse=True, **kw)
        ref, rlse = reference.scaled_dot_product_attention(q, k, v, enable_gqa=True, return_lse=True, **kw)
        _check(out, ref, np.float32)
        _check_lse(lse, rlse)
    out, lse = fcuda.scaled_dot_product_attention(q, k, v, attn_mask=bmask, enable_gqa=True, return_lse=True)
    assert np.all(out[:, :, 1] == 0) and np.all(lse[:, :, 1] == -np.inf)
    kn = k.copy()
    kn[0, 1, 199] = np.nan  # only the last query (position 199) of kv head 1 sees key 199
    out, lse = fcuda.scaled_dot_product_attention(q, kn, v, is_causal=True, enable_gqa=True, return_lse=True)
    ref, rlse = reference.scaled_dot_product_attention(
        q, kn, v, is_causal=True, enable_gqa=True, return_lse=True
    )
    assert (
        np.all(np.isnan(out[0, 2:, 2]))
        and np.all(np.isfinite(out[0, 2:, :2]))
        and np.all(np.isfinite(out[1]))
    )
    _check(out, ref, np.float32)
    _check_lse(lse, rlse)


@pytest.mark.parametrize("splits", [None, "4"])
@pytest.mark.parametrize(
    "dtype,D,Dv",
    [
        (np.float16, 20, 20),
        (np.float16, 6, 10),
        (np.float32, 256, 256),
        (BF16, 128, 64),
        (np.float16, 256, 256),
    ],
)
def test_gpu_loaders(monkeypatch, dtype, D, Dv, splits):
    """Head dims for both tile loaders: 16-byte vectors (fp16 D=256) and the scalar
    fallback (D not a multiple of the vector, fp32 D=256, D != Dv)."""
    _gpu_or_skip()
    _splits(monkeypatch, splits)
    rng = np.random.default_rng(D + Dv)
    for L, S in ((1, 300), (45, 70)):
        q, k, v = (
            _rand(rng, (2, 2, L, D), dtype),
            _rand(rng, (2, 2, S, D), dtype),
            _rand(rng, (2, 2, S, Dv), dtype),
        )
        out, lse = fcuda.scaled_dot_product_attention(q, k, v, is_causal=True, return_lse=True)
        ref, rlse = reference.scaled_dot_product_attention(q, k, v, is_causal=True, return_lse=True)
        _check(out, ref, dtype)
        _check_lse(lse, rlse)


def test_gpu_unaligned_device_views(monkeypatch):
    """Device tensors whose rows are not 16-byte aligned (scalar loader) and aligned
    strided ones (vector loader), split and not."""
    _gpu_or_skip()
    torch = optional("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    rng = np.random.default_rng(12)
    big_k, big_v = _rand(rng, (2, 4, 600, 72), np.float16), _rand(rng, (2, 4, 600, 72), np.float16)
    q = _rand(rng, (2, 4, 1, 64), np.float16)
    for off in (0, 1, 8):
        k, v = big_k[..., off : off + 64], big_v[..., off : off + 64]
        ref = reference.scaled_dot_product_attention(q, k, v)
        tk, tv = (
            torch.from_numpy(np.ascontiguousarray(a)).cuda()[..., off : off + 64] for a in (big_k, big_v)
        )
        tq = torch.from_numpy(q).cuda()
        for splits in (None, "5"):
            _splits(monkeypatch, splits)
            o = torch.empty((2, 4, 1, 64), dtype=torch.float16, device="cuda")
            fcuda.scaled_dot_product_attention(tq, tk, tv, out=o)
            torch.cuda.synchronize()
            _check(o.cpu().numpy(), ref, np.float16)


# ---------------------------------------------------------------------------
# GPU only: the decode kernel (fa_decode_kernel).  It runs when a (batch, kv
# head) has G * L <= 4 rows and the K / V rows are 16-byte aligned with D and
# Dv whole 16-byte vectors; FASTATTN_CUDA_DECODE=0 (read by launch.cu at
# each launch) sends the same calls to fa_fwd_kernel.


def _decode(monkeypatch, on):
    if on:
        monkeypatch.delenv("FASTATTN_CUDA_DECODE", raising=False)
    else:
        monkeypatch.setenv("FASTATTN_CUDA_DECODE", "0")


def _decode_case(rng, B, Hq, Hk, L, S, D, Dv, dtype, q_dtype=None):
    q = _rand(rng, (B, Hq, L, D), q_dtype or dtype)
    return q, _rand(rng, (B, Hk, S, D), dtype), _rand(rng, (B, Hk, S, Dv), dtype)


@pytest.mark.parametrize("L", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16])
@pytest.mark.parametrize("S", [1, 31, 257, 8192, 20000])
def test_gpu_decode(monkeypatch, S, dtype, L):
    """MHA rows of L <= 4 queries (causal, bottom-right: query i sees keys j <= i + S - L),
    key lengths with a 0 (zeros, LSE -inf) and a short one, against the reference; the
    automatic split of long key ranges included."""
    _gpu_or_skip()
    _splits(monkeypatch, None)
    _decode(monkeypatch, True)
    rng = np.random.default_rng(S * 10 + L)
    H = 4 if S < 8192 else 2  # keeps the float64 reference cheap
    q, k, v = _decode_case(rng, 3, H, H, L, S, 128, 128, dtype)
    klens = np.array([S, max(S // 3, min(L, S)), 0])
    for kw in (dict(key_lengths=klens), dict(key_lengths=klens, is_causal=True)):
        out, lse = fcuda.scaled_dot_product_attention(q, k, v, return_lse=True, **kw)
        ref, rlse = reference.scaled_dot_product_attention(q, k, v, return_lse=True, **kw)
        assert out.dtype == np.dtype(dtype) and lse.dtype == np.float32
        _check(out, ref, dtype)
        _check_lse(lse, rlse)
        assert np.all(out[2] == 0) and np.all(lse[2] == -np.inf)


@pytest.mark.parametrize("splits", [None, "1", "5"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16])
@pytest.mark.parametrize("S", [257, 8192])
def test_gpu_decode_gqa(monkeypatch, S, dtype, splits):
    """GQA 32/8 decode: the 4 query heads of a kv head are the 4 rows of one block."""
    _gpu_or_skip()
    _splits(monkeypatch, splits)
    _decode(monkeypatch, True)
    rng = np.random.default_rng(S + 3)
    q, k, v = _decode_case(rng, 2, 32, 8, 1, S, 128, 128, dtype)
    kw = dict(enable_gqa=True, key_lengths=np.array([S, S // 2 + 1]), return_lse=True)
    out, lse = fcuda.scaled_dot_product_attention(q, k, v, **kw)
    ref, rlse = reference.scaled_dot_product_attention(q, k, v, **kw)
    _check(out, ref, dtype)
    _check_lse(lse, rlse)


@pytest.mark.parametrize("splits", [None, "3", "64"])
@pytest.mark.parametrize("Hq,Hk,L", [(4, 4, 3), (4, 2, 2), (2, 2, 1), (8, 2, 1)])
def test_gpu_decode_variants(monkeypatch, Hq, Hk, L, splits):
    """Causal with L < S, windows, ALiBi + softcap, a bool mask that blocks whole chunks
    (and one query entirely), float32 / float64 masks, key lengths, scale and NaN
    poisoning through the decode kernel, split ("3"; "64": chunks of 32 keys) or not."""
    _gpu_or_skip()
    _splits(monkeypatch, splits)
    _decode(monkeypatch, True)
    rng = np.random.default_rng(Hq * 100 + Hk * 10 + L)
    B, S, D, Dv = 2, 300, 64, 32
    q, k, v = _decode_case(rng, B, Hq, Hk, L, S, D, Dv, np.float32)
    bmask = rng.random((L, S)) < 0.7
    bmask[:, 32:192] = False  # whole chunks see nothing
    if L > 1:
        bmask[1] = False  # query 1 sees no key at all
    fmask = _rand(rng, (B, 1, L, S)) * 3.0
    for kw in (
        dict(is_causal=True),
        dict(attn_mask=bmask, is_causal=True),
        dict(attn_mask=bmask, window=(40, 0)),
        dict(window=(5, 0), alibi_slopes=rng.random(Hq), softcap=4.0),
        dict(alibi_slopes=rng.random((B, Hq)), softcap=2.5, is_causal=True, scale=0.3),
        dict(attn_mask=fmask, key_lengths=np.array([300, 33]), is_causal=True),
        dict(attn_mask=fmask.astype(np.float64), window=(70, 3), scale=0.2),
        dict(window=(-1, 0), key_lengths=np.array([0, 150])),
    ):
        out, lse = fcuda.scaled_dot_product_attention(q, k, v, enable_gqa=True, return_lse=True, **kw)
        ref, rlse = reference.scaled_dot_product_attention(q, k, v, enable_gqa=True, return_lse=True, **kw)
        _check(out, ref, np.float32)
        _check_lse(lse, rlse)
    if L > 1:
        out, lse = fcuda.scaled_dot_product_attention(
            q, k, v, attn_mask=bmask, enable_gqa=True, return_lse=True
        )
        assert np.all(out[:, :, 1] == 0) and np.all(lse[:, :, 1] == -np.inf)
    # NaN in key 299 of kv head 1, batch 0: with causal only the last query (position
    # 299) sees it, so only the rows of that query in the query heads of kv head 1 are NaN
    kn = k.copy()
    kn[0, 1, 299] = np.nan
    out, lse = fcuda.scaled_dot_product_attention(q, kn, v, is_causal=True, enable_gqa=True, return_lse=True)
    ref, rlse = reference.scaled_dot_product_attention(
        q, kn, v, is_causal=True, enable_gqa=True, return_lse=True
    )
    G = Hq // Hk
    assert np.all(np.isnan(out[0, G : 2 * G, L - 1])) and np.all(np.isnan(lse[0, G : 2 * G, L - 1]))
    assert np.all(np.isfinite(out[0, G : 2 * G, : L - 1])) and np.all(np.isfinite(out[0, :G]))
    assert np.all(np.isfinite(out[1]))
    _check(out, ref, np.float32)
    _check_lse(lse, rlse)


@pytest.mark.parametrize("splits", [None, "4"])
@pytest.mark.parametrize(
    "q_dtype,dtype,D,Dv",
    [
        (np.float16, np.float16, 64, 128),
        (BF16, BF16, 128, 64),
        (np.float16, np.float16, 256, 256),
        (np.float32, np.float32, 256, 256),
        (np.float32, np.float32, 64, 256),
        (np.float32, np.float32, 4, 8),
        (np.float16, np.float16, 8, 8),
        (BF16, BF16, 16, 40),
        (np.float32, np.float16, 128, 128),
        (np.float32, BF16, 64, 96),
    ],
)
def test_gpu_decode_head_dims_and_dtypes(monkeypatch, q_dtype, dtype, D, Dv, splits):
    """Lane layouts: 1 to 32 lanes per key row, two 16-byte vectors per lane (fp32 rows
    of 256 columns), D != Dv both ways, and float32 queries with 16-bit keys / values."""
    _gpu_or_skip()
    _splits(monkeypatch, splits)
    _decode(monkeypatch, True)
    rng = np.random.default_rng(D * 7 + Dv)
    for Hq, Hk, L, S in ((2, 2, 1, 700), (8, 2, 1, 333), (2, 2, 4, 90)):
        q, k, v = _decode_case(rng, 2, Hq, Hk, L, S, D, Dv, dtype, q_dtype)
        kw = dict(is_causal=True, enable_gqa=True, return_lse=True, key_lengths=np.array([S, S - 7]))
        out, lse = fcuda.scaled_dot_product_attention(q, k, v, **kw)
        ref, rlse = reference.scaled_dot_product_attention(q, k, v, **kw)
        assert out.dtype == np.dtype(q_dtype) and out.shape == (2, Hq, L, Dv)
        _check(out, ref, q_dtype)
        _check_lse(lse, rlse)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16])
def test_gpu_decode_env_off(monkeypatch, dtype):
    """FASTATTN_CUDA_DECODE=0 runs fa_fwd_kernel instead: same results within tolerance."""
    _gpu_or_skip()
    _splits(monkeypatch, None)
    rng = np.random.default_rng(31)
    q, k, v = _decode_case(rng, 1, 32, 8, 1, 8192, 128, 128, dtype)
    kw = dict(enable_gqa=True, return_lse=True, alibi_slopes=rng.random(32) * 0.01)
    ref, rlse = reference.scaled_dot_product_attention(q, k, v, **kw)
    _decode(monkeypatch, True)
    out1, lse1 = fcuda.scaled_dot_product_attention(q, k, v, **kw)
    _decode(monkeypatch, False)
    out0, lse0 = fcuda.scaled_dot_product_attention(q, k, v, **kw)
    for out, lse in ((out1, lse1), (out0, lse0)):
        _check(out, ref, dtype)
        _check_lse(lse, rlse)
    _check(out0, out1.astype(np.float64), dtype)
    if dtype == np.float32:
        # The two kernels sum in different orders: identical float32 outputs over
        # 32 x 128 values of 8192 keys would mean that the decode kernel did not run.
        assert not np.array_equal(out0, out1)


# ---------------------------------------------------------------------------
# GPU only: the tensor-core prefill path (fa_mma_kernel).  It runs for q, k, v
# all float16 or all bfloat16, D == Dv in {64, 128}, no mask / ALiBi / softcap,
# 16-byte aligned rows and Hq / Hk * L >= 64; FASTATTN_CUDA_MMA=0 (read by
# launch.cu at each launch) sends the same calls to the CUDA-core kernel.


def _mma(monkeypatch, on):
    if on:
        monkeypatch.delenv("FASTATTN_CUDA_MMA", raising=False)
    else:
        monkeypatch.setenv("FASTATTN_CUDA_MMA", "0")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("L,S", [(64, 64), (65, 127), (128, 1031), (1000, 1000), (1031, 65), (127, 128)])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", [np.float16, BF16])
def test_gpu_mma_prefill(monkeypatch, dtype, D, L, S, causal):
    """Sizes that are and are not multiples of the 64-row / 64-key tiles, self and cross
    attention, bottom-right causal with L < S and L > S (the first L - S queries see
    nothing: zeros, LSE -inf), against the reference; the CUDA-core kernel
    (FASTATTN_CUDA_MMA=0) agrees within the same tolerance."""
    _gpu_or_skip()
    _splits(monkeypatch, None)
    _mma(monkeypatch, True)
    rng = np.random.default_rng(L * 7 + S + D)
    q, k, v = (
        _rand(rng, (2, 2, L, D), dtype),
        _rand(rng, (2, 2, S, D), dtype),
        _rand(rng, (2, 2, S, D), dtype),
    )
    out, lse = fcuda.scaled_dot_product_attention(q, k, v, is_causal=causal, return_lse=True)
    ref, rlse = reference.scaled_dot_product_attention(q, k, v, is_causal=causal, return_lse=True)
    assert out.dtype == np.dtype(dtype) and lse.dtype == np.float32
    _check(out, ref, dtype)
    _check_lse(lse, rlse)
    if causal and L > S:
        assert np.all(out[:, :, : L - S] == 0) and np.all(lse[:, :, : L - S] == -np.inf)
    _mma(monkeypatch, False)
    out0, lse0 = fcuda.scaled_dot_product_attention(q, k, v, is_causal=causal, return_lse=True)
    _check(out0, ref, dtype)
    _check(out0, out.astype(np.float64), dtype)
    _check_lse(lse0, lse)
    if L * S >= 64 * 1000:
        # The two kernels round differently (P is rounded to the input dtype before P.V on
        # tensor cores): identical outputs over this many elements would mean that the
        # tensor-core path did not run.
        assert not np.array_equal(out, out0)


@pytest.mark.parametrize("splits", [None, "3"])
@pytest.mark.parametrize("dtype", [np.float16, BF16])
def test_gpu_mma_variants(monkeypatch, dtype, splits):
    """GQA 8/2 (rows of 4 query heads stacked per kv head), windows, key lengths (one
    batch element without keys), scale, return_lse, NaN poisoning, split-KV over the
    tensor-core kernel (forced with "3")."""
    _gpu_or_skip()
    _splits(monkeypatch, splits)
    _mma(monkeypatch, True)
    rng = np.random.default_rng(21)
    B, Hq, Hk, L, S, D = 3, 8, 2, 100, 300, 64
    q, k, v = (
        _rand(rng, (B, Hq, L, D), dtype),
        _rand(rng, (B, Hk, S, D), dtype),
        _rand(rng, (B, Hk, S, D), dtype),
    )
    klens = np.array([300, 131, 0])
    for kw in (
        dict(),
        dict(is_causal=True),
        dict(window=(40, 0)),
        dict(window=(70, 3), scale=0.2),
        dict(window=(-1, 5)),
        dict(key_lengths=klens, is_causal=True),
        dict(key_lengths=klens, window=(30, 30)),
    ):
        out, lse = fcuda.scaled_dot_product_attention(q, k, v, enable_gqa=True, return_lse=True, **kw)
        ref, rlse = reference.scaled_dot_product_attention(q, k, v, enable_gqa=True, return_lse=True, **kw)
        _check(out, ref, dtype)
        _check_lse(lse, rlse)
        if "key_lengths" in kw:
            assert np.all(out[2] == 0) and np.all(lse[2] == -np.inf)
    # causal, L < S: query i sees keys j <= i + 200; key 250 of kv head 1, batch 0 is seen
    # by queries i >= 50 of query heads 4..7 only
    kn = k.copy()
    kn[0, 1, 250, 5] = np.nan
    out, lse = fcuda.scaled_dot_product_attention(q, kn, v, is_causal=True, enable_gqa=True, return_lse=True)
    ref, rlse = reference.scaled_dot_product_attention(
        q, kn, v, is_causal=True, enable_gqa=True, return_lse=True
    )
    assert np.all(np.isnan(out[0, 4:, 50:])) and np.all(np.isnan(lse[0, 4:, 50:]))
    assert np.all(np.isfinite(out[0, 4:, :50])) and np.all(np.isfinite(out[0, :4]))
    assert np.all(np.isfinite(out[1:]))
    _check(out, ref, dtype)
    _check_lse(lse, rlse)
    # FASTATTN_CUDA_MMA=0: the CUDA-core kernel gives the same results within tolerance
    kw = dict(is_causal=True, key_lengths=klens, enable_gqa=True, return_lse=True)
    out1, lse1 = fcuda.scaled_dot_product_attention(q, k, v, **kw)
    _mma(monkeypatch, False)
    out0, lse0 = fcuda.scaled_dot_product_attention(q, k, v, **kw)
    _check(out0, out1.astype(np.float64), dtype)
    _check_lse(lse0, lse1)


def test_gpu_mma_strided_and_unaligned_views(monkeypatch):
    """Prefill on torch views: rows 16-byte aligned with a padded row stride (tensor
    cores) and rows not 16-byte aligned (CUDA-core fallback)."""
    _gpu_or_skip()
    torch = optional("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    _splits(monkeypatch, None)
    _mma(monkeypatch, True)
    rng = np.random.default_rng(22)
    big = [_rand(rng, (1, 2, 150, 72), np.float16) for _ in range(3)]
    for off in (0, 1, 8):
        q, k, v = (a[..., off : off + 64] for a in big)
        ref = reference.scaled_dot_product_attention(q, k, v, is_causal=True)
        tq, tk, tv = (torch.from_numpy(a).cuda()[..., off : off + 64] for a in big)
        o = torch.empty((1, 2, 150, 64), dtype=torch.float16, device="cuda")
        fcuda.scaled_dot_product_attention(tq, tk, tv, is_causal=True, out=o)
        torch.cuda.synchronize()
        _check(o.cpu().numpy(), ref, np.float16)


# ---------------------------------------------------------------------------
# Device-array inputs (__cuda_array_interface__): emulated with host memory


def test_device_inputs_strided_broadcast_mask_and_lead_dims(monkeypatch):
    emu = _emulate(monkeypatch)
    rng = np.random.default_rng(5)
    # lead dims (2, 3); key is a transposed (non-contiguous) view; the mask
    # (2, 1, 1, L, S) cannot merge its lead dims -> one launch per lead[0].
    q = _rand(rng, (2, 3, 4, 6, 16))
    k = np.swapaxes(np.ascontiguousarray(np.swapaxes(_rand(rng, (2, 3, 4, 9, 16)), 2, 3)), 2, 3)
    assert not k.flags.c_contiguous
    v = _rand(rng, (2, 3, 4, 9, 16))
    m = rng.random((2, 1, 1, 6, 9)) < 0.7
    m[..., 0] = True
    res = fcuda.scaled_dot_product_attention(
        HostCAI(q, True),
        HostCAI(k, True),
        HostCAI(v, True),
        attn_mask=HostCAI(m, True),
        is_causal=True,
        return_lse=True,
    )
    out, lse = res
    assert isinstance(out, fcuda.DeviceArray) and out.shape == (2, 3, 4, 6, 16)
    ref, rlse = reference.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=True, return_lse=True)
    _check(out.get(), ref, np.float32)
    np.testing.assert_allclose(lse.get(), rlse, rtol=1e-5, atol=1e-5)
    assert len(emu.launches) == 2  # the mask's lead dims do not merge
    assert emu.launches[0]["m_sh"] == 0 and emu.launches[0]["m_ss"] == 1
    # out= on the device, bshd layout, GQA
    qb, kb, vb = _rand(rng, (2, 5, 4, 8)), _rand(rng, (2, 7, 2, 8)), _rand(rng, (2, 7, 2, 8))
    o = np.zeros((2, 5, 4, 8), np.float32)
    got = fcuda.scaled_dot_product_attention(
        HostCAI(qb), HostCAI(kb), HostCAI(vb), layout="bshd", enable_gqa=True, out=HostCAI(o)
    )
    assert isinstance(got, HostCAI)
    _check(o, reference.scaled_dot_product_attention(qb, kb, vb, layout="bshd", enable_gqa=True), np.float32)
    with pytest.raises(ValueError, match="out must be writable"):
        fcuda.scaled_dot_product_attention(
            HostCAI(qb),
            HostCAI(kb),
            HostCAI(vb),
            layout="bshd",
            enable_gqa=True,
            out=HostCAI(o, readonly=True),
        )
    with pytest.raises(ValueError, match="out must not share memory with query"):
        fcuda.scaled_dot_product_attention(
            HostCAI(qb), HostCAI(kb), HostCAI(vb), layout="bshd", enable_gqa=True, out=HostCAI(qb)
        )
    with pytest.raises(ValueError, match="query must be contiguous in its last dimension"):
        fcuda.scaled_dot_product_attention(HostCAI(q[..., ::2]), HostCAI(k[..., ::2]), HostCAI(v))
    with pytest.raises(TypeError, match="all be device arrays"):
        fcuda.scaled_dot_product_attention(HostCAI(qb), kb, vb)


def test_streams(monkeypatch):
    """The kernel runs on the query's stream; other operands' streams are waited for."""
    emu = EmulatedCuda()
    synced = []
    emu.stream_synchronize = synced.append
    _emulate(monkeypatch, emu)
    x = np.ones((1, 2, 3, 8), np.float32)
    out = fcuda.scaled_dot_product_attention(
        HostCAI(x, stream=77), HostCAI(x, stream=77), HostCAI(x, stream=5)
    )
    assert emu.launches[-1]["stream"] == 77 and synced == [5]
    assert out.__cuda_array_interface__["stream"] == 77
    out.get()
    assert synced == [5, 77]
    fcuda.scaled_dot_product_attention(x, x, x)
    assert emu.launches[-1]["stream"] == 0


def test_device_array_roundtrip_bfloat16(monkeypatch):
    _emulate(monkeypatch)
    rng = np.random.default_rng(6)
    q, k, v = (_rand(rng, (1, 2, 4, 8), BF16) for _ in range(3))
    dq, dk, dv = (fcuda.to_device(a) for a in (q, k, v))
    np.testing.assert_array_equal(dq.get(), q)
    out = fcuda.scaled_dot_product_attention(dq, dk, dv)
    assert isinstance(out, fcuda.DeviceArray) and out.dtype == BF16
    _check(out.get(), reference.scaled_dot_product_attention(q, k, v), BF16)
    fcuda.synchronize()


def test_bad_input_messages(monkeypatch):
    _emulate(monkeypatch)
    x = np.ones((1, 2, 3, 8), np.float32)
    cases = [
        (
            dict(query=x.astype(np.float64), key=x.astype(np.float64), value=x.astype(np.float64)),
            TypeError,
            "float64 is not supported",
        ),
        (dict(query=x.astype(np.float16), key=x, value=x), TypeError, "key/value must have query's dtype"),
        (
            dict(query=np.ones((1, 2, 3, 300), np.float32), key=np.ones((1, 2, 3, 300), np.float32), value=x),
            ValueError,
            "head dims must be <= 256",
        ),
        (dict(query=x, key=x, value=x, attn_mask=np.ones((4, 3), bool)), ValueError, "attn_mask of shape"),
        (dict(query=x, key=x, value=x, attn_mask=np.ones((3, 3), np.int32)), TypeError, "attn_mask must be"),
        (dict(query=x, key=x, value=x, layout="sbhd"), ValueError, "layout"),
        (dict(query=x, key=x, value=x, window=(1,)), TypeError, "window"),
        (dict(query=x, key=x, value=x, softcap=-1.0), ValueError, "softcap"),
        (dict(query=x, key=x, value=x, key_lengths=np.array([9])), ValueError, "key_lengths"),
        (dict(query=x, key=x, value=x, alibi_slopes=np.ones(3)), ValueError, "alibi_slopes"),
        (dict(query=x, key=x[:, :1], value=x[:, :1]), ValueError, "enable_gqa"),
        (
            dict(query=x, key=x, value=x, out=np.ones((1, 2, 3, 8), np.float16)),
            TypeError,
            "out must have dtype",
        ),
        (dict(query=x, key=x, value=x, out=[0]), TypeError, "out must be a numpy.ndarray"),
    ]
    for kw, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            fcuda.scaled_dot_product_attention(**kw)
    with pytest.raises(ValueError, match="sinks is not supported with device='cuda'"):
        fastattn.scaled_dot_product_attention(x, x, x, sinks=np.zeros(2), device="cuda")
    with pytest.raises(ValueError, match="device must be"):
        fastattn.scaled_dot_product_attention(x, x, x, device="tpu")


# ---------------------------------------------------------------------------
# The record handed to fastattn._cuda: fa_params field names, read by module.c's table


def test_record_table_names_every_fa_params_field():
    """module.c's FIELDS (parsed by the emulator) lists each field of fa_params once, in
    struct order, so no field is silently left unread or unchecked."""
    names = [n for n, _, _ in FIELDS]
    assert names == list(fa_params_fields())
    uses = {n: u for n, _, u in FIELDS}
    for n in ("sinks", "q_lens", "cu_q", "cu_k", "bmask", "precision"):
        assert uses[n] == "unsupported", n
    assert uses["num_threads"] == "ignored"
    assert {u for u in uses.values()} == {"required", "unsupported", "ignored"}


def _record(monkeypatch):
    """The record fastattn.cuda hands to _cuda for a small call (as launched)."""
    emu = _emulate(monkeypatch)
    x = np.ones((1, 2, 3, 8), np.float32)
    fcuda.scaled_dot_product_attention(x, x, x, attn_mask=np.ones((3, 3), bool), return_lse=True)
    (rec,) = emu.launches
    rec = dict(rec)
    stream = rec.pop("stream")
    assert stream == 0
    return emu, rec


def test_record_fields_and_errors(monkeypatch):
    emu, rec = _record(monkeypatch)
    p = read_record(rec)
    assert (p.B, p.Hq, p.Hk, p.L, p.S, p.D, p.Dv) == (1, 2, 2, 3, 3, 8, 8)
    assert p.mask_kind == fastattn._kernels.FA_MASK_BOOL and p.lse is not None and p.k_lens is None
    assert p.q_dtype == p.k_dtype == p.v_dtype == p.o_dtype == fastattn._kernels.FA_F32
    # every required field must be present; unsupported ones may be absent, None or 0
    for name, _, use in FIELDS:
        if use == "required":
            with pytest.raises(KeyError, match=rf"missing field {name}\b"):
                read_record({k: v for k, v in rec.items() if k != name})
    for name, typ, use in FIELDS:
        if use == "unsupported":
            assert rec.get(name) in (None, 0)  # the plan's neutral value
            read_record({k: v for k, v in rec.items() if k != name})
            with pytest.raises(ValueError, match=f"^{name} is not supported by the CUDA kernels"):
                emu.attention({**rec, name: 4096 if typ == "pointer" else 1})
    read_record({**rec, "num_threads": 7, "bm_q": 64})  # CPU-only settings: not read
    with pytest.raises(TypeError, match="q_sb must be an int"):
        read_record({**rec, "q_sb": 1.5})
    with pytest.raises(TypeError, match="scale must be a float"):
        read_record({**rec, "scale": "x"})
    with pytest.raises(TypeError, match=r"mask must be an int \(device pointer\) or None"):
        read_record({**rec, "mask": "x"})
    with pytest.raises(OverflowError, match="causal is out of range"):
        read_record({**rec, "causal": 2**40})
    # an object with the fields as attributes reads the same
    import types

    ns = read_record(types.SimpleNamespace(**rec))
    assert all(getattr(ns, n) == getattr(p, n) for n, _, u in FIELDS if u != "ignored")
    # the C contract: o_dtype is q_dtype, v_dtype is k_dtype
    with pytest.raises(RuntimeError, match="o_dtype must equal q_dtype"):
        emu.attention({**rec, "o_dtype": fastattn._kernels.FA_F16})


def test_views_on_the_shared_plan_merge(monkeypatch):
    """Device views go through _plan.kernel_plans, the leading-dims merge / split the
    CPU uses: mergeable leading dims give one launch with the merged batch stride,
    others one launch per index of the first leading dim.  A host mask is uploaded
    as its distinct elements and read through broadcast strides."""
    v = fcuda._View(0, (1, 5, 1), (5, 1, 1), np.dtype(np.float32), None)
    b = fcuda._bcast(v, (2, 4, 5, 3), "m")
    assert b.shape == (2, 4, 5, 3) and b.strides == (0, 0, 1, 0)
    with pytest.raises(ValueError, match="does not broadcast"):
        fcuda._bcast(v, (2, 4, 6, 3), "m")
    emu = _emulate(monkeypatch)
    rng = np.random.default_rng(9)
    q, k, v = _rand(rng, (2, 3, 4, 5, 8)), _rand(rng, (2, 3, 4, 7, 8)), _rand(rng, (2, 3, 4, 7, 8))
    m = rng.random((5, 7)) < 0.7
    m[:, 0] = True
    out = fcuda.scaled_dot_product_attention(HostCAI(q), HostCAI(k), HostCAI(v), attn_mask=m)
    _check(out.get(), reference.scaled_dot_product_attention(q, k, v, attn_mask=m), np.float32)
    (rec,) = emu.launches
    assert (rec["B"], rec["q_sb"], rec["k_sb"], rec["o_sb"]) == (6, 4 * 5 * 8, 4 * 7 * 8, 4 * 5 * 8)
    assert (rec["m_sb"], rec["m_sh"], rec["m_sl"], rec["m_ss"]) == (0, 0, 7, 1)
    # query's leading dims (2, 3) in transposed storage do not merge: one launch per q[i]
    qt = np.swapaxes(np.ascontiguousarray(np.swapaxes(q, 0, 1)), 0, 1)
    emu.launches.clear()
    out = fcuda.scaled_dot_product_attention(HostCAI(qt), HostCAI(k), HostCAI(v), attn_mask=m)
    _check(out.get(), reference.scaled_dot_product_attention(q, k, v, attn_mask=m), np.float32)
    assert [(r["B"], r["q_sb"]) for r in emu.launches] == [(3, 2 * 4 * 5 * 8)] * 2


# ---------------------------------------------------------------------------
# Without the extension


def test_unavailable_raises_runtime_error(monkeypatch):
    monkeypatch.setattr(fcuda, "_cuda", None)
    x = np.ones((2, 4), np.float32)
    assert not fcuda.is_built() and not fcuda.is_available()
    assert fcuda.build_info()["built"] is False
    with pytest.raises(RuntimeError, match="built without its CUDA extension"):
        fastattn.scaled_dot_product_attention(x, x, x, device="cuda")
    with pytest.raises(RuntimeError, match="not available"):
        fcuda.scaled_dot_product_attention(x, x, x)


def test_config_reports_cuda():
    cfg = fastattn._config.config()
    assert cfg["cuda_built"] == fcuda.is_built()
    assert cfg["cuda_available"] == fcuda.is_available()


def test_import_fastattn_does_not_import_cuda():
    code = "import sys, fastattn; assert 'fastattn.cuda' not in sys.modules; fastattn.cuda; print('ok')"
    here = os.path.dirname(os.path.dirname(os.path.abspath(fastattn.__file__)))  # the fastattn under test
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=os.path.dirname(here),
        env={**os.environ, "PYTHONPATH": here},
    )
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


# ---------------------------------------------------------------------------
# The build helper


def _load_build():
    optional("setuptools")
    spec = importlib.util.spec_from_file_location("fastattn_cuda_build_test", BUILD_PY)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_no_nvcc_is_a_clear_error(monkeypatch, tmp_path):
    build = _load_build()
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(build, "DEFAULT_CUDA_HOME", str(tmp_path / "no-cuda"))
    with pytest.raises(build.CudaNotFoundError, match="no CUDA toolkit was found.*unset FASTATTN_CUDA"):
        build.cuda_extension()
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "nowhere"))
    with pytest.raises(build.CudaNotFoundError, match="CUDA_HOME=.*has no bin/nvcc"):
        build.find_cuda_home()


def test_parse_archs():
    build = _load_build()
    assert build.parse_archs("80;90") == [("80", False), ("90", False)]
    assert build.parse_archs("8.0, 9.0+PTX sm_90a") == [("80", False), ("90", True), ("90a", False)]
    assert build.gencode_flags([("90", True)]) == [
        "-gencode=arch=compute_90,code=sm_90",
        "-gencode=arch=compute_90,code=compute_90",
    ]
    for bad in ("", "ampere", "8", "30"):
        with pytest.raises(ValueError, match="FASTATTN_CUDA_ARCHS"):
            build.parse_archs(bad)


_NVCC = shutil.which("nvcc") or os.environ.get("CUDA_HOME") or os.path.exists("/usr/local/cuda/bin/nvcc")


@pytest.mark.skipif(not _NVCC, reason="nvcc not found")
def test_build_extension_with_nvcc(tmp_path, monkeypatch):
    """nvcc builds fastattn._cuda from this tree (one architecture, to stay quick);
    the module imports and, without a GPU, reports no device; its record table is
    the one the emulator reads."""
    optional("setuptools")
    _, rec = _record(monkeypatch)
    r = subprocess.run(
        [sys.executable, BUILD_PY, "--build-lib", str(tmp_path), "--archs", "80"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    so = [
        f for f in os.listdir(tmp_path / "fastattn") if f.startswith("_cuda") and f.endswith((".so", ".pyd"))
    ]
    assert len(so) == 1
    code = (
        "import importlib.util, sys\n"
        f"path = {str(tmp_path / 'fastattn' / so[0])!r}\n"
        "spec = importlib.util.spec_from_file_location('fastattn._cuda', path)\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "print(m.BUILD_ARCHS, m.MAX_HEAD_DIM, m.device_count())\n"
        "print(repr(m.PARAMS))\n"
        # module.c's record loop, without a GPU (the pointers are emulator host
        # addresses, never read): B = 0 launches nothing; a set
        # unsupported field and a missing one are refused before any CUDA call.
        f"rec = {rec!r}\n"
        "m.attention(dict(rec, B=0))\n"
        "for bad in (dict(rec, sinks=4096), {k: v for k, v in rec.items() if k != 'q_sb'}):\n"
        "    try:\n"
        "        m.attention(bad)\n"
        "    except (ValueError, KeyError) as e:\n"
        "        print(type(e).__name__, e)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    archs, maxd, ndev = lines[0].split()
    assert archs == "80" and maxd == "256"
    if not fcuda.is_available():
        assert ndev == "0"
    assert eval(lines[1]) == FIELDS  # the table the emulator parses is the one compiled
    assert lines[2] == "ValueError sinks is not supported by the CUDA kernels (it must be None)"
    assert lines[3] == "KeyError 'attention record: missing field q_sb'"


def test_default_archs_cover_sm80_and_sm90():
    """The default architecture list parses and names sm_80 and sm_90."""
    build = _load_build()
    flags = build.gencode_flags(build.parse_archs(build.DEFAULT_ARCHS))
    assert any("sm_80" in f for f in flags) and any("sm_90" in f for f in flags)
