"""The attention family beyond dot-product: additive (Bahdanau) attention, Reformer's
LSH attention, positions (sinusoidal, rotary, rotary fused into the cache path)
and attention weights for inspection.  Each fast path is compared with its
float64 implementation in fastattn.reference, with hand-worked cases, and with
independent formulations (full attention for a single LSH chunk, the
relative-position property of rotary embeddings)."""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import os
import platform
import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest
from conftest import assert_close, optional, randn

import fastattn
from fastattn import reference as ref

F32, F64 = np.dtype(np.float32), np.dtype(np.float64)
BF16 = np.dtype(ml_dtypes.bfloat16)


# ----------------------------------------------------------------- additive


def _additive_inputs(rng, lead, L, S, Dq, Dk, Dv, A, dtype):
    q = randn(rng, lead + (L, Dq), dtype)
    k = randn(rng, lead + (S, Dk), dtype)
    v = randn(rng, lead + (S, Dv), dtype)
    wq = randn(rng, (A, Dq), F64, 1 / math.sqrt(Dq))
    wk = randn(rng, (A, Dk), F64, 1 / math.sqrt(Dk))
    w = randn(rng, (A,), F64)
    b = randn(rng, (A,), F64, 0.5)
    return q, k, v, wq, wk, w, b


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize(
    "lead,L,S,Dq,Dk,Dv,A",
    [
        ((), 1, 1, 1, 1, 1, 1),
        ((2,), 37, 53, 24, 20, 19, 33),
        ((2, 3), 5, 70, 8, 9, 7, 17),
        ((1,), 65, 3, 16, 16, 33, 128),
    ],
)
def test_additive_matches_reference(isa, rng, dtype, lead, L, S, Dq, Dk, Dv, A):
    q, k, v, wq, wk, w, b = _additive_inputs(rng, lead, L, S, Dq, Dk, Dv, A, dtype)
    copies = [a.copy() for a in (q, k, v, wq, wk, w, b)]
    o, wts = fastattn.additive_attention(q, k, v, wq, wk, w, bias=b, return_weights=True)
    ro, rw = ref.additive_attention(q, k, v, wq, wk, w, bias=b, return_weights=True)
    assert o.dtype == dtype and wts.dtype == dtype
    assert_close(o, ro, dtype)
    assert_close(wts, rw, dtype, what="weights")
    assert_close(wts @ v.astype(F64), ro, dtype, what="weights @ value")
    for a, c in zip((q, k, v, wq, wk, w, b), copies):
        np.testing.assert_array_equal(a, c)
    o2 = fastattn.additive_attention(q, k, v, wq, wk, w)  # no bias
    assert_close(o2, ref.additive_attention(q, k, v, wq, wk, w), dtype)


def test_additive_hand_worked():
    # One query, two keys, A = 1: e_j = 2 tanh(0.5 * 1 + k_j + 0.25).
    q = np.array([[1.0]])
    k = np.array([[0.0], [1.0]])
    v = np.array([[10.0, 0.0], [0.0, 20.0]])
    e = [2 * math.tanh(0.75), 2 * math.tanh(1.75)]
    p1 = 1 / (1 + math.exp(e[0] - e[1]))
    o, w = fastattn.additive_attention(q, k, v, [[0.5]], [[1.0]], [2.0], bias=[0.25], return_weights=True)
    np.testing.assert_allclose(w, [[1 - p1, p1]], rtol=1e-14)
    np.testing.assert_allclose(o, [[10 * (1 - p1), 20 * p1]], rtol=1e-14)


@pytest.mark.parametrize("dtype", [F32, F64])
def test_additive_masks_and_dead_rows(isa, rng, dtype):
    q, k, v, wq, wk, w, b = _additive_inputs(rng, (2,), 9, 70, 8, 6, 5, 12, dtype)
    bm = rng.random((9, 70)) > 0.4
    bm[2] = False  # fully masked row -> zeros
    fm = np.where(rng.random((2, 1, 70)) > 0.5, 0.0, -np.inf).astype(dtype) + randn(rng, (2, 9, 70), dtype)
    fm[1, 4] = -np.inf
    for mask in (bm, fm, bm[None], np.ones((1, 70), bool), fm.astype(F64), fm.astype(np.float16)):
        o, wts = fastattn.additive_attention(q, k, v, wq, wk, w, bias=b, attn_mask=mask, return_weights=True)
        ro, rw = ref.additive_attention(q, k, v, wq, wk, w, bias=b, attn_mask=mask, return_weights=True)
        assert_close(o, ro, dtype)
        assert_close(wts, rw, dtype, what="weights")
    o = fastattn.additive_attention(q, k, v, wq, wk, w, attn_mask=bm)
    assert np.all(o[:, 2] == 0)
    o = fastattn.additive_attention(q, k, v, wq, wk, w, attn_mask=fm)
    assert np.all(o[1, 4] == 0)


def test_additive_threads_bit_identical(rng):
    q, k, v, wq, wk, w, b = _additive_inputs(rng, (2,), 96, 131, 32, 32, 24, 64, F32)
    outs = [fastattn.additive_attention(q, k, v, wq, wk, w, bias=b, num_threads=n) for n in (1, 2, 3)]
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])


