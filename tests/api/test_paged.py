"""Paged K/V caches (``block_table``) in attention_with_kvcache and flash_compat.

Every output is compared with the float64 reference on the K/V *gathered* from
the pages through the block table (after the write), per sequence; every write
with the tokens given; pages that no table entry in use points to must stay
unchanged byte for byte.  Page sizes 1, 16, 64 and 256 with shuffled tables,
writes across page boundaries, GQA, the score options, LSE, 8-bit pages with
their per-token scales, prefill chunks (many queries) over pages, thread
counts 1-3 bit-identical, and the argument errors (nothing written).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from conftest import assert_close, to_pages

import fastattn
from fastattn import _kernels
from fastattn import reference as ref
from fastattn.flash_compat import flash_attn_with_kvcache

F32, F64 = np.dtype(np.float32), np.dtype(np.float64)
BF16 = np.dtype(ml_dtypes.bfloat16)
I8 = np.dtype(np.int8)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
TOL = {F32: 1e-4, BF16: 2e-2}


def make_pool(rng, lens, page, Hk, D, Dv, dt, spare=3, room=8):
    """A shuffled page pool holding sequences of ``lens`` tokens (room for ``room``
    more each), and its block table; ``spare`` pages belong to no sequence."""
    B = len(lens)
    per = [-(-(n + room) // page) for n in lens]
    M = max(per)
    NP = sum(per) + spare
    order = rng.permutation(NP)
    bt = np.zeros((B, M), np.int32)
    at = 0
    for b in range(B):
        bt[b, : per[b]] = order[at : at + per[b]]
        bt[b, per[b] :] = rng.integers(0, NP, M - per[b])  # past the tokens: never read
        at += per[b]
    kp = rng.standard_normal((NP, Hk, page, D)).astype(dt)
    vp = rng.standard_normal((NP, Hk, page, Dv)).astype(dt)
    return kp, vp, bt, order[at:]


def gather(pool, bt, b, n):
    """Sequence b's first n tokens, bhsd (Hk, n, X), through the block table."""
    page = pool.shape[2]
    j = np.arange(n)
    return pool[bt[b, j // page], :, j % page].transpose(1, 0, 2)


def reference(q, kp, vp, bt, lens, **kw):
    """The float64 reference per sequence on its gathered K/V: (out, lse)."""
    outs, lses = [], []
    for b, n in enumerate(lens):
        K, V = gather(kp, bt, b, n).astype(F64), gather(vp, bt, b, n).astype(F64)
        o, lse = ref.scaled_dot_product_attention(
            q[b : b + 1].astype(F64), K[None], V[None], enable_gqa=True, return_lse=True, **kw
        )
        outs.append(o)
        lses.append(lse)
    return np.concatenate(outs), np.concatenate(lses)


@pytest.mark.parametrize("page", [1, 16, 64, 256])
@pytest.mark.parametrize("dt", [F32, BF16])
@pytest.mark.parametrize("Lq", [1, 5])
def test_paged_decode_with_writes(rng, page, dt, Lq):
    B, Hq, Hk, D = 3, 4, 2, 32
    lens = np.array([page * 2 - 1, 3, page + 5])  # the writes cross page boundaries
    T = 3 if Lq == 1 else Lq
    kp, vp, bt, spare = make_pool(rng, lens, page, Hk, D, D, dt)
    kspare, vspare = kp[spare].copy(), vp[spare].copy()
    q = rng.standard_normal((B, Hq, Lq, D)).astype(F32 if dt == F32 else dt)
    kn = rng.standard_normal((B, Hk, T, D)).astype(F32)
    vn = rng.standard_normal((B, Hk, T, D)).astype(F32)
    out, lse = fastattn.attention_with_kvcache(q, kp, vp, lens, kn, vn, block_table=bt, return_lse=True)
    total = lens + T
    for b in range(B):  # the new tokens, at lens[b] .. + T of each sequence
        np.testing.assert_array_equal(gather(kp, bt, b, total[b])[:, lens[b] :], kn[b].astype(dt))
        np.testing.assert_array_equal(gather(vp, bt, b, total[b])[:, lens[b] :], vn[b].astype(dt))
    np.testing.assert_array_equal(kp[spare], kspare)  # pages in no table: untouched
    np.testing.assert_array_equal(vp[spare], vspare)
    ro, rlse = reference(q, kp, vp, bt, total, is_causal=True)
    assert_close(out, ro, tol=TOL[dt])
    assert_close(lse, rlse, tol=TOL[dt], what="lse")


@pytest.mark.parametrize(
    "opts",
    [
        {"window": (7, 0)},
        {"softcap": 5.0},
        {"alibi_slopes": np.array([0.5, 0.25, 0.125, 0.0625])},
        {"scale": 0.3, "is_causal": False},
    ],
    ids=["window", "softcap", "alibi", "noncausal"],
)
def test_paged_score_options(rng, opts):
    B, Hq, Hk, D, page = 2, 4, 1, 16, 16
    lens = np.array([40, 17])
    kp, vp, bt, _ = make_pool(rng, lens, page, Hk, D, 24, F32)
    q = rng.standard_normal((B, Hq, 3, D)).astype(F32)
    out, lse = fastattn.attention_with_kvcache(q, kp, vp, lens, block_table=bt, return_lse=True, **opts)
    kw = dict(opts)
    kw.setdefault("is_causal", True)
    ro, rlse = reference(q, kp, vp, bt, lens, **kw)
    assert_close(out, ro, tol=1e-4)
    assert_close(lse, rlse, tol=1e-4, what="lse")


@pytest.mark.parametrize("page", [16, 64])
def test_paged_prefill_chunk(rng, page):
    """Many queries (the prefill path: packed K tiles that end at page boundaries)."""
    B, Hq, Hk, D, Lq = 2, 2, 2, 64, 70
    lens = np.array([150, 80])
    kp, vp, bt, _ = make_pool(rng, lens, page, Hk, D, D, F32, room=Lq)
    q = rng.standard_normal((B, Hq, Lq, D)).astype(F32)
    kn = rng.standard_normal((B, Hk, Lq, D)).astype(F32)
    vn = rng.standard_normal((B, Hk, Lq, D)).astype(F32)
    out = fastattn.attention_with_kvcache(q, kp, vp, lens, kn, vn, block_table=bt)
    ro, _ = reference(q, kp, vp, bt, lens + Lq, is_causal=True)
    assert_close(out, ro, tol=1e-4)


def test_paged_bshd_layout_matches_bhsd(rng):
    B, Hq, Hk, D, page = 2, 4, 2, 16, 16
    lens = np.array([33, 9])
    kp, vp, bt, _ = make_pool(rng, lens, page, Hk, D, D, F32)
    q = rng.standard_normal((B, Hq, 2, D)).astype(F32)
    want = fastattn.attention_with_kvcache(q, kp, vp, lens, block_table=bt)
    got = fastattn.attention_with_kvcache(
        q.swapaxes(1, 2),
        kp.swapaxes(1, 2).copy(),
        vp.swapaxes(1, 2).copy(),
        lens,
        block_table=bt,
        layout="bshd",
    )
    np.testing.assert_array_equal(got.swapaxes(1, 2), want)


@pytest.mark.parametrize("dt", [I8, E4M3])
@pytest.mark.parametrize("page", [1, 16])
def test_paged_kv8_per_token_scales(rng, dt, page):
    """8-bit pages with per-token scales paged with them, written with the new tokens."""
    B, Hq, Hk, D = 2, 4, 2, 32
    lens = np.array([20, 7])
    kf, vf, bt, _ = make_pool(rng, lens, page, Hk, D, D, F32)
    kp, ks = fastattn.quantize_kv(kf, dt)
    vp, vs = fastattn.quantize_kv(vf, dt)
    q = rng.standard_normal((B, Hq, 1, D)).astype(F32)
    kn = rng.standard_normal((B, Hk, 2, D)).astype(F32)
    vn = rng.standard_normal((B, Hk, 2, D)).astype(F32)
    out = fastattn.attention_with_kvcache(q, kp, vp, lens, kn, vn, block_table=bt, k_scale=ks, v_scale=vs)
    total = lens + 2
    qmax = 127.0 if dt == I8 else 448.0
    for b in range(B):  # the new tokens' scales, beside them
        got = gather(ks, bt, b, total[b])[:, lens[b] :]
        np.testing.assert_allclose(got, np.abs(kn[b]).max(-1, keepdims=True) / qmax, rtol=1e-6)
    kd = kp.astype(F64) * ks
    vd = vp.astype(F64) * vs
    ro, _ = reference(q, kd, vd, bt, total, is_causal=True)
    assert_close(out, ro, tol=1e-4)


def test_paged_kv8_per_head_scale(rng):
    """A per-sequence, per-head scale (flash-attn 3's descale) with 8-bit pages."""
    B, Hq, Hk, D, page = 2, 2, 2, 16, 16
    lens = np.array([30, 12])
    kf, vf, bt, _ = make_pool(rng, lens, page, Hk, D, D, F32)
    s = np.array([[0.05, 0.04], [0.03, 0.05]], np.float32)[:, :, None, None]  # (B, Hk, 1, 1)
    kp = np.clip(np.rint(kf / 0.05), -127, 127).astype(I8)
    vp = np.clip(np.rint(vf / 0.05), -127, 127).astype(I8)
    q = rng.standard_normal((B, Hq, 1, D)).astype(F32)
    out = fastattn.attention_with_kvcache(q, kp, vp, lens, block_table=bt, k_scale=s, v_scale=s)
    outs = []
    for b, n in enumerate(lens):
        K = gather(kp, bt, b, n).astype(F64) * s[b]
        V = gather(vp, bt, b, n).astype(F64) * s[b]
        outs.append(
            ref.scaled_dot_product_attention(q[b : b + 1].astype(F64), K[None], V[None], is_causal=True)
        )
    assert_close(out, np.concatenate(outs), tol=1e-4)


def test_paged_threads_bit_identical(rng):
    """Split-KV over a long paged cache: the same bits for 1, 2 and 3 threads."""
    B, Hq, Hk, D, page = 1, 8, 2, 64, 16
    lens = np.array([4000])
    kp, vp, bt, _ = make_pool(rng, lens, page, Hk, D, D, F32)
    q = rng.standard_normal((B, Hq, 1, D)).astype(F32)
    outs = [
        fastattn.attention_with_kvcache(q, kp, vp, lens, block_table=bt, num_threads=n) for n in (1, 2, 3)
    ]
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])
    ro, _ = reference(q, kp, vp, bt, lens, is_causal=True)
    assert_close(outs[0], ro, tol=1e-4)


