"""fastattn.dask: sharded exact attention over Dask arrays."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import tempfile

import numpy as np
import pytest
from conftest import optional

import fastattn

da = optional("dask.array")
dask = optional("dask")
fd = optional("fastattn.dask")
from fastattn.dask import _alibi, _geometry  # noqa: E402 (after the importorskip)

try:
    import ml_dtypes

    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover
    BF16 = None


def _random_chunks(rng, n):
    """A random chunking of a length-n dim (1 to 4 pieces, possibly one piece)."""
    if n <= 1 or rng.random() < 0.25:
        return (n,)
    cuts = sorted(set(rng.integers(1, n, size=rng.integers(1, 3)).tolist()))
    b = [0] + cuts + [n]
    return tuple(y - x for x, y in zip(b[:-1], b[1:]))


def _case(seed):
    rng = np.random.default_rng(seed)
    layout = ["bhsd", "bshd"][seed % 2]
    dtype = [np.float32, np.float32, np.float64, np.float16, BF16 or np.float16][seed % 5]
    nlead = int(rng.integers(0 if layout == "bhsd" else 1, 3)) if seed % 7 else (0 if layout == "bhsd" else 1)
    two_d = layout == "bhsd" and seed % 7 == 0
    lead = tuple(int(x) for x in rng.integers(1, 3, size=nlead))
    Hk = int(rng.integers(1, 3))
    G = int(rng.choice([1, 1, 2, 3]))
    Hq = 1 if two_d else Hk * G
    Hk = 1 if two_d else Hk
    L, S = int(rng.integers(1, 30)), int(rng.integers(1, 40))
    D, Dv = int(rng.choice([4, 8, 16])), int(rng.choice([3, 8, 16]))

    def shape(H, n, d):
        if two_d:
            return (n, d)
        return lead + ((H, n, d) if layout == "bhsd" else (n, H, d))

    q = rng.standard_normal(shape(Hq, L, D)).astype(dtype)
    k = rng.standard_normal(shape(Hk, S, D)).astype(dtype)
    v = rng.standard_normal(shape(Hk, S, Dv)).astype(dtype)
    qd = da.from_array(q, chunks=tuple(_random_chunks(rng, n) for n in q.shape))
    kd = da.from_array(k, chunks=tuple(_random_chunks(rng, n) for n in k.shape))
    vd = da.from_array(v, chunks=tuple(_random_chunks(rng, n) for n in v.shape))
    full = shape(Hq, L, S)[:-3] + (Hq, L, S) if not two_d else (L, S)
    mask = None
    r = rng.random()
    if r < 0.3:
        mshape = tuple(1 if rng.random() < 0.4 else n for n in full)[int(rng.integers(0, 2)) :]
        mask = rng.random(mshape) < 0.8
    elif r < 0.5:
        mshape = tuple(1 if rng.random() < 0.4 else n for n in full)
        mask = np.where(rng.random(mshape) < 0.15, -np.inf, rng.standard_normal(mshape)).astype(np.float32)
    if mask is not None and rng.random() < 0.7:
        mask = da.from_array(mask, chunks=tuple(_random_chunks(rng, n) for n in mask.shape))
    causal = bool(rng.random() < 0.5)
    window = None
    if rng.random() < 0.5:
        window = (int(rng.choice([-1, 0, 1, 3, 10])), int(rng.choice([-1, 0, 2, 7])))
    kw = dict(is_causal=causal, window=window, enable_gqa=G > 1, layout=layout)
    return q, k, v, qd, kd, vd, mask, kw


def _tol(dtype):
    return {np.dtype(np.float64): 1e-11, np.dtype(np.float32): 2e-5}.get(np.dtype(dtype), 2e-2)


@pytest.mark.parametrize("seed", range(40))
def test_matches_in_memory_random(seed):
    q, k, v, qd, kd, vd, mask, kw = _case(seed)
    m_np = np.asarray(mask) if mask is not None else None
    want, want_lse = fastattn.scaled_dot_product_attention(
        q, k, v, m_np, return_lse=True, num_threads=1, **kw
    )
    got_d, lse_d = fd.scaled_dot_product_attention(qd, kd, vd, mask, return_lse=True, num_threads=1, **kw)
    assert got_d.shape == want.shape and got_d.dtype == want.dtype
    assert lse_d.shape == want_lse.shape and lse_d.dtype == want_lse.dtype
    got, lse = dask.compute(got_d, lse_d, scheduler="threads")
    assert got.shape == want.shape and got.dtype == want.dtype
    tol = _tol(q.dtype)
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol, atol=tol)
    assert np.array_equal(np.isneginf(lse), np.isneginf(want_lse))
    fin = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[fin], want_lse[fin], rtol=min(tol, 1e-5), atol=min(tol, 1e-5) * 10)
    # the output alone (no LSE) is the same graph minus one layer
    only = fd.scaled_dot_product_attention(qd, kd, vd, mask, num_threads=1, **kw).compute(scheduler="sync")
    np.testing.assert_array_equal(only, got)


def test_matches_float64_reference():
    rng = np.random.default_rng(7)
    q = rng.standard_normal((2, 4, 45, 16))
    k = rng.standard_normal((2, 2, 61, 16))
    v = rng.standard_normal((2, 2, 61, 12))
    mask = rng.standard_normal((45, 61))
    want, want_lse = fastattn.reference.scaled_dot_product_attention(
        q, k, v, mask, is_causal=True, window=(20, -1), enable_gqa=True, return_lse=True
    )
    out, lse = fd.scaled_dot_product_attention(
        da.from_array(q.astype(np.float32), chunks=(1, 2, 11, 16)),
        da.from_array(k.astype(np.float32), chunks=(2, 1, 9, 16)),
        da.from_array(v.astype(np.float32), chunks=(2, 1, 9, 12)),
        da.from_array(mask.astype(np.float32), chunks=(11, 9)),
        is_causal=True,
        window=(20, -1),
        enable_gqa=True,
        return_lse=True,
    )
    out, lse = dask.compute(out, lse, scheduler="threads")
    np.testing.assert_allclose(out, want, atol=2e-5 * np.abs(want).max())
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5)


@pytest.mark.parametrize(
    "causal,window",
    [
        (True, None),
        (False, None),
        (False, (0, -1)),
        (False, (3, 0)),
        (True, (2, -1)),
        (False, (-1, 0)),
        (False, (1, 4)),
        (False, (0, 0)),
        (True, (-1, 5)),
    ],
)
@pytest.mark.parametrize("L,S", [(5, 9), (9, 5), (8, 8)])
@pytest.mark.parametrize("alibi_rows", [64, 3])
def test_chunk_pair_offsets_exhaustive(causal, window, L, S, alibi_rows, monkeypatch):
    """Every (query chunk, key chunk) pair of every size against the full
    problem's restriction and ALiBi bias sliced to that pair, as an explicit
    float mask of an in-memory call: checks the alignment worked out inside a
    task (window of the trimmed call, the ALiBi split at the diagonal and its
    LSE shift, in row blocks of alibi_rows), with and without a user mask."""
    monkeypatch.setattr(_alibi, "ALIBI_ROWS", alibi_rows)
    rng = np.random.default_rng(L * 100 + S)
    q = rng.standard_normal((1, 2, L, 8)).astype(np.float32)
    k = rng.standard_normal((1, 2, S, 8)).astype(np.float32)
    v = rng.standard_normal((1, 2, S, 4)).astype(np.float32)
    slopes = np.array([[0.25, 0.7]])
    wl, wr = window or (-1, -1)
    i = np.arange(L)[:, None]
    j = np.arange(S)[None, :]
    t = j - (i + S - L)  # key position minus the query's bottom-right position
    vis = np.ones((L, S), bool)
    if causal:
        vis &= t <= 0
    if wl >= 0:
        vis &= t >= -wl
    if wr >= 0:
        vis &= t <= wr
    fmask = rng.standard_normal((L, S)).astype(np.float32)
    alibi_bias = -slopes[0][:, None, None] * np.abs(t)  # (2, L, S)
    opts = dict(
        scale=0.3, gqa=False, layout="bhsd", threads=1, causal=causal, wl=wl, wr=wr, softcap=None,
        block_size=None, precision="highest", L=L, S=S,
    )  # fmt: skip
    pairs = list(
        itertools.product(itertools.combinations(range(L + 1), 2), itertools.combinations(range(S + 1), 2))
    )
    rng.shuffle(pairs)
    split = direct = 0
    for n, ((i0, i1), (j0, j1)) in enumerate(pairs[:60]):
        sub = vis[i0:i1, j0:j1]
        user = None if n % 2 else fmask[i0:i1, j0:j1]
        for alibi in (False, True):
            base = np.zeros((i1 - i0, j1 - j0)) if user is None else user.astype(np.float64)
            bias = base + (alibi_bias[:, i0:i1, j0:j1] if alibi else 0.0)
            want_m = np.where(sub, bias, -np.inf).astype(np.float32)
            want = fastattn.scaled_dot_product_attention(
                q[:, :, i0:i1],
                k[:, :, j0:j1],
                v[:, :, j0:j1],
                want_m,
                scale=0.3,
                return_lse=True,
                num_threads=1,
            )
            got = _alibi.part(
                q[:, :, i0:i1],
                k[:, :, j0:j1],
                v[:, :, j0:j1],
                user,
                geom=(i0, i1, j0, j1),
                opts=opts,
                slopes=slopes if alibi else None,
            )
            if alibi and sub.any():
                e = (j0 - i0) - (S - L)
                lo = None if wl < 0 else -wl - e
                hi = 0 - e if causal else (None if wr < 0 else wr - e)
                a0, a1, c0, c1 = _geometry.trim(i1 - i0, j1 - j0, lo, hi, (1, 1))
                if a1 - c1 == e:
                    direct += 1
                else:
                    split += 1
            np.testing.assert_allclose(got[0], want[0], rtol=2e-6, atol=2e-6)
            np.testing.assert_array_equal(np.isneginf(got[1]), np.isneginf(want[1]))
            f = np.isfinite(want[1])
            np.testing.assert_allclose(got[1][f], want[1][f], rtol=2e-6, atol=2e-6)
    # the ALiBi split was exercised (window (0, 0): every trimmed call is one key wide, so aligned)
    assert split > 0 or window == (0, 0)


def _lengths_case(rng, lead, L, S):
    """Key and query lengths with the edge cases: a zero length (fully masked rows)
    and the full length."""
    kl = rng.integers(0, S + 1, size=lead)
    ql = rng.integers(0, L + 1, size=lead)
    if kl.size > 1:
        kl.flat[0] = 0
        kl.flat[-1] = S
        ql.flat[-1] = L
    return kl, ql


def _options_case(seed):
    """A random problem (as _case) with a random subset of the score options."""
    q, k, v, qd, kd, vd, mask, kw = _case(seed)
    rng = np.random.default_rng(1000 + seed)
    layout = kw["layout"]
    qh = q if layout == "bhsd" else np.swapaxes(q, -2, -3)
    kh = k if layout == "bhsd" else np.swapaxes(k, -2, -3)
    if q.ndim == 2:
        qh, kh = qh[None], kh[None]
    lead, (Hq, L, _D), S = qh.shape[:-3], qh.shape[-3:], kh.shape[-2]
    opts = {}
    if rng.random() < 0.6:
        opts["alibi_slopes"] = rng.uniform(0.05, 1.0, size=(Hq,) if rng.random() < 0.5 else lead + (Hq,))
    if rng.random() < 0.4:
        opts["softcap"] = float(rng.choice([0.5, 2.0, 20.0]))
    if rng.random() < 0.4:
        opts["sinks"] = rng.standard_normal(Hq)
    if rng.random() < 0.5:
        kl, ql = _lengths_case(rng, lead, L, S)
        if rng.random() < 0.8:
            opts["key_lengths"] = kl
        if rng.random() < 0.6:
            opts["query_lengths"] = ql
    if rng.random() < 0.35:
        bq, bk = int(rng.integers(1, 6)), int(rng.integers(1, 6))
        nbq, nbk = -(-L // bq), -(-S // bk)
        shape = (nbq, nbk) if rng.random() < 0.5 else lead + (Hq, nbq, nbk)
        opts["block_mask"] = rng.random(shape) < 0.6
        opts["block_size"] = (bq, bk)
    if rng.random() < 0.3:
        opts["scale"] = float(rng.uniform(0.05, 0.5))
    return q, k, v, qd, kd, vd, mask, dict(kw, **opts)


@pytest.mark.parametrize("seed", range(60))
def test_score_options_match_in_memory(seed):
    """alibi_slopes, softcap, sinks, key_lengths, query_lengths, block_mask, scale
    (random subsets) with random (uneven) chunkings, GQA, both layouts, masks,
    causal and windows: against the in-memory function."""
    q, k, v, qd, kd, vd, mask, kw = _options_case(seed)
    m_np = np.asarray(mask) if mask is not None else None
    want, want_lse = fastattn.scaled_dot_product_attention(
        q, k, v, m_np, return_lse=True, num_threads=1, **kw
    )
    got_d, lse_d = fd.scaled_dot_product_attention(qd, kd, vd, mask, return_lse=True, num_threads=1, **kw)
    assert got_d.shape == want.shape and got_d.dtype == want.dtype and lse_d.shape == want_lse.shape
    got, lse = dask.compute(got_d, lse_d, scheduler="threads")
    tol = _tol(q.dtype)
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol, atol=tol)
    assert np.array_equal(np.isneginf(lse), np.isneginf(want_lse))
    fin = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[fin], want_lse[fin], rtol=min(tol, 1e-5), atol=min(tol, 1e-5) * 10)


def test_options_against_float64_reference():
    """Every option at once, float64, against fastattn.reference."""
    rng = np.random.default_rng(11)
    q = rng.standard_normal((3, 4, 37, 8))
    k = rng.standard_normal((3, 2, 45, 8))
    v = rng.standard_normal((3, 2, 45, 6))
    kw = dict(
        is_causal=True,
        window=(20, -1),
        enable_gqa=True,
        scale=0.4,
        alibi_slopes=np.array([0.5, 0.25, 0.125, 0.0625]),
        softcap=3.0,
        sinks=np.array([0.3, -1.0, 2.0, 0.0]),
        key_lengths=np.array([45, 0, 30]),
        query_lengths=np.array([37, 20, 0]),
        block_mask=rng.random((4, 10, 12)) < 0.8,
        block_size=(4, 4),
    )
    want, want_lse = fastattn.reference.scaled_dot_product_attention(q, k, v, return_lse=True, **kw)
    out, lse = fd.scaled_dot_product_attention(
        da.from_array(q, chunks=(2, 3, 13, 8)),
        da.from_array(k, chunks=(1, 1, 7, 8)),
        da.from_array(v, chunks=(3, 2, 9, 6)),
        return_lse=True,
        **kw,
    )
    assert out.chunks[2] == (12, 12, 13) and all(c % 4 == 0 for c in out.chunks[2][:-1])  # whole blocks
    out, lse = dask.compute(out, lse, scheduler="threads")
    np.testing.assert_allclose(out, want, rtol=1e-10, atol=1e-10)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    np.testing.assert_allclose(lse[np.isfinite(lse)], want_lse[np.isfinite(lse)], rtol=1e-10)
    assert np.all(out[1] == 0) and np.all(out[2] == 0)  # no key / no query: zeros
    assert np.all(np.isneginf(lse[2]))  # padded rows: -inf even with sinks
    np.testing.assert_array_equal(lse[1, :, :20], np.broadcast_to(kw["sinks"][:, None], (4, 20)))


@pytest.mark.parametrize("causal", [False, True])
def test_alibi_uneven_chunks_row_blocks(causal):
    """ALiBi with query chunks longer than the split's row blocks and key chunks
    not aligned to them (every off-diagonal pair split), GQA and bshd."""
    rng = np.random.default_rng(15)
    q = rng.standard_normal((1, 150, 4, 16)).astype(np.float32)
    k = rng.standard_normal((1, 170, 2, 16)).astype(np.float32)
    slopes = np.array([0.5, 0.25, 0.125, 0.0625])
    kw = dict(is_causal=causal, enable_gqa=True, layout="bshd", alibi_slopes=slopes, return_lse=True)
    want, want_lse = fastattn.reference.scaled_dot_product_attention(q, k, k, **kw)
    out, lse = fd.scaled_dot_product_attention(
        da.from_array(q, chunks=(1, 130, 4, 16)), da.from_array(k, chunks=(1, 47, 1, 16)), k, **kw
    )
    out, lse = dask.compute(out, lse, scheduler="threads")
    mem, mem_lse = fastattn.scaled_dot_product_attention(q, k, k, **kw)
    # within a few times the in-memory kernel's own float32 error
    assert np.abs(out - want).max() <= 4 * np.abs(mem - want).max() + 1e-6
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "window", [(sys.maxsize, sys.maxsize), (sys.maxsize, 0), (0, sys.maxsize), (sys.maxsize - 5, 3)]
)
def test_huge_windows(window):
    """Window bounds up to 2**63 - 1 (sys.maxsize, "unbounded") shifted by chunk
    offsets: no int64 wrap-around when skipping chunks, no out-of-range window in a
    chunk call (sdpa with and without ALiBi and lengths, varlen)."""
    rng = np.random.default_rng(16)
    q = rng.standard_normal((2, 2, 20, 8)).astype(np.float32)
    k = rng.standard_normal((2, 2, 30, 8)).astype(np.float32)
    qd, kd = da.from_array(q, chunks=(1, 1, 7, 8)), da.from_array(k, chunks=(2, 2, 9, 8))
    for kw in ({}, {"alibi_slopes": np.array([0.3, 0.1])}, {"key_lengths": np.array([30, 11])}):
        want = fastattn.scaled_dot_product_attention(q, k, k, window=window, **kw)
        got = fd.scaled_dot_product_attention(qd, kd, k, window=window, **kw).compute(scheduler="sync")
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    p = rng.standard_normal((20, 2, 8)).astype(np.float32)
    cu = np.array([0, 5, 20])
    want = fastattn.varlen_attention(p, p, p, cu, cu, window=window)
    got = fd.varlen_attention(da.from_array(p, chunks=(7, 2, 8)), p, p, cu, cu, window=window)
    np.testing.assert_allclose(got.compute(scheduler="sync"), want, rtol=2e-5, atol=2e-5)


def test_fully_masked_rows_and_sinks():
    """Rows with no visible key: zeros and LSE -inf, or LSE = sink with sinks
    (the sink counted once however many key chunks the row has)."""
    rng = np.random.default_rng(12)
    q = rng.standard_normal((2, 2, 10, 8)).astype(np.float32)
    k = rng.standard_normal((2, 2, 24, 8)).astype(np.float32)
    mask = rng.random((2, 1, 10, 24)) < 0.5
    mask[:, :, 3] = False  # row 3 sees nothing
    sinks = np.array([1.5, -0.5])
    for kw in ({}, {"sinks": sinks}, {"sinks": sinks, "key_lengths": np.array([0, 13])}):
        want, want_lse = fastattn.scaled_dot_product_attention(q, k, k, mask, return_lse=True, **kw)
        out, lse = fd.scaled_dot_product_attention(
            da.from_array(q, chunks=(1, 1, 4, 8)), da.from_array(k, chunks=(2, 2, 5, 8)), k, mask,
            return_lse=True, **kw,
        )  # fmt: skip
        out, lse = dask.compute(out, lse, scheduler="sync")
        np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
        np.testing.assert_allclose(
            lse[np.isfinite(lse)], want_lse[np.isfinite(want_lse)], rtol=1e-5, atol=1e-5
        )
        assert np.all(out[:, :, 3] == 0)
        if "sinks" in kw:
            np.testing.assert_allclose(lse[0, :, 3], sinks, rtol=1e-6)


def test_lengths_and_block_mask_skip_tasks():
    rng = np.random.default_rng(13)
    q = da.from_array(rng.standard_normal((2, 1, 32, 8)).astype(np.float32), chunks=(1, 1, 8, 8))
    k = da.from_array(rng.standard_normal((2, 1, 32, 8)).astype(np.float32), chunks=(1, 1, 8, 8))
    full = fd.scaled_dot_product_attention(q, k, k)
    assert _count(full, "fastattn-part") == 2 * 4 * 4
    kl = fd.scaled_dot_product_attention(q, k, k, key_lengths=np.array([8, 17]))
    assert _count(kl, "fastattn-part") == 4 * 1 + 4 * 3  # key chunks past the length get no task
    ql = fd.scaled_dot_product_attention(q, k, k, query_lengths=np.array([0, 9]))
    assert _count(ql, "fastattn-part") == 0 + 2 * 4  # nor do query chunks past it
    bm = np.zeros((8, 8), bool)
    bm[np.arange(8), np.arange(8)] = True  # 4x4 blocks on the diagonal: 2 blocks per chunk pair on it
    blk = fd.scaled_dot_product_attention(q, k, k, block_mask=bm, block_size=(4, 4))
    assert _count(blk, "fastattn-part") == 2 * 4
    for arr, kw in (
        (kl, dict(key_lengths=np.array([8, 17]))),
        (ql, dict(query_lengths=np.array([0, 9]))),
        (blk, dict(block_mask=bm, block_size=(4, 4))),
    ):
        want = fastattn.scaled_dot_product_attention(np.asarray(q), np.asarray(k), np.asarray(k), **kw)
        np.testing.assert_allclose(arr.compute(scheduler="sync"), want, rtol=2e-5, atol=2e-5)


def test_precision_passes_through():
    """float32 with precision="medium" on the amx path (>= 32 rows per key/value
    head in a chunk), keys in one chunk: each query chunk rounds as the in-memory
    call does, so the result equals it (and differs from "highest")."""
    rng = np.random.default_rng(14)
    q = rng.standard_normal((1, 2, 64, 32)).astype(np.float32)
    k = rng.standard_normal((1, 2, 96, 32)).astype(np.float32)
    want_med = fastattn.scaled_dot_product_attention(q, k, k, precision="medium")
    want_hi = fastattn.scaled_dot_product_attention(q, k, k, precision="highest")
    got = {
        prec: fd.scaled_dot_product_attention(da.from_array(q, chunks=(1, 1, 32, 32)), k, k, precision=prec)
        for prec in ("medium", "highest")
    }
    np.testing.assert_allclose(got["medium"].compute(scheduler="sync"), want_med, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got["highest"].compute(scheduler="sync"), want_hi, rtol=1e-6, atol=1e-6)
    if fastattn.get_isa() == "amx":
        assert np.abs(want_med - want_hi).max() > 1e-4  # the level mattered
    with pytest.raises(ValueError, match="precision"):
        fd.scaled_dot_product_attention(q, k, k, precision="low")


def _same_error(fn_a, fn_b):
    with pytest.raises((TypeError, ValueError)) as ea:
        fn_a()
    with pytest.raises((TypeError, ValueError)) as eb:
        fn_b()
    assert type(ea.value) is type(eb.value) and str(ea.value) == str(eb.value)


BAD_OPTIONS = [
    dict(alibi_slopes=np.ones(3)),
    dict(alibi_slopes=np.array([1.0, np.nan])),
    dict(alibi_slopes=np.array([True, False])),
    dict(softcap=0.0),
    dict(softcap="1"),
    dict(softcap=np.inf),
    dict(sinks=np.ones((2, 2))),
    dict(sinks=np.array([1.0, np.inf])),
    dict(key_lengths=np.array([1, 2, 3])),
    dict(key_lengths=np.array([1.0, 2.0])),
    dict(key_lengths=np.array([1, 9])),
    dict(query_lengths=np.array([-1, 2])),
    dict(block_mask=np.ones((2, 2), bool)),
    dict(block_size=(2, 2)),
    dict(block_mask=np.ones((4, 4), np.int8), block_size=(2, 2)),
    dict(block_mask=np.ones((4, 4), bool), block_size=(0, 2)),
    dict(block_mask=np.ones((4, 4), bool), block_size=(3, 2)),
    dict(block_mask=np.ones((4, 4), bool), block_size=2),
    dict(scale=np.inf),
    dict(scale="x"),
    dict(precision="fast"),
    dict(precision=1),
    dict(window=(0, 1, 2)),
    dict(is_causal=np.ones(2)),
]


@pytest.mark.parametrize("bad", BAD_OPTIONS, ids=[str(sorted(b)) for b in BAD_OPTIONS])
def test_bad_options_same_errors_as_in_memory(bad):
    q = np.ones((2, 2, 8, 4), np.float32)
    k = np.ones((2, 2, 8, 4), np.float32)
    _same_error(
        lambda: fastattn.scaled_dot_product_attention(q, k, k, **bad),
        lambda: fd.scaled_dot_product_attention(da.from_array(q, chunks=(1, 1, 3, 4)), k, k, **bad),
    )


@pytest.mark.parametrize("shape", [(8, 4), (2, 8, 4), (2, 2, 8, 4)])
@pytest.mark.parametrize(
    "mask", [np.zeros((3, 8), bool), np.zeros((8, 8), np.int32), np.zeros((1, 1, 1, 1, 8), bool)]
)
def test_bad_mask_same_errors_as_in_memory(shape, mask):
    q = np.ones(shape, np.float32)
    _same_error(
        lambda: fastattn.scaled_dot_product_attention(q, q, q, mask),
        lambda: fd.scaled_dot_product_attention(da.from_array(q), q, q, mask),
    )


def test_import_does_not_import_ml_dtypes():
    """ml_dtypes (slow to import) is imported only once a bfloat16 array exists."""
    code = "import sys, fastattn.dask; assert 'ml_dtypes' not in sys.modules, 'ml_dtypes imported'"
    pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(fastattn.__file__)))
    env = dict(os.environ, PYTHONPATH=pkg_parent)
    with tempfile.TemporaryDirectory() as d:
        subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=d)


# --------------------------------------------------------------------------- varlen


def _varlen_case(seed):
    rng = np.random.default_rng(2000 + seed)
    nb = int(rng.integers(1, 6))
    lq = rng.integers(0, 12, size=nb)
    lk = rng.integers(0, 14, size=nb)
    if seed % 3 == 0:  # a sequence with no keys, and one with no queries
        lk[0] = 0
        lq[-1] = 0
    cq = np.concatenate([[0], np.cumsum(lq)]).astype(np.int64)
    ck = np.concatenate([[0], np.cumsum(lk)]).astype(np.int64)
    Hk = int(rng.integers(1, 3))
    G = int(rng.choice([1, 2, 3]))
    Hq = Hk * G
    dtype = [np.float32, np.float64, np.float16][seed % 3]
    D, Dv = 8, int(rng.choice([4, 8]))
    q = rng.standard_normal((int(cq[-1]), Hq, D)).astype(dtype)
    k = rng.standard_normal((int(ck[-1]), Hk, D)).astype(dtype)
    v = rng.standard_normal((int(ck[-1]), Hk, Dv)).astype(dtype)
    qd = da.from_array(q, chunks=tuple(_random_chunks(rng, n) for n in q.shape))
    kd = da.from_array(k, chunks=tuple(_random_chunks(rng, n) for n in k.shape))
    vd = da.from_array(v, chunks=tuple(_random_chunks(rng, n) for n in v.shape))
    kw = dict(is_causal=bool(rng.random() < 0.5), enable_gqa=G > 1)
    if rng.random() < 0.5:
        kw["window"] = (int(rng.choice([-1, 0, 2, 5])), int(rng.choice([-1, 0, 3])))
    if rng.random() < 0.5:
        kw["alibi_slopes"] = rng.uniform(0.05, 1.0, size=(Hq,) if rng.random() < 0.5 else (nb, Hq))
    if rng.random() < 0.3:
        kw["softcap"] = 2.0
    if rng.random() < 0.4:
        kw["sinks"] = rng.standard_normal(Hq)
    if rng.random() < 0.3:
        kw["scale"] = 0.2
    return q, k, v, qd, kd, vd, cq, ck, kw


@pytest.mark.parametrize("seed", range(40))
def test_varlen_matches_in_memory(seed):
    q, k, v, qd, kd, vd, cq, ck, kw = _varlen_case(seed)
    want, want_lse = fastattn.varlen_attention(q, k, v, cq, ck, return_lse=True, num_threads=1, **kw)
    got_d, lse_d = fd.varlen_attention(qd, kd, vd, cq, ck, return_lse=True, num_threads=1, **kw)
    assert got_d.shape == want.shape and got_d.dtype == want.dtype and lse_d.shape == want_lse.shape
    got, lse = dask.compute(got_d, lse_d, scheduler="threads")
    tol = _tol(q.dtype)
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol, atol=tol)
    assert np.array_equal(np.isneginf(lse), np.isneginf(want_lse))
    fin = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[fin], want_lse[fin], rtol=min(tol, 1e-5), atol=min(tol, 1e-5) * 10)
    only = fd.varlen_attention(qd, kd, vd, cq, ck, num_threads=1, **kw).compute(scheduler="sync")
    np.testing.assert_array_equal(only, got)


def test_varlen_against_reference_and_skips():
    """Sequences cut by chunk boundaries (queries and keys), float64 against the
    reference; key chunks of other sequences get no task."""
    rng = np.random.default_rng(21)
    cq = np.array([0, 10, 30, 31, 50])
    ck = np.array([0, 25, 40, 41, 70])
    q = rng.standard_normal((50, 4, 8))
    k = rng.standard_normal((70, 2, 8))
    v = rng.standard_normal((70, 2, 6))
    kw = dict(is_causal=True, enable_gqa=True, alibi_slopes=np.array([0.3, 0.2, 0.1, 0.05]), sinks=np.ones(4))
    want, want_lse = fastattn.reference.varlen_attention(q, k, v, cq, ck, return_lse=True, **kw)
    out, lse = fd.varlen_attention(
        da.from_array(q, chunks=(7, 2, 8)),
        da.from_array(k, chunks=(9, 1, 8)),
        v,
        cq,
        ck,
        return_lse=True,
        **kw,
    )
    # query chunk [0, 7) holds only sequence 0, whose keys [0, 25) are in key chunks 0..2
    graph = dict(out.__dask_graph__())
    assert {key[-1] for key in graph if key[0].startswith("fastattn-part") and key[1] == 0} == {0, 1, 2}
    out, lse = dask.compute(out, lse, scheduler="threads")
    np.testing.assert_allclose(out, want, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-10)


VARLEN_BAD = [
    dict(cu_seqlens_q=np.array([0, 3]), cu_seqlens_k=np.array([0, 4])),
    dict(cu_seqlens_q=np.array([0, 4.0]), cu_seqlens_k=np.array([0, 4])),
    dict(cu_seqlens_q=np.array([1, 4]), cu_seqlens_k=np.array([0, 4])),
    dict(cu_seqlens_q=np.array([0, 2, 4]), cu_seqlens_k=np.array([0, 4])),
    dict(alibi_slopes=np.ones(5)),
    dict(sinks=np.ones(3)),
    dict(softcap=-1.0),
    dict(window=(-3, 0)),
    dict(precision="x"),
    dict(scale=np.nan),
]


@pytest.mark.parametrize("bad", VARLEN_BAD, ids=[str(sorted(b)) for b in VARLEN_BAD])
def test_varlen_bad_input_same_errors(bad):
    q = np.ones((4, 2, 8), np.float32)
    kw = dict(cu_seqlens_q=np.array([0, 4]), cu_seqlens_k=np.array([0, 4]))
    kw.update(bad)
    cu_q, cu_k = kw.pop("cu_seqlens_q"), kw.pop("cu_seqlens_k")
    _same_error(
        lambda: fastattn.varlen_attention(q, q, q, cu_q, cu_k, **kw),
        lambda: fd.varlen_attention(da.from_array(q, chunks=(3, 1, 8)), q, q, cu_q, cu_k, **kw),
    )
    _same_error(
        lambda: fastattn.varlen_attention(q, q[:, :1], q, np.array([0, 4]), np.array([0, 4])),
        lambda: fd.varlen_attention(q, q[:, :1], q, np.array([0, 4]), np.array([0, 4])),
    )


def _count(arr, prefix):
    return sum(
        1 for key in dict(arr.__dask_graph__()) if isinstance(key, tuple) and key[0].startswith(prefix)
    )


def test_causal_skips_key_chunks():
    rng = np.random.default_rng(3)
    n, c = 64, 8  # 8 chunks each way
    q = da.from_array(rng.standard_normal((1, 2, n, 16)).astype(np.float32), chunks=(1, 1, c, 16))
    k = da.from_array(rng.standard_normal((1, 2, n, 16)).astype(np.float32), chunks=(1, 1, c, 16))
    v = da.from_array(rng.standard_normal((1, 2, n, 16)).astype(np.float32), chunks=(1, 1, c, 16))
    full = fd.scaled_dot_product_attention(q, k, v)
    causal = fd.scaled_dot_product_attention(q, k, v, is_causal=True)
    win = fd.scaled_dot_product_attention(q, k, v, window=(c, 0))
    assert _count(full, "fastattn-part") == 2 * 8 * 8
    assert _count(causal, "fastattn-part") == 2 * 8 * 9 // 2
    assert _count(win, "fastattn-part") == 2 * (8 + 7)  # diagonal and first sub-diagonal blocks
    # merges: a binary tree has (parts - 1) merges per query chunk
    assert _count(full, "fastattn-merge") == 2 * 8 * 7
    assert _count(causal, "fastattn-merge") == 2 * sum(range(8))
    want = fastattn.scaled_dot_product_attention(*(np.asarray(a) for a in (q, k, v)), is_causal=True)
    np.testing.assert_allclose(causal.compute(scheduler="threads"), want, rtol=2e-5, atol=2e-5)
    want = fastattn.scaled_dot_product_attention(*(np.asarray(a) for a in (q, k, v)), window=(c, 0))
    np.testing.assert_allclose(win.compute(scheduler="threads"), want, rtol=2e-5, atol=2e-5)


def test_queries_that_see_no_key_chunk():
    """Causal with L > S: the first L - S queries see nothing (zeros, LSE -inf),
    including whole query chunks that get no partial task."""
    rng = np.random.default_rng(4)
    q = rng.standard_normal((1, 30, 8)).astype(np.float32)
    k = rng.standard_normal((1, 10, 8)).astype(np.float32)
    v = rng.standard_normal((1, 10, 8)).astype(np.float32)
    out, lse = fd.scaled_dot_product_attention(
        da.from_array(q, chunks=(1, 7, 8)),
        da.from_array(k, chunks=(1, 4, 8)),
        v,
        is_causal=True,
        return_lse=True,
    )
    out, lse = dask.compute(out, lse, scheduler="sync")
    want, want_lse = fastattn.scaled_dot_product_attention(q, k, v, is_causal=True, return_lse=True)
    assert np.all(out[:, :20] == 0) and np.all(np.isneginf(lse[:, :20]))
    np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(lse[:, 20:], want_lse[:, 20:], rtol=1e-5)


def test_gqa_head_chunks_rounded_to_groups():
    rng = np.random.default_rng(5)
    q = rng.standard_normal((6, 12, 8)).astype(np.float32)  # Hq=6, Hk=2: groups of 3
    k = rng.standard_normal((2, 12, 8)).astype(np.float32)
    v = rng.standard_normal((2, 12, 8)).astype(np.float32)
    qd = da.from_array(q, chunks=(2, 12, 8))  # head chunk boundaries 2, 4 are not whole groups
    out = fd.scaled_dot_product_attention(qd, k, v, enable_gqa=True)
    assert out.chunks[0] == (3, 3)  # rounded down: boundaries 0, 3 (from 2 and 4), 6
    kd = da.from_array(k, chunks=(1, 12, 8))
    out2 = fd.scaled_dot_product_attention(da.from_array(q, chunks=(6, 12, 8)), kd, v, enable_gqa=True)
    assert out2.chunks[0] == (3, 3)  # key head chunks times the group size
    want = fastattn.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    np.testing.assert_allclose(out.compute(scheduler="threads"), want, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(out2.compute(scheduler="threads"), want, rtol=2e-5, atol=2e-5)


def test_mask_broadcast_dims_stay_small():
    rng = np.random.default_rng(6)
    q = da.from_array(rng.standard_normal((3, 4, 20, 8)).astype(np.float32), chunks=(1, 2, 5, 8))
    k = da.from_array(rng.standard_normal((3, 4, 30, 8)).astype(np.float32), chunks=(1, 2, 10, 8))
    m = da.from_array(rng.random((1, 20, 30)) < 0.7, chunks=(1, 20, 30))
    out = fd.scaled_dot_product_attention(q, k, k, m)
    mask_keys = [key for key in dict(out.__dask_graph__()) if isinstance(key, tuple) and "rechunk" in key[0]]
    assert mask_keys  # the mask was rechunked along L and S ...
    parts = [t for key, t in dict(out.__dask_graph__()).items() if key[0].startswith("fastattn-part")]
    assert len(parts) == 3 * 2 * 4 * 3  # ... and not expanded: every part reads a (1, 1, 5, 10) mask chunk
    want = fastattn.scaled_dot_product_attention(np.asarray(q), np.asarray(k), np.asarray(k), np.asarray(m))
    np.testing.assert_allclose(out.compute(scheduler="threads"), want, rtol=2e-5, atol=2e-5)


def test_empty_key_length():
    q = np.ones((2, 3, 4), np.float32)
    k = np.ones((2, 0, 4), np.float32)
    out, lse = fd.scaled_dot_product_attention(q, k, k, return_lse=True)
    out, lse = dask.compute(out, lse, scheduler="sync")
    assert out.shape == (2, 3, 4) and np.all(out == 0) and np.all(np.isneginf(lse))


def test_numpy_inputs_are_wrapped_and_inputs_not_modified():
    rng = np.random.default_rng(8)
    q, k, v = (rng.standard_normal((2, 9, 8)).astype(np.float32) for _ in range(3))
    copies = [a.copy() for a in (q, k, v)]
    out = fd.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert isinstance(out, da.Array)
    np.testing.assert_allclose(
        out.compute(), fastattn.scaled_dot_product_attention(q, k, v, is_causal=True), rtol=1e-6, atol=1e-6
    )
    for a, c in zip((q, k, v), copies):
        np.testing.assert_array_equal(a, c)


def _exploding(shape, chunks):
    """A dask array whose chunks raise when computed: errors must come first."""

    def boom(block_info=None):
        raise RuntimeError("a task ran")

    return da.map_blocks(boom, chunks=chunks, dtype=np.float32, meta=np.empty((0,) * len(shape), np.float32))


def test_errors_before_any_task_runs():
    q = _exploding((2, 8, 4), ((1, 1), (4, 4), (4,)))
    k = _exploding((2, 8, 4), ((2,), (8,), (4,)))
    out = fd.scaled_dot_product_attention(q, k, k, is_causal=True, window=(2, -1))  # lazy: no task runs
    assert out.shape == (2, 8, 4)
    with pytest.raises(RuntimeError, match="a task ran"):
        out.compute(scheduler="sync")
    with pytest.raises(TypeError, match="query"):
        fd.scaled_dot_product_attention([[1.0]], k, k)
    with pytest.raises(TypeError, match="attn_mask"):
        fd.scaled_dot_product_attention(q, k, k, attn_mask=[[True]])
    with pytest.raises(TypeError, match="attn_mask"):
        fd.scaled_dot_product_attention(q, k, k, attn_mask=np.zeros((8, 8), np.int32))
    with pytest.raises(ValueError, match="attn_mask"):
        fd.scaled_dot_product_attention(q, k, k, attn_mask=np.zeros((3, 8), bool))
    with pytest.raises(ValueError, match="window"):
        fd.scaled_dot_product_attention(q, k, k, window=(-2, 0))
    with pytest.raises(ValueError, match="layout"):
        fd.scaled_dot_product_attention(q, k, k, layout="sbhd")
    with pytest.raises(TypeError, match="is_causal"):
        fd.scaled_dot_product_attention(q, k, k, is_causal="yes")
    with pytest.raises(ValueError, match="enable_gqa"):
        fd.scaled_dot_product_attention(q, k[:1], k[:1])
    with pytest.raises(ValueError, match="head dim"):
        fd.scaled_dot_product_attention(q, k[..., :3], k)
    with pytest.raises(ValueError, match="num_threads"):
        fd.scaled_dot_product_attention(q, k, k, num_threads=0)
    with pytest.raises(TypeError, match="value"):
        fd.scaled_dot_product_attention(q, k, k.astype(np.float64))
    unknown = q[q[:, 0, 0] > 0]  # boolean indexing: unknown chunk sizes along batch
    with pytest.raises(ValueError, match="unknown chunk sizes"):
        fd.scaled_dot_product_attention(unknown, k, k)


def test_import_fastattn_does_not_import_dask():
    code = "import sys, fastattn; assert not any(m == 'dask' or m.startswith('dask.') for m in sys.modules)"
    # the fastattn under test (installed or in-place), from a cwd holding no source tree
    pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(fastattn.__file__)))
    env = dict(os.environ, PYTHONPATH=pkg_parent)
    with tempfile.TemporaryDirectory() as d:
        subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=d)


# --------------------------------------------------------------------------- distributed scheduler

MEMORY_LIMIT = 200_000_000


@pytest.fixture(scope="module")
def client():
    distributed = optional("distributed")
    cfg = {
        "distributed.worker.memory.target": False,  # no spilling to disk: the data must fit
        "distributed.worker.memory.spill": False,
        "distributed.worker.memory.pause": False,
        "distributed.worker.memory.terminate": 0.98,
        "distributed.scheduler.allowed-failures": 0,
        "distributed.comm.timeouts.connect": "30s",
    }
    with dask.config.set(cfg):
        cluster = distributed.LocalCluster(
            n_workers=2,
            threads_per_worker=1,
            processes=True,
            memory_limit=MEMORY_LIMIT,
            dashboard_address=":0",
            silence_logs=40,
        )
        c = distributed.Client(cluster)
        try:
            yield c
        finally:
            c.close(timeout=10)
            cluster.close(timeout=10)


@pytest.mark.parametrize("seed", [1, 6, 7])
def test_distributed_matches_in_memory(client, seed):
    q, k, v, qd, kd, vd, mask, kw = _case(seed)
    m_np = np.asarray(mask) if mask is not None else None
    want, want_lse = fastattn.scaled_dot_product_attention(
        q, k, v, m_np, return_lse=True, num_threads=1, **kw
    )
    out, lse = fd.scaled_dot_product_attention(qd, kd, vd, mask, return_lse=True, num_threads=1, **kw)
    out, lse = (f.result(timeout=120) for f in client.compute([out, lse]))
    tol = _tol(q.dtype)
    np.testing.assert_allclose(out.astype(np.float64), want.astype(np.float64), rtol=tol, atol=tol)
    assert np.array_equal(np.isneginf(lse), np.isneginf(want_lse))


def _const_keys(block_info=None):
    loc = block_info[None]["array-location"]
    shape = tuple(b - a for a, b in loc)
    h0 = loc[1][0]
    c = np.cos(np.arange(h0, h0 + shape[1])[:, None] * 0.7 + np.arange(shape[3])[None, :])
    return np.broadcast_to(c[None, :, None, :], shape).astype(np.float32)  # constant along S


def _value_table(h, D):
    """v[., h, s, d] = table[(37 * s) % 101, d]."""
    r = np.arange(101)[:, None]
    d = np.arange(D)[None, :]
    return (((r + 11 * d + 5 * h) % 101) / 101.0 - 0.5).astype(np.float32)


def _formula_values(block_info=None):
    loc = block_info[None]["array-location"]
    shape = tuple(b - a for a, b in loc)
    rows = (37 * np.arange(*loc[2], dtype=np.int64)) % 101
    out = np.empty(shape, np.float32)
    for h in range(shape[1]):
        out[0, h] = _value_table(loc[1][0] + h, shape[3])[rows]
    return out


def test_distributed_keys_larger_than_worker_memory(client):
    """K/V of 512 MB, generated chunk by chunk on the workers (never on the
    client), on workers limited to 200 MB with spilling off: constant keys make
    attention uniform, so the output is the mean of the values, known from the
    generator's formula."""
    H, S, D, L, cs = 2, 1 << 20, 32, 8, 1 << 15
    chunks = ((1,), (1,) * H, (cs,) * (S // cs), (D,))
    k = da.map_blocks(_const_keys, chunks=chunks, dtype=np.float32, meta=np.empty((0,) * 4, np.float32))
    v = da.map_blocks(_formula_values, chunks=chunks, dtype=np.float32, meta=np.empty((0,) * 4, np.float32))
    assert k.nbytes + v.nbytes > 2.5 * MEMORY_LIMIT
    q = np.random.default_rng(0).standard_normal((1, H, L, D)).astype(np.float32)
    out = fd.scaled_dot_product_attention(q, k, v, num_threads=1)
    # Workers may be forked from this (large) test process, so their absolute
    # RSS says little: reset each worker's high-water mark to its current RSS
    # and check how far it grew during the computation.
    before = client.run(_reset_peak_rss)
    res = client.compute(out).result(timeout=120)
    counts = np.bincount((37 * np.arange(S, dtype=np.int64)) % 101, minlength=101)
    want = np.stack([counts @ _value_table(h, D).astype(np.float64) / S for h in range(H)])
    np.testing.assert_allclose(res[0], np.broadcast_to(want[:, None, :], (H, L, D)), rtol=0, atol=2e-6)
    peaks = client.run(_peak_rss)
    growth = {w: peaks[w] - before[w] for w in peaks}
    assert max(growth.values()) < MEMORY_LIMIT, growth


def _proc_status_bytes(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak_rss():
    """Reset VmHWM to the current RSS (Linux clear_refs) and return that RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _proc_status_bytes("VmRSS")


def _peak_rss():
    return _proc_status_bytes("VmHWM")


def test_example_script_runs_small():
    """examples/dask_million_keys.py end to end, shrunk, with its in-memory check."""
    optional("distributed")
    path = os.path.join(
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        "examples",
        "dask_million_keys.py",
    )
    if not os.path.exists(path):
        pytest.skip("examples/ not available")
    args = [
        "--keys",
        "20000",
        "--queries",
        "96",
        "--query-chunk",
        "40",
        "--key-chunk",
        "6000",
        "--heads",
        "1",
        "--workers",
        "1",
        "--causal",
        "--window",
        "9000",
        "--check",
    ]
    r = subprocess.run([sys.executable, path, *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "check row 95" in r.stdout and "peak RSS" in r.stdout
