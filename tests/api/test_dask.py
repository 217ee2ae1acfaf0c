"""fastattn.dask: sharded exact attention over Dask arrays."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import tempfile

import numpy as np
import pytest

import fastattn

da = pytest.importorskip("dask.array")
dask = pytest.importorskip("dask")
fd = pytest.importorskip("fastattn.dask")

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
def test_chunk_pair_offsets_exhaustive(causal, window, L, S):
    """Every (query chunk, key chunk) pair of every size against the full
    problem's mask sliced to that pair: checks the window/offset/mask choice
    made inside a task, including pairs that need an explicit mask."""
    rng = np.random.default_rng(L * 100 + S)
    q = rng.standard_normal((1, 2, L, 8)).astype(np.float32)
    k = rng.standard_normal((1, 2, S, 8)).astype(np.float32)
    v = rng.standard_normal((1, 2, S, 4)).astype(np.float32)
    wl, wr = window or (-1, -1)
    wr = 0 if causal else wr
    i = np.arange(L)[:, None]
    j = np.arange(S)[None, :]
    vis = np.ones((L, S), bool)
    if wl >= 0:
        vis &= j >= i + S - L - wl
    if wr >= 0:
        vis &= j <= i + S - L + wr
    lo = None if wl < 0 else S - L - wl
    hi = None if wr < 0 else S - L + wr
    fmask = rng.standard_normal((L, S)).astype(np.float32)
    opts = dict(scale=0.3, gqa=False, layout="bhsd", threads=1)
    pairs = []
    for i0, i1 in itertools.combinations(range(L + 1), 2):
        for j0, j1 in itertools.combinations(range(S + 1), 2):
            kind = fd._visibility(i0, i1, j0, j1, lo, hi)
            sub = vis[i0:i1, j0:j1]
            assert kind == ("none" if not sub.any() else "full" if sub.all() else "partial")
            if kind != "none":
                pairs.append((i0, i1, j0, j1, kind))
    # numerics on a sample of the pairs (all of them would take too long), partial ones first
    pairs.sort(key=lambda p: (p[4] != "partial", rng.random()))
    paths = set()
    for n, (i0, i1, j0, j1, kind) in enumerate(pairs[:48]):
        if kind == "partial":
            paths.add(fd._chunk_window(i0, i1, j0, j1, lo, hi) is None)
        sub = vis[i0:i1, j0:j1]
        user = None if n % 2 else fmask[i0:i1, j0:j1]
        want_m = sub if user is None else np.where(sub, user, -np.inf).astype(np.float32)
        want = fastattn.scaled_dot_product_attention(
            q[:, :, i0:i1], k[:, :, j0:j1], v[:, :, j0:j1], want_m, scale=0.3, return_lse=True, num_threads=1
        )
        got = fd._part(
            q[:, :, i0:i1],
            k[:, :, j0:j1],
            v[:, :, j0:j1],
            user,
            geom=(i0, i1, j0, j1, lo, hi, kind),
            opts=opts,
        )
        np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(np.isneginf(got[1]), np.isneginf(want[1]))
        f = np.isfinite(want[1])
        np.testing.assert_allclose(got[1][f], want[1][f], rtol=1e-6, atol=1e-6)
    if window is not None or causal:
        assert paths == {True, False}  # both the window path and the explicit-mask path were checked


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
    distributed = pytest.importorskip("distributed")
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
    pytest.importorskip("distributed")
    path = os.path.join(
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples", "dask_million_keys.py"
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