def test_paged_equals_contiguous_bits_when_pages_are_in_order(rng):
    """Pages in table order over one buffer read as the contiguous cache: same result
    as the dense call (within float32 rounding: tiles end at page boundaries)."""
    B, Hq, Hk, D, page = 1, 4, 4, 32, 16
    lens = np.array([100])
    kd = rng.standard_normal((1, Hk, 128, D)).astype(F32)
    vd = rng.standard_normal((1, Hk, 128, D)).astype(F32)
    kp = kd[0].reshape(Hk, 8, page, D).transpose(1, 0, 2, 3).copy()
    vp = vd[0].reshape(Hk, 8, page, D).transpose(1, 0, 2, 3).copy()
    bt = np.arange(8, dtype=np.int32)[None]
    q = rng.standard_normal((B, Hq, 1, D)).astype(F32)
    got = fastattn.attention_with_kvcache(q, kp, vp, lens, block_table=bt)
    want = fastattn.attention_with_kvcache(q, kd, vd, lens)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("page", [1, 16, 48])
@pytest.mark.parametrize("dt", [F32, BF16, I8])
@pytest.mark.parametrize(
    "opts", [{}, {"softcap": 4.0}, {"window": (300, 0)}, {"alibi": True}, {"return_lse": True}]
)
def test_paged_decode_heads_together_are_each_heads_own_tasks(rng, page, dt, opts):
    """One query row per kv head over pages (multi-head decode) runs the tasks of up to 8 kv
    heads of a sequence together, page by page (the kernel's run_heads): the same bits as
    one task per head (the test hook turns the grouping off), output and LSE, for 12 heads
    (a group of 8 and one of 4), sequences of different lengths, 1 and 3 threads, alone and
    with the keys split over tasks (B1: 12 tasks); and equal to a call on each head alone
    where that call's tasks are the same (no split: sequences under 1024 keys)."""
    H, D = 12, 64

    def case(lens):
        B, S = len(lens), int(max(lens))
        kf = rng.standard_normal((B, H, S, D)).astype(F32)
        vf = rng.standard_normal((B, H, S, D)).astype(F32)
        q = rng.standard_normal((B, H, 1, D)).astype(F32)
        kw: dict = {k: v for k, v in opts.items() if k != "alibi"}
        if opts.get("alibi"):
            kw["alibi_slopes"] = rng.uniform(0.01, 0.2, (B, H))
        if dt == I8:
            k, ks = fastattn.quantize_kv(kf, dt)
            v, vs = fastattn.quantize_kv(vf, dt)
            kw["k_scale"] = to_pages(np.random.default_rng(3), ks, page)[0]
            kw["v_scale"] = to_pages(np.random.default_rng(3), vs, page)[0]
        else:
            q, k, v = q.astype(dt), kf.astype(dt), vf.astype(dt)
        kp, bt = to_pages(np.random.default_rng(3), k, page)
        vp, _ = to_pages(np.random.default_rng(3), v, page)
        return q, kp, vp, bt, np.array(lens), kw

    def call(c, h, threads):
        q, kp, vp, bt, lens, kw = c
        hk = {n: a[:, h] for n, a in kw.items() if n in ("k_scale", "v_scale", "alibi_slopes")}
        hk.update({n: a for n, a in kw.items() if n not in hk})
        out = fastattn.attention_with_kvcache(
            q[:, h], kp[:, h], vp[:, h], lens, block_table=bt, num_threads=threads, **hk
        )
        return [np.asarray(x) for x in (out if isinstance(out, tuple) else (out,))]

    def same(a, b):
        for x, y in zip(a, b, strict=True):
            np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8))

    every = slice(0, H)
    for lens in ([900, 333], [5000]):  # no split; split over tasks
        c = case(lens)
        together = [call(c, every, n) for n in (1, 3)]
        old = _kernels.heads_together(False)
        try:
            alone = call(c, every, 1)
        finally:
            _kernels.heads_together(old)
        for got in together:
            same(got, alone)
        if lens[0] < 1024:
            for h in range(H):
                same([x[:, h : h + 1] for x in together[0]], call(c, slice(h, h + 1), 1))
    if not opts:  # and the float64 reference on the gathered pages
        q, kp, vp, bt, lens, kw = c
        kd = kp.astype(F64) * (kw["k_scale"] if dt == I8 else 1.0)
        vd = vp.astype(F64) * (kw["v_scale"] if dt == I8 else 1.0)
        ro, _ = reference(q, kd, vd, bt, lens, is_causal=True)
        assert_close(together[0][0], ro, tol=TOL[BF16] if dt == BF16 else TOL[F32])


