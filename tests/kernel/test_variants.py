"""Attention variants against the float64 reference: sliding window, ALiBi,
softcap, sinks, key/query lengths, block-sparse masks (and fastattn.sparse
patterns), varlen; alone, combined with each other, with masks, GQA, both
layouts, float32 and float64, causal; and the argument checks."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from conftest import assert_close, check_sdpa, randn
from hypothesis import given, settings
from hypothesis import strategies as st

import fastattn
from fastattn import reference as ref
from fastattn import sparse

sdpa = fastattn.scaled_dot_product_attention
DTYPES = [np.float32, np.float64]
# Odd lengths around the kernel tiles (48/96 query rows, 64/128 keys).
LS = [(1, 1), (1, 17), (17, 97), (97, 127), (128, 129), (129, 47)]


def qkv(rng, B, Hq, L, S, D=16, Dv=None, Hk=None, dtype=np.float32, layout="bhsd"):
    Hk = Hq if Hk is None else Hk
    Dv = D if Dv is None else Dv
    if layout == "bhsd":
        shapes = (B, Hq, L, D), (B, Hk, S, D), (B, Hk, S, Dv)
    else:
        shapes = (B, L, Hq, D), (B, S, Hk, D), (B, S, Hk, Dv)
    return tuple(randn(rng, s, dtype) for s in shapes)


def alibi(Hq):
    return 2.0 ** (-8.0 * np.arange(1, Hq + 1) / Hq)


# --- each variant alone -----------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("L,S", LS)
@pytest.mark.parametrize("window", [(0, 0), (5, 3), (70, -1), (-1, 9)])
def test_window(rng, dtype, L, S, window):
    q, k, v = qkv(rng, 1, 2, L, S, dtype=dtype)
    check_sdpa(q, k, v, window=window)


@pytest.mark.parametrize("L,S", [(17, 97), (97, 127), (128, 129), (129, 47)])
@pytest.mark.parametrize("window", [(3, 0), (64, 0), (100, 7)])
def test_window_causal(rng, isa, L, S, window):
    q, k, v = qkv(rng, 2, 2, L, S)
    check_sdpa(q, k, v, window=window, is_causal=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_window_large_equals_no_window(rng, dtype):
    q, k, v = qkv(rng, 2, 3, 97, 130, dtype=dtype)
    for causal in (False, True):
        a = sdpa(q, k, v, is_causal=causal)
        b = sdpa(q, k, v, is_causal=causal, window=(10**6, 10**6))
        c = sdpa(q, k, v, is_causal=causal, window=(-1, -1))
        assert_close(b, a, dtype)
        assert_close(c, a, dtype)


def test_window_equals_band_mask(rng):
    L, S = 97, 130
    q, k, v = qkv(rng, 1, 2, L, S)
    ip = np.arange(L)[:, None] + (S - L)
    j = np.arange(S)[None, :]
    band = (j >= ip - 7) & (j <= ip + 4)
    assert_close(sdpa(q, k, v, window=(7, 4)), ref.scaled_dot_product_attention(q, k, v, attn_mask=band))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("L,S", [(1, 17), (17, 97), (97, 127), (128, 129)])
@pytest.mark.parametrize("batched_slopes", [False, True])
def test_alibi(rng, dtype, L, S, batched_slopes):
    B, Hq = 2, 4
    q, k, v = qkv(rng, B, Hq, L, S, dtype=dtype)
    slopes = alibi(Hq)
    if batched_slopes:
        slopes = np.stack([slopes, slopes[::-1] * 0.5])
    check_sdpa(q, k, v, alibi_slopes=slopes)
    check_sdpa(q, k, v, alibi_slopes=slopes, is_causal=True)


def test_alibi_zero_slopes_equals_plain(rng):
    q, k, v = qkv(rng, 1, 3, 40, 70)
    assert_close(sdpa(q, k, v, alibi_slopes=np.zeros(3)), sdpa(q, k, v), np.float32)


def test_alibi_by_hand():
    # One query, two keys, equal scores: weights are softmax(-slope * |i' - j|) = softmax([-m, 0]).
    q = np.zeros((1, 1, 1, 4), np.float64)
    k = np.zeros((1, 1, 2, 4), np.float64)
    v = np.array([[[[1.0], [0.0]]]])
    m = 0.7
    o = sdpa(q, k, v, alibi_slopes=[m])
    expected = np.exp(-m) / (np.exp(-m) + 1.0)
    assert abs(o[0, 0, 0, 0] - expected) < 1e-12


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cap", [0.5, 5.0, 50.0])
@pytest.mark.parametrize("L,S", [(17, 97), (129, 47)])
def test_softcap(rng, dtype, cap, L, S):
    q, k, v = qkv(rng, 1, 2, L, S, dtype=dtype)
    q = q * 4  # large scores so that the cap matters
    check_sdpa(q, k, v, softcap=cap)
    check_sdpa(q, k, v, softcap=cap, is_causal=True)


def test_softcap_bounds_scores(rng):
    # With a tiny cap every score lies in (-c, c): the weights are near uniform.
    q, k, v = qkv(rng, 1, 1, 8, 50, dtype=np.float64)
    o = sdpa(q * 100, k, v, softcap=1e-6)
    assert_close(o, np.broadcast_to(v.mean(axis=-2, keepdims=True), o.shape), tol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("L,S", [(1, 1), (17, 97), (97, 127), (128, 129)])
def test_sinks(rng, dtype, L, S):
    Hq = 3
    q, k, v = qkv(rng, 2, Hq, L, S, dtype=dtype)
    sinks = np.array([-1.0, 0.5, 3.0])
    check_sdpa(q, k, v, sinks=sinks)
    check_sdpa(q, k, v, sinks=sinks, is_causal=True)


def test_sinks_by_hand():
    # Scores 0 for two keys, sink logit s: weights 1/(2 + e^s) each.
    q = np.zeros((1, 1, 1, 2))
    k = np.zeros((1, 1, 2, 2))
    v = np.array([[[[2.0], [4.0]]]])
    s = 1.3
    o, lse = sdpa(q, k, v, sinks=[s], return_lse=True)
    assert abs(o[0, 0, 0, 0] - 6.0 / (2.0 + np.exp(s))) < 1e-12
    assert abs(lse[0, 0, 0] - np.log(2.0 + np.exp(s))) < 1e-12


@pytest.mark.parametrize("dtype", DTYPES)
def test_sinks_fully_masked_rows(rng, dtype):
    L, S = 20, 70
    q, k, v = qkv(rng, 1, 2, L, S, dtype=dtype)
    mask = rng.random((L, S)) < 0.5
    mask[3] = False
    mask[L - 1] = False
    o, _ = check_sdpa(q, k, v, attn_mask=mask, sinks=[0.0, 2.0])
    assert np.all(o[..., 3, :] == 0) and np.all(o[..., L - 1, :] == 0)
    check_sdpa(q, k, v, key_lengths=np.array([0]), sinks=[0.0, 2.0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("L,S", [(17, 97), (97, 127), (128, 129), (129, 47)])
def test_key_lengths_equal_bool_mask(rng, dtype, L, S):
    B = 4
    q, k, v = qkv(rng, B, 2, L, S, dtype=dtype)
    kl = np.array([S, 1, 0, S // 2 + 1])
    mask = (np.arange(S)[None, :] < kl[:, None])[:, None, None, :]
    o, lse = check_sdpa(q, k, v, key_lengths=kl)
    om, lsem = sdpa(q, k, v, attn_mask=mask, return_lse=True)
    assert_close(o, om, dtype)
    assert_close(lse, lsem, dtype, what="lse")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("L,S", [(17, 97), (97, 127), (128, 129), (129, 47)])
def test_query_and_key_lengths(rng, dtype, L, S):
    B = 3
    q, k, v = qkv(rng, B, 2, L, S, dtype=dtype)
    ql = np.array([L, 1, L // 2])
    kl = np.array([S // 3 + 1, S, S])
    o, lse = check_sdpa(q, k, v, query_lengths=ql)
    assert np.all(o[1, :, 1:] == 0) and np.all(np.isneginf(lse[1, :, 1:]))
    check_sdpa(q, k, v, query_lengths=ql, key_lengths=kl)
    check_sdpa(q, k, v, query_lengths=ql, key_lengths=kl, is_causal=True)


def test_lengths_causal_equals_cropped(rng):
    # Causal alignment uses the valid lengths: one batch element with lengths (l, s)
    # equals plain causal attention on the cropped arrays.
    L, S = 60, 100
    q, k, v = qkv(rng, 2, 2, L, S, dtype=np.float64)
    ql, kl = np.array([45, L]), np.array([77, 90])
    o = sdpa(q, k, v, is_causal=True, query_lengths=ql, key_lengths=kl)
    for b in range(2):
        ob = sdpa(q[b, :, : ql[b]], k[b, :, : kl[b]], v[b, :, : kl[b]], is_causal=True)
        assert_close(o[b, :, : ql[b]], ob, np.float64)
        assert np.all(o[b, :, ql[b] :] == 0)


# --- block-sparse -------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("L,S", [(17, 97), (128, 129), (129, 47)])
@pytest.mark.parametrize("bs", [(1, 1), (48, 64), (50, 70), (200, 200)])
def test_block_mask_equals_dense(rng, dtype, L, S, bs):
    B, Hq = 2, 2
    q, k, v = qkv(rng, B, Hq, L, S, dtype=dtype)
    nbq, nbk = -(-L // bs[0]), -(-S // bs[1])
    bm = rng.random((B, Hq, nbq, nbk)) < 0.5
    bm[0, 0, 0] = False  # a query block with no key block
    o, lse = check_sdpa(q, k, v, block_mask=bm, block_size=bs)
    dense = sparse.to_dense(bm, bs, L, S)
    od, lsed = sdpa(q, k, v, attn_mask=dense, return_lse=True)
    assert_close(o, od, dtype)
    assert_close(lse, lsed, dtype, what="lse")


def test_block_mask_broadcasts(rng):
    L, S, bs = 100, 150, (32, 64)
    q, k, v = qkv(rng, 2, 3, L, S)
    bm = rng.random((-(-L // 32), -(-S // 64))) < 0.6
    check_sdpa(q, k, v, block_mask=bm, block_size=bs)
    check_sdpa(q, k, v, block_mask=bm[None, None], block_size=list(bs), is_causal=True)


# --- sparse patterns ----------------------------------------------------------


def test_strided_pattern_blocks():
    bm, bs = sparse.strided_pattern(8, 8, 16, stride=3)
    assert bs == (16, 16) and bm.shape == (1, 1)
    bm, _ = sparse.strided_pattern(16 * 8, 16 * 8, 16, stride=3)
    a, c = np.meshgrid(np.arange(8), np.arange(8), indexing="ij")
    expected = (a >= c) & ((a - c < 3) | ((a - c) % 3 == 0))
    np.testing.assert_array_equal(bm, expected)
    assert bm[7, 7] and bm[7, 5] and bm[7, 4] and not bm[7, 3] and bm[7, 1] and not bm[7, 0]
    local, _ = sparse.strided_pattern(128, 128, 16, 3, part="local")
    strided, _ = sparse.strided_pattern(128, 128, 16, 3, part="strided")
    np.testing.assert_array_equal(local | strided, bm)
    sym, _ = sparse.strided_pattern(128, 128, 16, 3, causal=False)
    np.testing.assert_array_equal(sym, sym.T)
    np.testing.assert_array_equal(np.tril(sym), bm)


def test_fixed_pattern_blocks():
    bm, _ = sparse.fixed_pattern(8 * 10, 8 * 10, 10, stride=4, num_summary=1)
    a, c = np.meshgrid(np.arange(8), np.arange(8), indexing="ij")
    expected = (c <= a) & ((c // 4 == a // 4) | (c % 4 == 3))
    np.testing.assert_array_equal(bm, expected)
    # Row 6 (window 1) sees block 3 (summary of window 0) and blocks 4..6 of its own window.
    assert list(np.flatnonzero(bm[6])) == [3, 4, 5, 6]
    bi, _ = sparse.fixed_pattern(80, 80, 10, stride=4, num_summary=2, causal=False)
    assert list(np.flatnonzero(bi[0])) == [0, 1, 2, 3, 6, 7]


def test_local_global_pattern_blocks():
    bm, _ = sparse.local_global_pattern(100, 100, 10, window=1, num_global=1)
    a, c = np.meshgrid(np.arange(10), np.arange(10), indexing="ij")
    expected = (np.abs(a - c) <= 1) | (c == 0) | (a == 0)
    np.testing.assert_array_equal(bm, expected)
    cm, _ = sparse.local_global_pattern(100, 100, 10, window=1, num_global=1, causal=True)
    np.testing.assert_array_equal(cm, expected & (c <= a))
    r1, _ = sparse.local_global_pattern(100, 100, 10, window=1, num_random=2, seed=3)
    r2, _ = sparse.local_global_pattern(100, 100, 10, window=1, num_random=2, seed=3)
    np.testing.assert_array_equal(r1, r2)
    assert np.all(r1 >= expected) and np.all((r1 & ~expected).sum(axis=1)[1:] == 2)


def test_pattern_kv_cache_alignment():
    # S - L = 2 blocks: query block a sits on key block a + 2.
    bm, _ = sparse.local_global_pattern(30, 50, 10, window=0, num_global=0, causal=True)
    np.testing.assert_array_equal(bm, np.eye(3, 5, 2, dtype=bool))
    with pytest.raises(ValueError, match="block"):
        sparse.strided_pattern(30, 55, 10, stride=2)


@pytest.mark.parametrize("maker", ["strided", "fixed", "local_global"])
@pytest.mark.parametrize("L,S,block", [(97, 97, 16), (128, 192, 64), (130, 130, 48)])
def test_patterns_in_attention(rng, maker, L, S, block):
    if maker == "strided":
        bm, bs = sparse.strided_pattern(L, S, block, stride=2)
    elif maker == "fixed":
        bm, bs = sparse.fixed_pattern(L, S, block, stride=2)
    else:
        bm, bs = sparse.local_global_pattern(L, S, block, window=1, causal=True)
    q, k, v = qkv(rng, 1, 2, L, S)
    o = sdpa(q, k, v, block_mask=bm, block_size=bs, is_causal=True)
    dense = sparse.to_dense(bm, bs, L, S)
    assert_close(o, ref.scaled_dot_product_attention(q, k, v, attn_mask=dense, is_causal=True), np.float32)


def test_pattern_argument_errors():
    with pytest.raises(TypeError, match="stride"):
        sparse.strided_pattern(10, 10, 2, stride=1.5)
    with pytest.raises(ValueError, match="stride"):
        sparse.strided_pattern(10, 10, 2, stride=0)
    with pytest.raises(ValueError, match="block"):
        sparse.fixed_pattern(10, 10, 0, stride=2)
    with pytest.raises(ValueError, match="num_summary"):
        sparse.fixed_pattern(10, 10, 2, stride=2, num_summary=3)
    with pytest.raises(ValueError, match="part"):
        sparse.strided_pattern(10, 10, 2, stride=2, part="x")
    with pytest.raises(ValueError, match="window"):
        sparse.local_global_pattern(10, 10, 2, window=-1)
    with pytest.raises(ValueError, match="block_mask"):
        sparse.to_dense(np.ones((2, 2), bool), (4, 4), 10, 10)


# --- combinations -------------------------------------------------------------

COMBOS = [
    dict(window=(20, 5)),
    dict(alibi=True),
    dict(softcap=3.0),
    dict(sinks=True),
    dict(lengths=True),
    dict(block=True),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pair", list(itertools.combinations(range(len(COMBOS)), 2)))
def test_pairs(rng, dtype, pair):
    kw = {}
    for i in pair:
        kw.update(COMBOS[i])
    _run_combo(rng, dtype, kw, L=97, S=129, causal=bool(pair[0] % 2), mask=pair[1] % 2 == 0)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mask,L,S", [(None, 17, 97), ("bool", 129, 128), ("float", 97, 130)])
def test_all_at_once(rng, isa, layout, causal, mask, L, S):
    kw = dict(window=(40, 10), alibi=True, softcap=4.0, sinks=True, lengths=True, block=True)
    _run_combo(rng, np.float32, kw, L=L, S=S, causal=causal, mask=mask, layout=layout, Hk=2)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_all_at_once_float64(rng, layout):
    kw = dict(window=(40, 10), alibi=True, softcap=4.0, sinks=True, lengths=True, block=True)
    _run_combo(rng, np.float64, kw, L=97, S=130, causal=True, mask="float", layout=layout, Hk=2)


def _run_combo(rng, dtype, kw, *, L, S, causal, mask, layout="bhsd", Hk=4):
    B, Hq = 2, 4
    q, k, v = qkv(rng, B, Hq, L, S, dtype=dtype, Hk=Hk, layout=layout)
    args = dict(is_causal=causal, enable_gqa=Hk != Hq, layout=layout)
    if "window" in kw:
        args["window"] = kw["window"]
    if kw.get("alibi"):
        args["alibi_slopes"] = np.stack([alibi(Hq), alibi(Hq) * 2])
    if "softcap" in kw:
        args["softcap"] = kw["softcap"]
    if kw.get("sinks"):
        args["sinks"] = np.linspace(-1, 2, Hq)
    if kw.get("lengths"):
        args["key_lengths"] = np.array([S, S // 2 + 3])
        args["query_lengths"] = np.array([L // 2 + 1, L])
    if kw.get("block"):
        bs = (32, 48)
        bm = rng.random((B, Hq, -(-L // 32), -(-S // 48))) < 0.7
        args.update(block_mask=bm, block_size=bs)
    if mask == "bool" or mask is True:
        args["attn_mask"] = rng.random((B, 1, L, S)) < 0.8
    elif mask == "float":
        args["attn_mask"] = randn(rng, (L, S), dtype)
    check_sdpa(q, k, v, **args)


# --- varlen -------------------------------------------------------------------


def _packed(rng, lq, lk, Hq=4, Hk=2, D=16, dtype=np.float32):
    cq = np.concatenate([[0], np.cumsum(lq)]).astype(np.int64)
    ck = np.concatenate([[0], np.cumsum(lk)]).astype(np.int64)
    q = randn(rng, (cq[-1], Hq, D), dtype)
    k = randn(rng, (ck[-1], Hk, D), dtype)
    v = randn(rng, (ck[-1], Hk, D + 3), dtype)
    return q, k, v, cq, ck


def _varlen(q, k, v, cq, ck, **kw):
    """varlen_attention with return_lse, after checking (with out= inside a larger
    buffer, and without an LSE array that could be overrun) that nothing is
    written past the end of the output."""
    T = q.shape[0]
    buf = np.full((2 * T + 8, q.shape[1], v.shape[2]), 7.0, q.dtype)
    o0 = fastattn.varlen_attention(q, k, v, cq, ck, out=buf[:T], **kw)
    assert np.all(buf[T:] == 7.0), "varlen_attention wrote past the end of out"
    o, lse = fastattn.varlen_attention(q, k, v, cq, ck, return_lse=True, **kw)
    np.testing.assert_array_equal(o, o0)
    return o, lse


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_equals_per_sequence(rng, dtype, causal):
    lq, lk = [1, 17, 0, 97, 129, 40], [1, 30, 5, 97, 128, 0]
    q, k, v, cq, ck = _packed(rng, lq, lk, dtype=dtype)
    kw = dict(is_causal=causal, enable_gqa=True)
    o, lse = _varlen(q, k, v, cq, ck, **kw)
    ro, rlse = ref.varlen_attention(q, k, v, cq, ck, return_lse=True, **kw)
    assert_close(o, ro, dtype)
    assert_close(lse, rlse, dtype, what="lse")
    for b in range(len(lq)):
        sq, sk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        ob, lb = sdpa(q[sq], k[sk], v[sk], layout="bshd", return_lse=True, **kw)
        assert_close(o[sq], ob, dtype)
        assert_close(lse[:, sq], lb, dtype, what="lse")


@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_variants(rng, dtype):
    lq, lk = [17, 97, 3], [40, 130, 64]
    q, k, v, cq, ck = _packed(rng, lq, lk, dtype=dtype)
    slopes = np.stack([alibi(4), alibi(4) * 0.5, alibi(4) * 2])
    for kw in (
        dict(window=(10, 3)),
        dict(alibi_slopes=alibi(4)),
        dict(alibi_slopes=slopes),
        dict(softcap=2.0),
        dict(sinks=[0.0, 1.0, -1.0, 2.0]),
        dict(window=(30, 0), alibi_slopes=slopes, softcap=5.0, sinks=[0.5] * 4, is_causal=True),
    ):
        o, lse = _varlen(q, k, v, cq, ck, enable_gqa=True, **kw)
        ro, rlse = ref.varlen_attention(q, k, v, cq, ck, enable_gqa=True, return_lse=True, **kw)
        assert_close(o, ro, dtype, what=str(kw))
        assert_close(lse, rlse, dtype, what=f"lse {kw}")


def test_varlen_empty_batch(rng):
    q, k, v, cq, ck = _packed(rng, [], [])
    o, lse = fastattn.varlen_attention(q, k, v, cq, ck, enable_gqa=True, return_lse=True)
    assert o.shape == (0, 4, 19) and lse.shape == (4, 0)


# --- argument checks ----------------------------------------------------------


def _bad(rng):
    return qkv(rng, 2, 4, 10, 20)


@pytest.mark.parametrize(
    "kw,exc,name",
    [
        (dict(window=(-2, 0)), ValueError, "window"),
        (dict(window=(0, -5)), ValueError, "window"),
        (dict(window=5), TypeError, "window"),
        (dict(window=(1.5, 0)), TypeError, "window"),
        (dict(alibi_slopes=np.ones(3)), ValueError, "alibi_slopes"),
        (dict(alibi_slopes=np.ones((3, 4))), ValueError, "alibi_slopes"),
        (dict(alibi_slopes=np.ones((2, 4, 1))), ValueError, "alibi_slopes"),
        (dict(alibi_slopes=np.array([1, np.nan, 1, 1])), ValueError, "alibi_slopes"),
        (dict(alibi_slopes="abc"), TypeError, "alibi_slopes"),
        (dict(softcap=0.0), ValueError, "softcap"),
        (dict(softcap=-1.0), ValueError, "softcap"),
        (dict(softcap=np.inf), ValueError, "softcap"),
        (dict(softcap="1"), TypeError, "softcap"),
        (dict(sinks=np.ones(3)), ValueError, "sinks"),
        (dict(sinks=np.ones((2, 4))), ValueError, "sinks"),
        (dict(key_lengths=np.array([21, 3])), ValueError, "key_lengths"),
        (dict(key_lengths=np.array([-1, 3])), ValueError, "key_lengths"),
        (dict(key_lengths=np.array([3])), ValueError, "key_lengths"),
        (dict(key_lengths=np.array([3.0, 3.0])), TypeError, "key_lengths"),
        (dict(query_lengths=np.array([11, 3])), ValueError, "query_lengths"),
        (dict(query_lengths=np.array([1, 2, 3])), ValueError, "query_lengths"),
        (dict(block_mask=np.ones((2, 2), bool), block_size=(8, 8)), ValueError, "block_mask"),
        (dict(block_mask=np.ones((3, 3), bool), block_size=(8, 8)), ValueError, "block_mask"),
        (dict(block_mask=np.ones((2, 3), np.int8), block_size=(8, 8)), TypeError, "block_mask"),
        (dict(block_mask=np.ones((2, 3), bool)), ValueError, "block_size"),
        (dict(block_mask=np.ones((2, 3), bool), block_size=(0, 8)), ValueError, "block_size"),
        (dict(block_mask=np.ones((2, 3), bool), block_size=8), TypeError, "block_size"),
    ],
)
def test_bad_arguments(rng, kw, exc, name):
    q, k, v = _bad(rng)
    with pytest.raises(exc, match=name):
        sdpa(q, k, v, **kw)


@pytest.mark.parametrize(
    "cq,ck,exc,name",
    [
        ([0, 5, 3, 10], [0, 5, 10, 20], ValueError, "cu_seqlens_q"),
        ([0, 5, 10], [0, 5, 10, 20], ValueError, "cu_seqlens"),
        ([0, 5, 9], [0, 5, 20], ValueError, "cu_seqlens_q"),
        ([1, 5, 10], [0, 5, 20], ValueError, "cu_seqlens_q"),
        ([0, 5, 10], [0, 5, 21], ValueError, "cu_seqlens_k"),
        ([0, 5, 10], [0, 15, 5, 20][:3], ValueError, "cu_seqlens_k"),
        ([0.0, 5.0, 10.0], [0, 5, 20], TypeError, "cu_seqlens_q"),
        ([[0, 10]], [0, 20], ValueError, "cu_seqlens_q"),
    ],
)
def test_varlen_bad_cu_seqlens(rng, cq, ck, exc, name):
    q, k, v = randn(rng, (10, 2, 8)), randn(rng, (20, 2, 8)), randn(rng, (20, 2, 8))
    with pytest.raises(exc, match=name):
        fastattn.varlen_attention(q, k, v, np.array(cq), np.array(ck))


def test_varlen_bad_variant_arguments(rng):
    q, k, v = randn(rng, (10, 2, 8)), randn(rng, (20, 2, 8)), randn(rng, (20, 2, 8))
    cq, ck = np.array([0, 4, 10]), np.array([0, 7, 20])
    for kw, exc, name in (
        (dict(window=(-3, 0)), ValueError, "window"),
        (dict(alibi_slopes=np.ones((3, 2))), ValueError, "alibi_slopes"),
        (dict(softcap=0), ValueError, "softcap"),
        (dict(sinks=np.ones(5)), ValueError, "sinks"),
    ):
        with pytest.raises(exc, match=name):
            fastattn.varlen_attention(q, k, v, cq, ck, **kw)


# --- random combinations --------------------------------------------------------


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    L=st.integers(1, 130),
    S=st.integers(1, 140),
    Hk=st.sampled_from([1, 2]),
    G=st.sampled_from([1, 2]),
    dtype=st.sampled_from(DTYPES),
    layout=st.sampled_from(["bhsd", "bshd"]),
    causal=st.booleans(),
    window=st.one_of(st.none(), st.tuples(st.integers(-1, 100), st.integers(-1, 100))),
    use_alibi=st.booleans(),
    softcap=st.one_of(st.none(), st.floats(0.5, 20.0)),
    use_sinks=st.booleans(),
    use_lengths=st.booleans(),
    block=st.one_of(st.none(), st.tuples(st.integers(1, 100), st.integers(1, 150))),
    mask=st.sampled_from([None, "bool", "float"]),
    seed=st.integers(0, 2**16),
)
def test_random_combinations(
    L, S, Hk, G, dtype, layout, causal, window, use_alibi, softcap, use_sinks, use_lengths, block, mask, seed
):
    rng = np.random.default_rng(seed)
    B, Hq = 2, Hk * G
    q, k, v = qkv(rng, B, Hq, L, S, D=8, Hk=Hk, dtype=dtype, layout=layout)
    kw = dict(is_causal=causal, enable_gqa=G > 1, layout=layout, window=window, softcap=softcap)
    if use_alibi:
        kw["alibi_slopes"] = rng.random((B, Hq))
    if use_sinks:
        kw["sinks"] = rng.standard_normal(Hq)
    if use_lengths:
        kw["key_lengths"] = rng.integers(0, S + 1, B)
        kw["query_lengths"] = rng.integers(0, L + 1, B)
    if block is not None:
        kw["block_mask"] = rng.random((B, Hq, -(-L // block[0]), -(-S // block[1]))) < 0.7
        kw["block_size"] = block
    if mask == "bool":
        kw["attn_mask"] = rng.random((L, S)) < 0.8
    elif mask == "float":
        kw["attn_mask"] = randn(rng, (B, 1, L, S), dtype)
    check_sdpa(q, k, v, **kw)