def test_additive_bad_input(rng):
    q, k, v, wq, wk, w, b = _additive_inputs(rng, (), 4, 5, 3, 3, 2, 6, F32)
    f = fastattn.additive_attention
    with pytest.raises(TypeError, match="query"):
        f(q.astype(np.int32), k, v, wq, wk, w)
    with pytest.raises(TypeError, match="share a dtype"):
        f(q, k.astype(F64), v, wq, wk, w)
    with pytest.raises(ValueError, match="w_key"):
        f(q, k, v, wq, wk[:, :2], w)
    with pytest.raises(ValueError, match="v must have shape"):
        f(q, k, v, wq, wk, w[:3])
    with pytest.raises(ValueError, match="bias"):
        f(q, k, v, wq, wk, w, bias=b[:2])
    with pytest.raises(ValueError, match="same length"):
        f(q, k, v[:4], wq, wk, w)
    with pytest.raises(ValueError, match="attn_mask"):
        f(q, k, v, wq, wk, w, attn_mask=np.ones((3, 5), bool))
    with pytest.raises(TypeError, match="attn_mask"):
        f(q, k, v, wq, wk, w, attn_mask=np.ones((4, 5), np.int8))
    with pytest.raises(TypeError, match="num_threads"):
        f(q, k, v, wq, wk, w, num_threads=1.5)


# ---------------------------------------------------------------------- LSH


def _full_shared_qk(qk, value, scale, causal):
    """Full attention over all tokens with keys qk/|qk| and the self score -1e5,
    through the reference dot-product attention (a float mask that turns the
    self score scale*|x| into -1e5)."""
    x = qk.astype(F64)
    n = np.linalg.norm(x, axis=-1, keepdims=True)
    khat = x / n
    L = x.shape[-2]
    eye = np.eye(L, dtype=bool)
    mask = np.where(eye, -1e5 - scale * n, 0.0)
    if causal:
        mask = np.where(np.triu(np.ones((L, L), bool), 1), -np.inf, mask)
    return ref.scaled_dot_product_attention(x, khat, value.astype(F64), mask, scale=scale, return_lse=True)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [F32, F64])
def test_lsh_single_chunk_is_full_attention(rng, causal, dtype):
    qk = randn(rng, (2, 96, 16), dtype)
    val = randn(rng, (2, 96, 8), dtype)
    sc = 1 / math.sqrt(16)
    ro, rl = _full_shared_qk(qk, val, sc, causal)
    o, lse = fastattn.lsh_attention(
        qk, val, n_buckets=4, chunk_size=96, causal=causal, seed=1, return_lse=True
    )
    assert o.dtype == dtype
    assert_close(o, ro, dtype)
    assert_close(lse, rl, dtype, what="lse")
    # Three rounds over one chunk see the same keys three times: same output, LSE + log 3.
    o3, l3 = fastattn.lsh_attention(
        qk, val, n_buckets=4, n_hashes=3, chunk_size=96, causal=causal, seed=2, return_lse=True
    )
    assert_close(o3, ro, dtype)
    assert_close(l3, rl + math.log(3), dtype, what="lse")