def test_flash_compat_block_table(rng):
    """flash-attn's paged layout (num_blocks, page_block_size, nheads_k, headdim)."""
    B, Hq, Hk, D, page = 2, 4, 2, 32, 16
    lens = np.array([21, 40])
    kp, vp, bt, spare = make_pool(rng, lens, page, Hk, D, D, F32)
    kfa, vfa = kp.transpose(0, 2, 1, 3).copy(), vp.transpose(0, 2, 1, 3).copy()
    q = rng.standard_normal((B, 1, Hq, D)).astype(F32)
    k = rng.standard_normal((B, 1, Hk, D)).astype(F32)
    v = rng.standard_normal((B, 1, Hk, D)).astype(F32)
    spare_before = kfa[spare].copy()
    out, lse = flash_attn_with_kvcache(
        q,
        kfa,
        vfa,
        k,
        v,
        cache_seqlens=lens.astype(np.int32),
        block_table=bt,
        causal=True,
        return_softmax_lse=True,
    )
    np.testing.assert_array_equal(kfa[spare], spare_before)
    kb, vb = kfa.transpose(0, 2, 1, 3), vfa.transpose(0, 2, 1, 3)
    ro, rlse = reference(q.swapaxes(1, 2), kb, vb, bt, lens + 1, is_causal=True)
    assert_close(out.swapaxes(1, 2), ro, tol=1e-4)
    assert_close(lse, rlse, tol=1e-4, what="lse")


@pytest.mark.parametrize("window", [(-1, -1), (4, 0)])
def test_flash_compat_block_table_more_queries_than_keys(rng, window):
    """flash-attn's rule (its test_flash_attn_kvcache, 128 queries over 96 keys): a causal
    call whose sequence holds fewer keys than q has queries aligns them to the bottom
    right and the first rows, which see no key, output zeros (the native API refuses)."""
    B, Lq, Hq, Hk, D, page = 2, 12, 4, 2, 32, 16
    lens = np.array([3, 40])
    kp, vp, bt, _ = make_pool(rng, lens, page, Hk, D, D, F32)
    kfa, vfa = kp.transpose(0, 2, 1, 3).copy(), vp.transpose(0, 2, 1, 3).copy()
    q = rng.standard_normal((B, Lq, Hq, D)).astype(F32)
    k, v = (rng.standard_normal((B, 2, Hk, D)).astype(F32) for _ in range(2))
    kw = dict(cache_seqlens=lens.astype(np.int32), block_table=bt, causal=True, window_size=window)
    out = flash_attn_with_kvcache(q, kfa, vfa, k, v, **kw)
    kb, vb = kfa.transpose(0, 2, 1, 3), vfa.transpose(0, 2, 1, 3)
    rw = None if window == (-1, -1) else window
    ro, _ = reference(q.swapaxes(1, 2), kb, vb, bt, lens + 2, is_causal=True, window=rw)
    assert_close(out.swapaxes(1, 2), ro, tol=1e-4)
    assert np.all(out[0, : Lq - 5] == 0) and np.all(out[0, Lq - 5 :] != 0)  # 5 keys: rows 0-6 see none
    with pytest.raises(ValueError, match="causal decoding needs"):
        fastattn.attention_with_kvcache(q.swapaxes(1, 2), kp, vp, lens, block_table=bt, is_causal=True)