@pytest.mark.parametrize(
    "L,ch,nb,nh,causal",
    [
        (256, 32, 8, 1, False),
        (256, 32, 8, 1, True),
        (128, 64, 4, 1, False),
        (192, 16, 16, 3, True),
        (64, 32, 2, 2, False),
        (96, 32, 6, 2, False),
    ],
)
def test_lsh_chunked_matches_reference(rng, L, ch, nb, nh, causal):
    qk = randn(rng, (2, L, 12), F64)
    val = randn(rng, (2, L, 5), F64)
    rot = rng.standard_normal((nh, 12, nb // 2))
    kw = dict(n_buckets=nb, n_hashes=nh, chunk_size=ch, causal=causal, rotations=rot, return_lse=True)
    o, lse = fastattn.lsh_attention(qk, val, **kw)
    ro, rl = ref.lsh_attention(qk, val, **kw)
    assert_close(o, ro, F64)
    assert_close(lse, rl, F64, what="lse")
    # float32: the same buckets here (no near-ties in this draw), float32 accuracy
    o32 = fastattn.lsh_attention(qk.astype(F32), val.astype(F32), **dict(kw, return_lse=False))
    assert_close(o32, ro, F32)


def test_lsh_direct_numpy_rule(rng):
    """One round, chunked, against the rule written out token by token (not chunk-wise)."""
    L, ch, D = 48, 8, 6
    qk = randn(rng, (L, D), F64)
    val = randn(rng, (L, 3), F64)
    rot = rng.standard_normal((1, D, 2))
    proj = qk @ rot[0]
    bucket = np.argmax(np.concatenate([proj, -proj], axis=1), axis=1)
    order = sorted(range(L), key=lambda i: (bucket[i], i))
    chunk_of = {tok: slot // ch for slot, tok in enumerate(order)}
    nc = L // ch
    khat = qk / np.linalg.norm(qk, axis=1, keepdims=True)
    expect = np.zeros((L, 3))
    for i in range(L):
        c = chunk_of[i]
        keys = [j for j in range(L) if chunk_of[j] in (c, (c - 1) % nc)]
        s = np.array([-1e5 if j == i else qk[i] @ khat[j] / math.sqrt(D) for j in keys])
        p = np.exp(s - s.max())
        expect[i] = (p / p.sum()) @ val[keys]
    o = fastattn.lsh_attention(qk, val, n_buckets=4, chunk_size=ch, rotations=rot)
    assert_close(o, expect, F64)


def test_lsh_hand_worked_causal_first_token(rng):
    # Under causal, position 0 has no key but itself: its output is its own value.
    qk = randn(rng, (64, 8), F64)
    val = randn(rng, (64, 4), F64)
    o = fastattn.lsh_attention(qk, val, n_buckets=4, n_hashes=2, chunk_size=16, causal=True, seed=0)
    np.testing.assert_allclose(o[0], val[0], rtol=1e-9)  # round weights near -1e5: ulp 1.5e-11


def test_lsh_seed_rotations_threads(rng):
    qk = randn(rng, (3, 128, 16), F32)
    val = randn(rng, (3, 128, 16), F32)
    a = fastattn.lsh_attention(qk, val, n_buckets=8, n_hashes=2, chunk_size=32, seed=7, num_threads=1)
    rot = fastattn.lsh.lsh_rotations(7, 2, 16, 8)
    b = fastattn.lsh_attention(qk, val, n_buckets=8, n_hashes=2, chunk_size=32, rotations=rot, num_threads=2)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(rot, ref.lsh_rotations(7, 2, 16, 8))


@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize(
    "B,L,D,Dv,ch,nb,nh,causal",
    [
        (1, 256, 13, 5, 16, 6, 1, False),  # odd dims, 16 chunks, half = 3 (not a vector)
        (2, 192, 16, 33, 16, 34, 3, True),  # Dv > D and odd, half = 17
        (1, 384, 64, 64, 64, 256, 2, False),  # the benchmark's shape, 6 chunks
        (1, 320, 67, 9, 64, 8, 3, True),
        (1, 256, 24, 40, 128, 4, 2, True),  # a window of two tiles
        (2, 128, 7, 3, 128, 10, 1, False),  # one chunk of 128: one window, no second half
        (1, 96, 5, 7, 3, 4, 2, True),  # tiny chunks
    ],
)
def test_lsh_kernel_matches_reference(isa, rng, dtype, B, L, D, Dv, ch, nb, nh, causal):
    """The C path (every ISA) against the reference, over chunk sizes 3-128, 1-3 rounds,
    Dv != D, causal or not, batches."""
    qk = randn(rng, (B, L, D), dtype)
    val = randn(rng, (B, L, Dv), dtype)
    rot = rng.standard_normal((nh, D, nb // 2))
    kw = dict(n_buckets=nb, n_hashes=nh, chunk_size=ch, causal=causal, rotations=rot, return_lse=True)
    o, lse = fastattn.lsh_attention(qk, val, **kw)
    ro, rl = ref.lsh_attention(qk, val, **kw)  # the same float32 values, in float64
    assert o.dtype == dtype and lse.dtype == dtype
    assert_close(o, ro, dtype)
    assert_close(lse, rl, dtype, tol=1e-10 if dtype == F64 else 1e-6, what="lse")


def test_lsh_strided_inputs_and_batch_dims(rng):
    # Views with row strides (a head slice of a larger array) and two batch dims.
    big = randn(rng, (2, 3, 128, 40), F64)
    qk, val = big[..., 3:19], big[..., 20:27]
    kw = dict(n_buckets=8, n_hashes=2, chunk_size=32, causal=True, seed=3, return_lse=True)
    o, lse = fastattn.lsh_attention(qk, val, **kw)
    ro, rl = ref.lsh_attention(qk, val, **kw)
    assert o.shape == (2, 3, 128, 7) and lse.shape == (2, 3, 128)
    assert_close(o, ro, F64)
    assert_close(lse, rl, F64, what="lse")


def test_lsh_only_self_cases(isa, rng):
    """Rows that have no key but themselves: their output is their value, LSE -1e5
    (the self score).  A single token; causal with chunks of one token (a token
    sees its predecessor in the sorted order only when that one comes earlier);
    zero vectors (keys of norm 0 score 0)."""
    for dtype in (F32, F64):
        x = randn(rng, (1, 4), dtype)
        v = randn(rng, (1, 3), dtype)
        o, lse = fastattn.lsh_attention(x, v, n_buckets=2, chunk_size=1, seed=0, return_lse=True)
        np.testing.assert_allclose(o, v, rtol=1e-6)
        np.testing.assert_allclose(lse, [-1e5], rtol=1e-12)
        qk = randn(rng, (2, 48, 8), dtype)
        qk[:, 5] = 0
        val = randn(rng, (2, 48, 6), dtype)
        kw = dict(n_buckets=4, n_hashes=2, chunk_size=1, causal=True, seed=5, return_lse=True)
        o, lse = fastattn.lsh_attention(qk, val, **kw)
        ro, rl = ref.lsh_attention(qk, val, **kw)
        assert_close(o, ro, dtype)
        assert_close(lse, rl, dtype, tol=1e-10 if dtype == F64 else 1e-6, what="lse")
        np.testing.assert_allclose(o[:, 0], val[:, 0], rtol=1e-5)  # position 0 sees only itself
        assert np.all(lse[:, 0] < -9e4)


def test_lsh_nan_input_does_not_crash(isa, rng):
    # A NaN token hashes somewhere in range and poisons the rows that see it; no crash.
    qk = randn(rng, (256, 16), F32)
    val = randn(rng, (256, 8), F32)
    qk[17, 3] = np.nan
    o, lse = fastattn.lsh_attention(qk, val, n_buckets=8, chunk_size=32, seed=0, return_lse=True)
    assert np.isnan(o[17]).all() and np.isnan(lse[17])
    assert np.isfinite(o).all(axis=1).sum() >= 256 - 64  # only the NaN row's window is poisoned


@pytest.mark.parametrize("dtype", [F32, F64])
def test_lsh_threads_bit_identical(isa, rng, dtype):
    qk = randn(rng, (2, 1024, 32), dtype)
    val = randn(rng, (2, 1024, 24), dtype)
    for kw in (
        dict(n_buckets=16, n_hashes=3, chunk_size=32, causal=True),
        dict(n_buckets=64, n_hashes=2, chunk_size=128),
        dict(n_buckets=6, n_hashes=1, chunk_size=16),
    ):
        outs = [
            fastattn.lsh_attention(qk, val, seed=11, return_lse=True, num_threads=n, **kw) for n in (1, 2, 3)
        ]
        for o, lse in outs[1:]:
            np.testing.assert_array_equal(o, outs[0][0])
            np.testing.assert_array_equal(lse, outs[0][1])


def test_lsh_bad_input(rng):
    qk = randn(rng, (64, 8), F32)
    val = randn(rng, (64, 4), F32)
    f = fastattn.lsh_attention
    with pytest.raises(ValueError, match="n_buckets must be even"):
        f(qk, val, n_buckets=5)
    with pytest.raises(ValueError, match="multiple of chunk_size"):
        f(qk, val, n_buckets=4, chunk_size=48)
    with pytest.raises(ValueError, match="rotations must have shape"):
        f(qk, val, n_buckets=4, rotations=np.ones((1, 8, 3)))
    with pytest.raises(ValueError, match="seed or rotations"):
        f(qk, val, n_buckets=4, seed=1, rotations=np.ones((1, 8, 2)))
    with pytest.raises(TypeError, match="share a dtype"):
        f(qk, val.astype(F64), n_buckets=4)
    with pytest.raises(ValueError, match="batch dims and length"):
        f(qk, val[:32], n_buckets=4)
    with pytest.raises(TypeError, match="n_buckets"):
        f(qk, val, n_buckets=4.0)
    with pytest.raises(ValueError, match="chunk_size"):
        f(qk, val, n_buckets=4, chunk_size=0)
    with pytest.raises(TypeError, match="num_threads"):
        f(qk, val, n_buckets=4, num_threads=1.5)
    with pytest.raises(ValueError, match="n_buckets must be below"):
        f(qk, val, n_buckets=2**31)
    with pytest.raises(ValueError, match="num_threads"):
        f(qk, val, n_buckets=4, num_threads=fastattn._checks.MAX_THREADS + 1)


def test_lsh_long_sequence_memory(tmp_path):
    """L = 65536 runs in well under 200 MiB of extra memory (peak of NumPy allocations
    after the inputs exist, in a fresh interpreter)."""
    code = textwrap.dedent(
        """
        import tracemalloc, numpy as np, fastattn
        rng = np.random.default_rng(0)
        qk = rng.standard_normal((65536, 64), dtype=np.float32)
        val = rng.standard_normal((65536, 64), dtype=np.float32)
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        o = fastattn.lsh_attention(qk, val, n_buckets=64, n_hashes=2, chunk_size=64, seed=0)
        peak = tracemalloc.get_traced_memory()[1] - base
        assert np.isfinite(o).all()
        print(peak)
        """
    )
    # (run outside the checkout, so that the installed fastattn is the one imported)
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert r.returncode == 0, r.stderr
    peak = int(r.stdout.split()[-1])
    print(f"LSH L=65536 D=64 2 rounds: peak extra memory {peak / 2**20:.1f} MiB")
    assert peak < 100 * 2**20, f"peak extra memory {peak / 2**20:.1f} MiB"


# ------------------------------------------- threads: fork, thread start, rounding

# The additive and LSH drivers (csrc/family.c) share the dot-product driver's team
# and fork state: a team started by either extension makes a fork() child run every
# call on its calling thread (libgomp's pool does not survive fork: a child asking for
# a team waits for threads that do not exist).
FAMILY_FORK_CHILD = (
    """
import os, multiprocessing as mp
import numpy as np, fastattn
fastattn.set_isa({isa!r})
rng = np.random.default_rng(0)
x = rng.standard_normal((1024, 32)).astype(np.float32)
v = rng.standard_normal((1024, 24)).astype(np.float32)
q = rng.standard_normal((128, 32)).astype(np.float32)
w = rng.standard_normal((32, 32)).astype(np.float32)
qs = rng.standard_normal((1, 4, 256, 32)).astype(np.float32)
ks = rng.standard_normal((1, 4, 2048, 32)).astype(np.float32)

def family(_=None):
    return (fastattn.lsh_attention(x, v, n_buckets=16, n_hashes=2, chunk_size=32, seed=0, num_threads=2),
            fastattn.additive_attention(q, x[:128], v[:128], w, w, w[0], num_threads=2))

def sdpa(_=None):
    return (fastattn.scaled_dot_product_attention(qs, ks, ks, num_threads=2),)

def both(_=None):
    return family() + sdpa()

{first_call}  # the parent's first thread team comes from this call
want = want_f + want_s
"""
    + """
pid = os.fork()
if pid == 0:
    got = both()
    os._exit(0 if all(np.array_equal(a, b) for a, b in zip(got, want)) else 3)
_, status = os.waitpid(pid, 0)
assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
with mp.get_context("fork").Pool(2) as pool:
    for got in pool.map(both, range(4)):
        assert all(np.array_equal(a, b) for a, b in zip(got, want))
assert all(np.array_equal(a, b) for a, b in zip(both(), want))  # the parent keeps its threads
print("ok")
"""
)


def _run_child(code: str, timeout: float = 180, env: dict[str, str] | None = None) -> str:
    """Run code in a fresh interpreter (this checkout's fastattn); a hang, a signal or a
    non-zero exit fails the test instead of the pytest run."""
    e = dict(os.environ)
    e.update(env or {})
    try:
        r = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=e,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(fastattn.__file__))),
        )
    except subprocess.TimeoutExpired as t:
        pytest.fail(f"child timed out after {timeout} s (a hang); output:\n{t.stdout}\n{t.stderr}")
    assert r.returncode == 0, f"child exited with {r.returncode}:\n{r.stdout}\n{r.stderr[-4000:]}"
    return r.stdout


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
@pytest.mark.skipif(not fastattn._kernels.openmp_enabled(), reason="no OpenMP")
@pytest.mark.parametrize("first", ["family", "sdpa"])
def test_family_fork_after_threaded_use(first):
    """The parent's first team comes from the family drivers (then the child's
    dot-product calls must know it) or from the dot-product driver (then the child's
    LSH and additive calls must): either way the child runs and gets the same results."""
    first_call = {"family": "want_f, want_s = family(), sdpa()", "sdpa": "want_s = sdpa(); want_f = family()"}
    code = FAMILY_FORK_CHILD.format(isa=fastattn.get_isa(), first_call=first_call[first])
    assert "ok" in _run_child(code)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
@pytest.mark.skipif(not fastattn._kernels.openmp_enabled(), reason="no OpenMP")
def test_family_fork_child_of_a_dot_product_team_runs_lsh():
    # The parent ran only a dot-product team; the child's first calls are LSH and additive.
    code = textwrap.dedent(
        """
        import os, numpy as np, fastattn
        rng = np.random.default_rng(0)
        qs = rng.standard_normal((1, 4, 256, 32)).astype(np.float32)
        x = rng.standard_normal((1024, 32)).astype(np.float32)
        fastattn.scaled_dot_product_attention(qs, qs, qs, num_threads=2)
        pid = os.fork()
        if pid == 0:
            o = fastattn.lsh_attention(x, x, n_buckets=16, chunk_size=32, seed=0, num_threads=2)
            a = fastattn.additive_attention(x[:128], x[:128], x[:128], x[:32, :32].T, x[:32, :32].T,
                                            x[0], num_threads=2)
            os._exit(0 if np.isfinite(o).all() and np.isfinite(a).all() else 3)
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
        print("ok")
        """
    )
    assert "ok" in _run_child(code)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses RLIMIT_AS")
@pytest.mark.skipif(not fastattn._kernels.openmp_enabled(), reason="no OpenMP")
def test_family_thread_start_failure_is_an_error():
    # With little address space left, thread stacks cannot be mapped: libgomp would
    # exit(1); the LSH and additive drivers must raise and stay usable.
    code = textwrap.dedent(
        """
        import resource, numpy as np, fastattn
        rng = np.random.default_rng(0)
        # (at least 64 tasks each, so that a call asks for a team of 64)
        x = rng.standard_normal((16384, 16)).astype(np.float32)
        w = rng.standard_normal((16, 16)).astype(np.float32)
        lsh = lambda n: fastattn.lsh_attention(x, x, n_buckets=16, chunk_size=32, seed=0, num_threads=n)
        add = lambda n: fastattn.additive_attention(x[:2048], x[:256], x[:256], w, w, w[0], num_threads=n)
        ref = lsh(1), add(1)
        with open("/proc/self/status") as f:
            vm = [int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:")][0]
        resource.setrlimit(resource.RLIMIT_AS, (vm + (96 << 20), resource.RLIM_INFINITY))
        for fn in (lsh, add):
            try:
                fn(64)
            except RuntimeError as e:
                assert "num_threads=64" in str(e), e
                print("raised")
            else:
                print("ran")  # the OS gave us the threads after all: also fine
        assert np.array_equal(lsh(1), ref[0]) and np.array_equal(add(1), ref[1])
        print("ok")
        """
    )
    assert "ok" in _run_child(code, env={"OMP_STACKSIZE": "16M"})


_FE = {"downward": 0x400, "upward": 0x800, "towardzero": 0xC00}  # x86 <fenv.h>


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86 fenv values")
def test_family_bit_identical_under_rounding_modes(isa, rng):
    """Every thread of the family drivers computes in round-to-nearest (the caller's
    mode is set for the call and restored): the results do not depend on the caller's
    rounding mode or on the thread count.  (The LSH case is C from end to end: float64
    inputs and rotations given, so no NumPy arithmetic runs in the caller's mode.)"""
    from fastattn import _family

    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    qk = randn(rng, (1024, 32), F64)
    val = randn(rng, (1024, 16), F64)
    qk32, val32 = qk.astype(F32), val.astype(F32)
    rot = rng.standard_normal((2, 32, 8))
    lse = np.empty((1, 1024))

    def run(nt: int) -> list[np.ndarray]:
        res = []
        for x, v in ((qk, val), (qk32, val32)):
            out = np.zeros((1, 1024, v.shape[1]), x.dtype)
            lse.fill(0)
            _family.lsh(x[None], v[None], rot.astype(x.dtype), out, lse, 16, 2, 32, True, 0.2, isa, nt)
            res += [out.copy(), lse.copy()]
        return res

    want = run(1)
    for mode in _FE.values():
        assert libm.fesetround(mode) == 0
        try:
            got = [run(nt) for nt in (1, 2, 3)]
        finally:
            libm.fesetround(0)
        for per_nt in got:
            for a, b in zip(per_nt, want):
                np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------- positions


def test_sinusoidal_positions():
    pe = fastattn.sinusoidal_positions(50, 13)
    assert pe.shape == (50, 13) and pe.dtype == F32
    assert_close(pe, ref.sinusoidal_positions(50, 13), F32)
    pe64 = fastattn.sinusoidal_positions(4, 6, base=100.0, dtype=np.float64)
    np.testing.assert_allclose(pe64[0], [0, 1, 0, 1, 0, 1], atol=0)
    np.testing.assert_allclose(pe64[1, :2], [math.sin(1), math.cos(1)], rtol=1e-15)
    np.testing.assert_allclose(
        pe64[3, 2:4], [math.sin(3 / 100 ** (2 / 6)), math.cos(3 / 100 ** (2 / 6))], rtol=1e-14
    )
    with pytest.raises(ValueError, match="dim"):
        fastattn.sinusoidal_positions(4, 0)
    with pytest.raises(ValueError, match="base"):
        fastattn.sinusoidal_positions(4, 4, base=-1.0)


def test_rotary_tables():
    c, s = fastattn.rotary_cos_sin(33, 10, base=500.0, dtype=np.float64)
    rc, rs = ref.rotary_cos_sin(33, 10, base=500.0)
    np.testing.assert_allclose(c, rc, rtol=0, atol=1e-15)
    np.testing.assert_allclose(s, rs, rtol=0, atol=1e-15)
    np.testing.assert_allclose(c[5, 1], math.cos(5 * 500.0 ** (-2 / 10)), rtol=1e-15)
    with pytest.raises(ValueError, match="rotary_dim must be even"):
        fastattn.rotary_cos_sin(8, 7)


@pytest.mark.parametrize("dtype", [F32, F64, np.dtype(np.float16), BF16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_apply_rotary_matches_reference(rng, dtype, interleaved, layout):
    c, s = fastattn.rotary_cos_sin(64, 16)
    shape = (2, 3, 40, 24) if layout == "bhsd" else (2, 40, 3, 24)
    x = randn(rng, shape, dtype)
    x0 = x.copy()
    pos = rng.integers(0, 64, (2, 40))
    for p in (None, pos):
        o = fastattn.apply_rotary(x, c, s, positions=p, interleaved=interleaved, layout=layout)
        r = ref.apply_rotary(x, c, s, positions=p, interleaved=interleaved, layout=layout)
        assert o.dtype == dtype and o.shape == x.shape
        tol = 1e-5 if dtype in (F32, F64) else (2e-3 if dtype == np.float16 else 1.6e-2)
        assert_close(o, r, tol=tol)
        np.testing.assert_array_equal(o[..., 16:], x[..., 16:])  # features past rotary_dim pass through
    np.testing.assert_array_equal(x, x0)


def test_apply_rotary_hand_worked_and_interleaved_relation(rng):
    c, s = fastattn.rotary_cos_sin(8, 2, dtype=np.float64)  # theta_0 = 1: angle = position
    x = np.tile(np.array([1.0, 0.0]), (8, 1))
    o = fastattn.apply_rotary(x, c, s)
    np.testing.assert_allclose(o, np.stack([np.cos(np.arange(8)), np.sin(np.arange(8))], 1), atol=1e-15)
    # GPT-J pairs are NeoX halves after moving even features first.
    c, s = fastattn.rotary_cos_sin(16, 8, dtype=np.float64)
    x = randn(rng, (2, 16, 10), F64)
    perm = np.r_[0:8:2, 1:8:2, 8:10]
    inv = np.argsort(perm)
    gptj = fastattn.apply_rotary(x, c, s, interleaved=True)
    neox = fastattn.apply_rotary(x[..., perm], c, s)[..., inv]
    np.testing.assert_allclose(gptj, neox, rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_relative_position_property(rng, interleaved):
    """q.k after rotation at positions m and n depends only on m - n."""
    c, s = fastattn.rotary_cos_sin(200, 32, dtype=np.float64)
    q = randn(rng, (32,), F64)
    k = randn(rng, (32,), F64)

    def score(m, n):
        qr = fastattn.apply_rotary(q[None], c, s, positions=[m], interleaved=interleaved)[0]
        kr = fastattn.apply_rotary(k[None], c, s, positions=[n], interleaved=interleaved)[0]
        return qr @ kr

    for d in (0, 3, -7, 50):
        vals = [score(m, m - d) for m in (60, 61, 99, 150)]
        np.testing.assert_allclose(vals, vals[0], rtol=1e-12, atol=1e-12)
    assert abs(score(60, 57) - score(60, 50)) > 1e-6  # and it does depend on m - n


def test_apply_rotary_bad_input(rng):
    c, s = fastattn.rotary_cos_sin(16, 8)
    x = randn(rng, (1, 2, 16, 8), F32)
    with pytest.raises(ValueError, match="positions"):
        fastattn.apply_rotary(x, c[:10], s[:10])
    with pytest.raises(ValueError, match="positions"):
        fastattn.apply_rotary(x, c, s, positions=np.full(16, 16))
    with pytest.raises(ValueError, match=">= 0"):
        fastattn.apply_rotary(x, c, s, positions=np.full(16, -1))
    with pytest.raises(ValueError, match="exceeds the head dim"):
        fastattn.apply_rotary(x[..., :6], c, s)
    with pytest.raises(ValueError, match="same shape"):
        fastattn.apply_rotary(x, c, s[:, :2])
    with pytest.raises(TypeError, match="positions"):
        fastattn.apply_rotary(x, c, s, positions=np.zeros(16))
    with pytest.raises(ValueError, match="layout"):
        fastattn.apply_rotary(x, c, s, layout="sbhd")


def _ref_kvcache_rotary(q, kc, vc, seq, kn, vn, c, s, interleaved, causal=True):
    """The cache path written out: rotate with the reference, write, attend with the reference."""
    kc, vc = kc.astype(F64), vc.astype(F64)
    B, T = kn.shape[0], kn.shape[2]
    Lq = q.shape[2]
    kpos = seq[:, None] + np.arange(T)
    qpos = seq[:, None] + np.arange(Lq) if causal else np.broadcast_to(seq[:, None], (B, Lq))
    kr = ref.apply_rotary(kn, c, s, positions=kpos, interleaved=interleaved)
    qr = ref.apply_rotary(q, c, s, positions=qpos, interleaved=interleaved)
    for b in range(B):
        kc[b, :, seq[b] : seq[b] + T] = kr[b]
        vc[b, :, seq[b] : seq[b] + T] = vn[b]
    o = ref.scaled_dot_product_attention(qr, kc, vc, is_causal=causal, enable_gqa=True, key_lengths=seq + T)
    return o, kr


@pytest.mark.parametrize("cache_dtype", [F32, np.dtype(np.float16), F64])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("causal", [True, False])
def test_kvcache_fused_rotary(rng, cache_dtype, interleaved, causal):
    B, Hq, Hk, S, D, T = 2, 4, 2, 40, 16, 3
    qdt = F64 if cache_dtype == F64 else F32
    kc = randn(rng, (B, Hk, S, D), cache_dtype)
    vc = randn(rng, (B, Hk, S, D), cache_dtype)
    seq = np.array([5, 17])
    q = randn(rng, (B, Hq, T, D), qdt)
    kn = randn(rng, (B, Hk, T, D), qdt)
    vn = randn(rng, (B, Hk, T, D), qdt)
    c, s = fastattn.rotary_cos_sin(32, 12, dtype=qdt)
    ro, kr = _ref_kvcache_rotary(q, kc, vc, seq, kn, vn, c, s, interleaved, causal)
    q0, kn0 = q.copy(), kn.copy()
    o = fastattn.attention_with_kvcache(
        q, kc, vc, seq, kn, vn, is_causal=causal, rotary_cos=c, rotary_sin=s, rotary_interleaved=interleaved
    )
    tol = 1e-4 if qdt == F32 else 1e-10
    if cache_dtype == np.float16:
        tol = 2e-3
    assert_close(o, ro, tol=tol)
    np.testing.assert_array_equal(q, q0)
    np.testing.assert_array_equal(kn, kn0)
    # The keys in the cache are exactly what apply_rotary gives (same C routine), in the cache dtype.
    sep = fastattn.apply_rotary(kn, c, s, positions=seq[:, None] + np.arange(T), interleaved=interleaved)
    for b in range(B):
        np.testing.assert_array_equal(kc[b, :, seq[b] : seq[b] + T], sep[b].astype(cache_dtype))
    # bshd layout gives the same
    kc2 = randn(rng, (B, S, Hk, D), cache_dtype)
    vc2 = randn(rng, (B, S, Hk, D), cache_dtype)
    kc2b, vc2b = np.swapaxes(kc2, 1, 2).copy(), np.swapaxes(vc2, 1, 2).copy()
    o2 = fastattn.attention_with_kvcache(
        np.swapaxes(q, 1, 2),
        kc2,
        vc2,
        seq,
        np.swapaxes(kn, 1, 2),
        np.swapaxes(vn, 1, 2),
        is_causal=causal,
        rotary_cos=c,
        rotary_sin=s,
        rotary_interleaved=interleaved,
        layout="bshd",
    )
    ro2, _ = _ref_kvcache_rotary(q, kc2b, vc2b, seq, kn, vn, c, s, interleaved, causal)
    assert_close(np.swapaxes(o2, 1, 2), ro2, tol=tol)


def test_kvcache_rotary_bad_input_leaves_cache(rng):
    kc = np.zeros((1, 1, 16, 8), F32)
    vc = np.zeros((1, 1, 16, 8), F32)
    q = randn(rng, (1, 1, 1, 8), F32)
    kn = randn(rng, (1, 1, 1, 8), F32)
    c, s = fastattn.rotary_cos_sin(10, 8)
    awk = fastattn.attention_with_kvcache
    with pytest.raises(ValueError, match="positions"):
        awk(q, kc, vc, 12, kn, kn, rotary_cos=c, rotary_sin=s)
    assert not kc.any() and not vc.any()
    with pytest.raises(ValueError, match="need k_new"):
        awk(q, kc, vc, 3, rotary_cos=c, rotary_sin=s)
    with pytest.raises(ValueError, match="together"):
        awk(q, kc, vc, 3, kn, kn, rotary_cos=c)
    with pytest.raises(TypeError, match="rotary_interleaved"):
        awk(q, kc, vc, 3, kn, kn, rotary_cos=c, rotary_sin=s, rotary_interleaved=1)
    with pytest.raises(ValueError, match="exceeds the head dim"):
        c10, s10 = fastattn.rotary_cos_sin(10, 10)
        awk(q, kc, vc, 3, kn, kn, rotary_cos=c10, rotary_sin=s10)
    assert not kc.any() and not vc.any()


@pytest.mark.parametrize("interleaved", [False, True])
def test_kvcache_class_rotary_decode(rng, interleaved):
    """Prompt then token-by-token decode with a rotary KVCache equals full causal attention
    over the reference-rotated sequence at every step."""
    B, Hq, Hk, D, P, N = 2, 4, 2, 16, 5, 4
    c, s = fastattn.rotary_cos_sin(64, 16)
    cache = fastattn.KVCache(
        B, Hk, 32, D, dtype=np.float32, rotary_cos=c, rotary_sin=s, rotary_interleaved=interleaved
    )
    q = randn(rng, (B, Hq, P + N, D), F32)
    k = randn(rng, (B, Hk, P + N, D), F32)
    v = randn(rng, (B, Hk, P + N, D), F32)
    qr = ref.apply_rotary(q, c, s, interleaved=interleaved)
    kr = ref.apply_rotary(k, c, s, interleaved=interleaved)
    cache.append(k[:, :, :P], v[:, :, :P])
    o = cache.attend(q[:, :, :P])
    assert_close(
        o,
        ref.scaled_dot_product_attention(
            qr[:, :, :P], kr[:, :, :P], v[:, :, :P], is_causal=True, enable_gqa=True
        ),
        F32,
    )
    for t in range(P, P + N):
        cache.append(k[:, :, t : t + 1], v[:, :, t : t + 1])
        o = cache.attend(q[:, :, t : t + 1])
        expect = ref.scaled_dot_product_attention(
            qr[:, :, t : t + 1], kr[:, :, : t + 1], v[:, :, : t + 1], is_causal=True, enable_gqa=True
        )
        assert_close(o, expect, F32)
    # ragged: one sequence advances alone
    cache.append(k[1:, :, :1], v[1:, :, :1], batch_index=1)
    assert cache.lengths.tolist() == [P + N, P + N + 1]
    with pytest.raises(ValueError, match="positions"):
        fastattn.KVCache(1, 1, 80, D, rotary_cos=c, rotary_sin=s).append(
            np.zeros((1, 1, 70, D), F32), np.zeros((1, 1, 70, D), F32)
        )


# ------------------------------------------------------------------ weights


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(is_causal=True),
        dict(
            is_causal=True, enable_gqa=True, window=(7, -1), alibi_slopes=np.linspace(0.1, 1, 4), softcap=5.0
        ),
        dict(sinks=np.ones(4), key_lengths=np.array([45, 20])),
        dict(attn_mask="bool"),
        dict(attn_mask="float", scale=0.3),
        dict(block_mask="yes", block_size=(8, 16)),
    ],
)
def test_attention_weights_match_reference(rng, kw):
    kw = dict(kw)
    q = randn(rng, (2, 4, 30, 16), F32)
    Hk = 2 if kw.get("enable_gqa") else 4
    k = randn(rng, (2, Hk, 45, 16), F32)
    v = randn(rng, (2, Hk, 45, 8), F32)
    if kw.get("attn_mask") == "bool":
        kw["attn_mask"] = rng.random((30, 45)) > 0.3
        kw["attn_mask"][3] = False
    elif kw.get("attn_mask") == "float":
        kw["attn_mask"] = randn(rng, (4, 30, 45), F32)
    if kw.get("block_mask") is not None:
        kw["block_mask"] = rng.random((4, 4, 3)) > 0.4
    rows = np.array([0, 5, 29, 3])
    for r in (None, rows):
        w = fastattn.attention_weights(q, k, rows=r, **kw)
        rw = ref.attention_weights(q, k, rows=r, **kw)
        assert w.dtype == F32 and w.shape == rw.shape
        assert_close(w, rw, F32, what="weights")
    # the weights that produced the output
    w = fastattn.attention_weights(q, k, **kw)
    o = fastattn.scaled_dot_product_attention(q, k, v, **kw)
    G = 4 // Hk
    assert_close(w @ np.repeat(v, G, axis=1).astype(F64), o, F32)


def test_attention_weights_bshd_2d_and_bad_rows(rng):
    q = randn(rng, (1, 12, 2, 8), F64)
    k = randn(rng, (1, 20, 2, 8), F64)
    w = fastattn.attention_weights(q, k, layout="bshd", is_causal=True)
    assert w.shape == (1, 2, 12, 20) and w.dtype == F64
    assert_close(w, ref.attention_weights(q, k, layout="bshd", is_causal=True), F64)
    np.testing.assert_allclose(w.sum(-1), 1, rtol=1e-12)
    w2 = fastattn.attention_weights(q[0, :, 0], k[0, :, 0])
    assert w2.shape == (1, 12, 20)
    with pytest.raises(ValueError, match="rows"):
        fastattn.attention_weights(q[0, :, 0], k[0, :, 0], rows=[12])
    with pytest.raises(TypeError, match="rows"):
        fastattn.attention_weights(q[0, :, 0], k[0, :, 0], rows=[1.0])


def test_plot_attention_weights(rng):
    mpl = optional("matplotlib")
    mpl.use("Agg")
    import matplotlib.pyplot as plt

    q = randn(rng, (3, 10, 8), F32)
    k = randn(rng, (3, 12, 8), F32)
    w = fastattn.attention_weights(q, k, is_causal=True)
    fig = fastattn.plot_attention_weights(w)  # grid of three heads
    assert len([a for a in fig.axes if a.images]) == 3
    fig2 = fastattn.plot_attention_weights(w[1], titles="head 1")
    assert fig2.axes[0].images
    fig3 = fastattn.plot_attention_weights(w, heads=[2], ncols=2)
    assert len([a for a in fig3.axes if a.images]) == 1
    with pytest.raises(ValueError, match="heads"):
        fastattn.plot_attention_weights(w, heads=[5])
    for f in (fig, fig2, fig3):
        plt.close(f)


def test_family_exports():
    for name in (
        "additive_attention",
        "lsh_attention",
        "sinusoidal_positions",
        "rotary_cos_sin",
        "apply_rotary",
        "attention_weights",
        "plot_attention_weights",
    ):
        assert name in fastattn.__all__ and callable(getattr(fastattn, name))
    assert os.path.basename(fastattn.reference.__file__) == "reference.py"


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("interleaved", [None, False])  # None: flash-attn's default (True, GPT-J pairs)
@pytest.mark.parametrize("cache_batch_idx", [None, [2, 0]])
def test_flash_compat_with_kvcache_rotary(rng, causal, interleaved, cache_batch_idx):
    fc = optional("fastattn.flash_compat")
    B, Bc, Hq, Hk, S, D, T = 2, 3, 4, 2, 24, 16, 2
    kc = randn(rng, (Bc, S, Hk, D), np.float16)
    vc = randn(rng, (Bc, S, Hk, D), np.float16)
    q = randn(rng, (B, T, Hq, D), F32)
    k = randn(rng, (B, T, Hk, D), F32)
    v = randn(rng, (B, T, Hk, D), F32)
    seq = np.array([3, 9])
    c, s = fastattn.rotary_cos_sin(S, 8)
    rows = [0, 1] if cache_batch_idx is None else cache_batch_idx
    bh = [np.swapaxes(kc[rows], 1, 2), np.swapaxes(vc[rows], 1, 2)]
    il = True if interleaved is None else interleaved
    ro, _ = _ref_kvcache_rotary(
        np.swapaxes(q, 1, 2), bh[0], bh[1], seq, np.swapaxes(k, 1, 2), np.swapaxes(v, 1, 2), c, s, il, causal
    )
    kw = dict(rotary_cos=c, rotary_sin=s, cache_seqlens=seq, causal=causal)
    if interleaved is not None:
        kw["rotary_interleaved"] = interleaved
    if cache_batch_idx is not None:
        kw["cache_batch_idx"] = np.array(cache_batch_idx)
    out = fc.flash_attn_with_kvcache(q, kc, vc, k, v, **kw)
    assert_close(np.swapaxes(out, 1, 2), ro, tol=2e-3)
    sep = fastattn.apply_rotary(k, c, s, positions=seq[:, None] + np.arange(T), interleaved=il, layout="bshd")
    for b, r in enumerate(rows):
        np.testing.assert_array_equal(kc[r, seq[b] : seq[b] + T], sep[b].astype(np.float16))