def test_paged_errors_write_nothing(rng):
    B, Hq, Hk, D, page = 2, 2, 2, 16, 16
    lens = np.array([10, 20])
    kp, vp, bt, _ = make_pool(rng, lens, page, Hk, D, D, F32)
    q = rng.standard_normal((B, Hq, 1, D)).astype(F32)
    kn = rng.standard_normal((B, Hk, 1, D)).astype(F32)
    before = kp.copy(), vp.copy()

    def call(table, **kw):
        return fastattn.attention_with_kvcache(q, kp, vp, lens, kn, kn, block_table=table, **kw)

    bad = bt.copy()
    bad[1, 1] = kp.shape[0]
    with pytest.raises(ValueError, match=r"block_table\[1, 1\]"):
        call(bad)
    with pytest.raises(TypeError, match="block_table must be an integer array"):
        call(bt.astype(np.float32))
    with pytest.raises(ValueError, match="block_table must have shape"):
        call(bt[:1])
    with pytest.raises(ValueError, match="needs 2"):
        call(bt[:, :1])
    shared = bt.copy()
    shared[1, 1] = bt[0, 0]  # both sequences append into one page slot
    with pytest.raises(ValueError, match="same cache slot"):
        fastattn.attention_with_kvcache(q, kp, vp, np.array([10, 26]), kn, kn, block_table=shared)
    with pytest.raises(ValueError, match="k_cache must be a 4-D page pool"):
        fastattn.attention_with_kvcache(q, kp[0], vp, lens, block_table=bt)
    np.testing.assert_array_equal(kp, before[0])
    np.testing.assert_array_equal(vp, before[1])


@pytest.mark.parametrize("page", [1, 16])
def test_paged_varlen_chunked_prefill(rng, page):
    """One call: decode rows (1 query) and prefill chunks of several sequences, keys
    read from pages; against the reference per sequence on its gathered K/V."""
    Hq, Hk, D = 4, 2, 32
    lens = np.array([30, 9, 50, 17])  # keys per sequence (the chunk's included)
    nq = np.array([1, 9, 20, 1])  # queries: decode, a whole prompt, a chunk, decode
    kp, vp, bt, _ = make_pool(rng, lens, page, Hk, D, D, F32)
    kf, vf = kp.transpose(0, 2, 1, 3).copy(), vp.transpose(0, 2, 1, 3).copy()  # (pages, page, Hk, D)
    cq = np.concatenate([[0], np.cumsum(nq)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    q = rng.standard_normal((int(cq[-1]), Hq, D)).astype(F32)
    out, lse = fastattn.varlen_attention(
        q, kf, vf, cq, ck, block_table=bt, is_causal=True, enable_gqa=True, return_lse=True
    )
    for b in range(len(lens)):
        qb = q[cq[b] : cq[b + 1]].swapaxes(0, 1)[None]
        ro, rlse = reference(qb, kp, vp, bt[b : b + 1], lens[b : b + 1], is_causal=True)
        assert_close(out[cq[b] : cq[b + 1]], ro[0].swapaxes(0, 1), tol=1e-4)
        assert_close(lse[:, cq[b] : cq[b + 1]], rlse[0], tol=1e-4, what="lse")
    # flash-attn's name for it
    fo = fastattn.flash_compat.flash_attn_varlen_func(q, kf, vf, cq, ck, 20, 50, causal=True, block_table=bt)
    np.testing.assert_array_equal(fo, out)


@pytest.mark.parametrize("dt", [F32, BF16, I8])
@pytest.mark.parametrize("causal", [True, False])
def test_paged_chunked_prefill_heads_together_are_each_heads_own_tasks(rng, dt, causal):
    """A chunked-prefill call with one query row per kv head (G = 1) runs the tasks of its
    one-query sequences' kv heads together (run_heads), as a multi-head decode call does;
    its chunks' tasks one by one.  The same bits as with the grouping off, for 1 and 3
    threads (12 heads: groups of 8 + 4 or 4 + 4 + 4), query blocks outer (causal) or kv
    heads outer; on the tile kernels (bf16 chunks of >= 32 rows) as on the vector ones;
    against the float64 reference per sequence."""
    H, D, page = 12, 64, 16
    nq = np.array([1, 300, 1, 1, 130])  # chunks of several query blocks (tasks of <= 128 rows)
    lens = nq + np.array([300, 20, 77, 0, 150])  # keys per sequence (its queries included)
    kf, vf, bt, _ = make_pool(rng, lens, page, H, D, D, F32)
    kw: dict = {}
    if dt == I8:
        kp, ks = fastattn.quantize_kv(kf, I8)
        vp, vs = fastattn.quantize_kv(vf, I8)
        kw = dict(k_scale=ks.transpose(0, 2, 1, 3), v_scale=vs.transpose(0, 2, 1, 3))
        kd, vd = kp.astype(F64) * ks, vp.astype(F64) * vs
        qdt = F32
    else:
        kp, vp = kf.astype(dt), vf.astype(dt)
        kd, vd = kp.astype(F64), vp.astype(F64)
        qdt = dt
    cq = np.concatenate([[0], np.cumsum(nq)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    q = rng.standard_normal((int(cq[-1]), H, D)).astype(qdt)

    def call(threads):
        return fastattn.varlen_attention(
            q,
            kp.transpose(0, 2, 1, 3),
            vp.transpose(0, 2, 1, 3),
            cq,
            ck,
            block_table=bt,
            is_causal=causal,
            num_threads=threads,
            **kw,
        )

    together = [call(n) for n in (1, 3)]
    old = _kernels.heads_together(False)
    try:
        alone = call(1)
    finally:
        _kernels.heads_together(old)
    for got in together:
        np.testing.assert_array_equal(got.view(np.uint8), alone.view(np.uint8))
    tol = TOL[BF16 if dt == BF16 else F32]
    for b in range(len(lens)):
        qb = q[cq[b] : cq[b + 1]].swapaxes(0, 1)[None]
        ro, _ = reference(qb, kd, vd, bt[b : b + 1], lens[b : b + 1], is_causal=causal)
        assert_close(together[0][cq[b] : cq[b + 1]], ro[0].swapaxes(0, 1), tol=tol)


@pytest.mark.parametrize("Hq", [2, 8])
def test_paged_head_dim_not_whole_vectors(rng, Hq):
    """D = 20: K rows are converted to whole vectors page by page before Q.K^T."""
    B, Hk, D, page = 2, 2, 20, 16
    lens = np.array([70, 33])
    kp, vp, bt, _ = make_pool(rng, lens, page, Hk, D, D, F32)
    q = rng.standard_normal((B, Hq, 1, D)).astype(F32)
    out, lse = fastattn.attention_with_kvcache(q, kp, vp, lens, block_table=bt, return_lse=True)
    ro, rlse = reference(q, kp, vp, bt, lens, is_causal=True)
    assert_close(out, ro, tol=1e-4)
    assert_close(lse, rlse, tol=1e-4, what="lse")


@pytest.mark.parametrize("bad", [0.0, np.nan, -1.0, np.inf])
@pytest.mark.parametrize("page", [1, 16])
def test_paged_kv8_scales_checked_where_read(rng, bad, page):
    """Per-token paged scales are checked in the slots the call reads (the sequences'
    tokens through the table), not in the rest of the pool: a fresh pool's unused pages
    and the slots past a sequence's end may hold anything (zeros, NaN), as in a server's
    pool, including page 0 and the slot right after the end.  A bad value in a read slot
    is a ValueError naming the scale, with nothing written."""
    B, Hq, Hk, D = 2, 4, 2, 32
    lens = np.array([20, 7])
    kf, vf, bt, spare = make_pool(rng, lens, page, Hk, D, D, F32)
    kp, ks = fastattn.quantize_kv(kf, I8)
    vp, vs = fastattn.quantize_kv(vf, I8)
    ks, vs = ks.copy(), vs.copy()
    for s in (ks, vs):  # unused pages and every slot past the ends: bad
        s[spare] = bad
        for b, n in enumerate(lens):
            for j in range(n, -(-(n + 8) // page) * page):  # the sequence's own pages (make_pool's room)
                s[bt[b, j // page], :, j % page] = bad
    q = rng.standard_normal((B, Hq, 1, D)).astype(F32)
    kd, vd = kp.astype(F64) * np.nan_to_num(ks), vp.astype(F64) * np.nan_to_num(vs)
    out = fastattn.attention_with_kvcache(q, kp, vp, lens, block_table=bt, k_scale=ks, v_scale=vs)
    ro, _ = reference(q, kd, vd, bt, lens, is_causal=True)
    assert_close(out, ro, tol=1e-4)
    # chunked prefill over the same pages (flash-attn's layout)
    kf2, vf2 = kp.transpose(0, 2, 1, 3), vp.transpose(0, 2, 1, 3)
    ks2, vs2 = ks.transpose(0, 2, 1, 3), vs.transpose(0, 2, 1, 3)
    ck = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    cq = np.arange(B + 1, dtype=np.int32)

    def chunked():
        return fastattn.varlen_attention(
            q[:, :, 0],
            kf2,
            vf2,
            cq,
            ck,
            block_table=bt,
            is_causal=True,
            enable_gqa=True,
            k_scale=ks2,
            v_scale=vs2,
        )

    assert_close(chunked(), ro[:, :, 0], tol=1e-4)
    # one bad scale in a slot that is read (sequence 1's last token): an error, nothing written
    j = lens[1] - 1
    vs[bt[1, j // page], 1, j % page] = bad
    kn = rng.standard_normal((B, Hk, 1, D)).astype(F32)
    before = [a.copy() for a in (kp, vp, ks, vs)]
    with pytest.raises(ValueError, match="v_scale must be finite and positive"):
        fastattn.attention_with_kvcache(q, kp, vp, lens, kn, kn, block_table=bt, k_scale=ks, v_scale=vs)
    for a, b in zip(before, (kp, vp, ks, vs)):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
    with pytest.raises(ValueError, match="v_scale must be finite and positive"):
        chunked()
