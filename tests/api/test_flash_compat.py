"""fastattn.flash_compat against flash-attn's documented semantics.

The oracle below writes flash-attn 2's rules out in float64 NumPy, independent
of fastattn's option handling: bottom-right causal and window masks, ALiBi
``-slope * |i + Sk - Sq - j|``, softcap ``c * tanh(s / c)``, GQA by head groups,
rows with no key give zeros.  The functions are also checked against the
functional API they map onto."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_close, optional, randn

import fastattn
from fastattn import flash_compat as fc


def _oracle(q, k, v, *, causal=False, window=(-1, -1), softcap=0.0, alibi=None, scale=None, valid=None):
    """q (B, Lq, H, D), k/v (B, S, Hk, D): out (B, Lq, H, Dv) and lse (B, H, Lq), float64.

    valid: optional (B, S) bool of the keys that exist; positions are bottom-right on
    the number of valid keys ending at the last valid one (flash-attn's KV cache rule)."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    B, Lq, H, D = q.shape
    S, Hk = k.shape[1], k.shape[2]
    G = H // Hk
    scale = 1 / np.sqrt(D) if scale is None else scale
    out = np.zeros((B, Lq, H, v.shape[3]))
    lse = np.full((B, H, Lq), -np.inf)
    for b in range(B):
        ok = np.ones(S, bool) if valid is None else valid[b]
        end = int(np.nonzero(ok)[0].max()) + 1 if ok.any() else 0
        for h in range(H):
            s = q[b, :, h] @ k[b, :, h // G].T * scale
            if softcap:
                s = softcap * np.tanh(s / softcap)
            i = np.arange(Lq)[:, None] + end - Lq  # bottom-right position of each query
            j = np.arange(S)[None, :]
            if alibi is not None:
                sl = alibi[h] if alibi.ndim == 1 else alibi[b, h]
                s = s - sl * np.abs(i - j)
            keep = np.broadcast_to(ok[None, :], s.shape).copy()
            if causal:
                keep &= j <= i
            if window[0] >= 0:
                keep &= j >= i - window[0]
            if window[1] >= 0:
                keep &= j <= i + window[1]
            s = np.where(keep, s, -np.inf)
            m = s.max(1, keepdims=True)
            live = np.isfinite(m[:, 0])
            p = np.where(keep, np.exp(s - np.where(np.isfinite(m), m, 0)), 0)
            den = p.sum(1)
            out[b, live, h] = (p[live] / den[live, None]) @ v[b, :, h // G]
            lse[b, h, live] = np.log(den[live]) + m[live, 0]
    return out, lse


CASES = [
    dict(),
    dict(causal=True),
    dict(causal=True, Lq=5, S=23),
    dict(causal=True, Lq=23, S=9),  # the first 14 rows see no key: zeros
    dict(window=(4, 2)),
    dict(window=(3, -1), causal=True, Lq=7, S=30),
    dict(softcap=2.0),
    dict(alibi="h", causal=True),
    dict(alibi="bh", window=(-1, 5)),
    dict(gqa=True, causal=True, scale=0.3, softcap=5.0),
]


def _inputs(rng, case, dtype=np.float32):
    B, H, D = 2, 4, 16
    Lq, S = case.get("Lq", 19), case.get("S", 19)
    Hk = 2 if case.get("gqa") else H
    q, k, v = (
        randn(rng, (B, Lq, H, D), dtype),
        randn(rng, (B, S, Hk, D), dtype),
        randn(rng, (B, S, Hk, D), dtype),
    )
    kw = {}
    for n in ("causal", "window", "softcap"):
        if n in case:
            kw[n] = case[n]
    if "scale" in case:
        kw["scale"] = case["scale"]
    if case.get("alibi") == "h":
        kw["alibi"] = rng.random(H) * 0.5
    elif case.get("alibi") == "bh":
        kw["alibi"] = rng.random((B, H)) * 0.5
    return q, k, v, kw


def _flash_kw(kw):
    fk = {}
    if "causal" in kw:
        fk["causal"] = kw["causal"]
    if "window" in kw:
        fk["window_size"] = kw["window"]
    if "softcap" in kw:
        fk["softcap"] = kw["softcap"]
    if "alibi" in kw:
        fk["alibi_slopes"] = kw["alibi"]
    if "scale" in kw:
        fk["softmax_scale"] = kw["scale"]
    return fk


IDS = [",".join(f"{a}={b}" for a, b in c.items()) or "plain" for c in CASES]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_flash_attn_func_matches_flash_semantics(rng, case):
    q, k, v, kw = _inputs(rng, case)
    copies = [a.copy() for a in (q, k, v)]
    out, lse, probs = fc.flash_attn_func(q, k, v, return_attn_probs=True, **_flash_kw(kw))
    eo, el = _oracle(q, k, v, **kw)
    assert out.shape == q.shape and out.dtype == np.float32
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == np.float32
    assert probs.shape == (0,)
    assert_close(out, eo, np.float32)
    assert_close(lse, el, np.float32, what="lse")
    for a, c in zip((q, k, v), copies):
        np.testing.assert_array_equal(a, c)
    # The same as the functional API it maps onto, bit for bit.
    same = fastattn.scaled_dot_product_attention(
        q,
        k,
        v,
        is_causal=kw.get("causal", False),
        scale=kw.get("scale"),
        enable_gqa=True,
        layout="bshd",
        window=None if kw.get("window", (-1, -1)) == (-1, -1) else kw["window"],
        softcap=kw.get("softcap"),
        alibi_slopes=kw.get("alibi"),
    )
    np.testing.assert_array_equal(fc.flash_attn_func(q, k, v, **_flash_kw(kw)), same)


def test_defaults_are_flash_attns(rng):
    # causal=False, window (-1, -1) and softcap=0.0 mean "off": plain attention.
    q, k, v, _ = _inputs(rng, dict(Lq=6, S=11))
    assert_close(fc.flash_attn_func(q, k, v), _oracle(q, k, v)[0], np.float32)
    assert_close(
        fc.flash_attn_func(q, k, v, softcap=0.0, window_size=(-1, -1)), _oracle(q, k, v)[0], np.float32
    )


@pytest.mark.parametrize("case", [CASES[1], CASES[5], CASES[9]], ids=["causal", "window", "gqa"])
def test_packed_variants_equal_flash_attn_func(rng, case):
    q, k, v, kw = _inputs(rng, case)
    fk = _flash_kw(kw)
    ref = fc.flash_attn_func(q, k, v, **fk)
    kv = np.stack([k, v], axis=2)  # (B, S, 2, Hk, D)
    assert_close(fc.flash_attn_kvpacked_func(q, kv, **fk), ref, np.float32, tol=1e-6)
    if q.shape == k.shape:
        qkv = np.stack([q, k, v], axis=2)  # (B, S, 3, H, D)
        assert_close(fc.flash_attn_qkvpacked_func(qkv, **fk), ref, np.float32, tol=1e-6)
    with pytest.raises(ValueError, match="kv"):
        fc.flash_attn_kvpacked_func(q, k)
    with pytest.raises(ValueError, match="qkv"):
        fc.flash_attn_qkvpacked_func(kv)


@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[5], CASES[7], CASES[9]], ids=lambda c: str(c))
def test_varlen_matches_per_sequence_oracle(rng, case):
    H, D = 4, 16
    Hk = 2 if case.get("gqa") else H
    lq, lk = np.array([3, 0, 9, 5]), np.array([7, 4, 9, 12])
    if case.get("Lq", 0) > case.get("S", 19):
        lq, lk = lk, lq
    cq, ck = np.concatenate([[0], np.cumsum(lq)]), np.concatenate([[0], np.cumsum(lk)])
    q, k, v = randn(rng, (cq[-1], H, D)), randn(rng, (ck[-1], Hk, D)), randn(rng, (ck[-1], Hk, D))
    _, _, _, kw = _inputs(rng, case)
    if "alibi" in kw:
        kw["alibi"] = rng.random(H) * 0.5
    out, lse, probs = fc.flash_attn_varlen_func(
        q, k, v, cq.astype(np.int32), ck.astype(np.int32), int(lq.max()), int(lk.max()),
        return_attn_probs=True, **_flash_kw(kw),
    )  # fmt: skip
    assert out.shape == (cq[-1], H, D) and lse.shape == (H, cq[-1]) and probs.shape == (0,)
    for b in range(len(lq)):
        sq, sk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        eo, el = _oracle(q[None, sq], k[None, sk], v[None, sk], **kw)
        assert_close(out[sq], eo[0], np.float32)
        assert_close(lse[:, sq], el[0], np.float32, what="lse")
    # The packed forms read the same rows.
    if Hk == H and np.array_equal(lq, lk):
        qkv = np.stack([q, k, v], axis=1)
        o2 = fc.flash_attn_varlen_qkvpacked_func(qkv, cq, int(lq.max()), **_flash_kw(kw))
        assert_close(o2, out, np.float32, tol=1e-6)
    o3 = fc.flash_attn_varlen_kvpacked_func(
        q, np.stack([k, v], axis=1), cq, ck, int(lq.max()), int(lk.max()), **_flash_kw(kw)
    )
    assert_close(o3, out, np.float32, tol=1e-6)


def test_varlen_argument_checks(rng):
    q = randn(rng, (10, 2, 8))
    cu = np.array([0, 4, 10], dtype=np.int32)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        fc.flash_attn_varlen_func(q, q, q, cu, cu, 5, 6)
    with pytest.raises(ValueError, match="max_seqlen_k"):
        fc.flash_attn_varlen_func(q, q, q, cu, cu, 6, 2)
    with pytest.raises(ValueError, match="k must be a 4-D page pool"):
        fc.flash_attn_varlen_func(q, q, q, cu, cu, 6, 6, block_table=np.zeros((2, 1), np.int32))
    # dropout_p > 0 works (test_flash_compat_dropout.py), but not with block_table
    bt = np.zeros((2, 1), np.int32)
    with pytest.raises(NotImplementedError, match="block_table"):
        fc.flash_attn_varlen_func(q, q, q, cu, cu, 6, 6, dropout_p=0.1, block_table=bt)
    with pytest.raises(TypeError, match="max_seqlen_q"):
        fc.flash_attn_varlen_func(q, q, q, cu, cu, 6.0, 6)
    with pytest.raises(TypeError, match="cu_seqlens_k"):
        fc.flash_attn_varlen_func(q, q, q, cu, cu.astype(np.float32), 6, 6)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        fc.flash_attn_varlen_func(q, q, q, np.array([0, 4, 9]), cu, 6, 6)


def test_flash_attn_func_bad_arguments(rng):
    q = randn(rng, (1, 4, 2, 8))
    fc.flash_attn_func(q, q, q, dropout_p=0.0, deterministic=True)  # 0 and flags are fine
    with pytest.raises(TypeError, match="dropout_p"):
        fc.flash_attn_func(q, q, q, dropout_p="0")
    with pytest.raises(ValueError, match="dropout_p"):
        fc.flash_attn_func(q, q, q, dropout_p=1.5)
    with pytest.raises(ValueError, match="softcap"):
        fc.flash_attn_func(q, q, q, softcap=-1.0)
    with pytest.raises(TypeError, match="softcap"):
        fc.flash_attn_func(q, q, q, softcap=None)
    with pytest.raises(ValueError, match=r"window_size\[0\]"):
        fc.flash_attn_func(q, q, q, window_size=(-2, 0))
    with pytest.raises(TypeError, match="window_size"):
        fc.flash_attn_func(q, q, q, window_size=4)
    with pytest.raises(TypeError, match="causal"):
        fc.flash_attn_func(q, q, q, causal=1)
    with pytest.raises(TypeError, match="deterministic"):
        fc.flash_attn_func(q, q, q, deterministic=None)
    with pytest.raises(ValueError, match="q must be 4-D"):
        fc.flash_attn_func(q[0], q, q)
    with pytest.raises(ValueError, match="multiple"):
        fc.flash_attn_func(randn(rng, (1, 4, 3, 8)), q, q)
    with pytest.raises(ValueError, match="alibi_slopes"):
        fc.flash_attn_func(q, q, q, alibi_slopes=np.ones(3))
    with pytest.raises(TypeError, match="scale"):
        fc.flash_attn_func(q, q, q, softmax_scale="x")


# ------------------------------------------------------------------ KV cache
def _cache_setup(rng, B=3, Bc=None, S=32, Hq=4, Hk=2, D=16, dtype=np.float32):
    Bc = B if Bc is None else Bc
    kc = randn(rng, (Bc, S, Hk, D), dtype)
    vc = randn(rng, (Bc, S, Hk, D), dtype)
    return kc, vc


def _expect_kvcache(q, kc, vc, seqlens, k=None, v=None, idx=None, leftpad=None, **kw):
    """The oracle on the cache after the write, with the valid keys of each row."""
    B = q.shape[0]
    idx = np.arange(B) if idx is None else np.asarray(idx)
    kc2, vc2 = kc.copy(), vc.copy()
    T = 0 if k is None else k.shape[1]
    for b in range(B):
        if T:
            kc2[idx[b], seqlens[b] : seqlens[b] + T] = k[b]
            vc2[idx[b], seqlens[b] : seqlens[b] + T] = v[b]
    S = kc.shape[1]
    valid = np.zeros((B, S), bool)
    for b in range(B):
        lo = 0 if leftpad is None else leftpad[b]
        valid[b, lo : seqlens[b] + T] = True
    out, lse = _oracle(q, kc2[idx], vc2[idx], valid=valid, **kw)
    return out, lse, kc2, vc2


@pytest.mark.parametrize(
    "case",
    [
        dict(),
        dict(causal=True),
        dict(causal=True, window=(5, 0), ragged=True),
        dict(causal=True, idx=[2, 0, 3], Bc=5, ragged=True),  # scattered cache rows
        dict(causal=True, idx=[1, 3, 5], Bc=6),  # a strided progression: views
        dict(causal=True, leftpad=[0, 3, 6], ragged=True),
        dict(alibi=True, softcap=3.0, causal=True),
        dict(causal=True, T=0),  # attend only
    ],
    ids=lambda c: ",".join(f"{a}={b}" for a, b in c.items()) or "plain",
)
def test_with_kvcache_appends_in_place_and_attends(rng, case):
    B, Hq, Hk, D, S = 3, 4, 2, 16, 32
    kc, vc = _cache_setup(rng, B=B, Bc=case.get("Bc"), S=S, Hq=Hq, Hk=Hk, D=D)
    T = case.get("T", 2)
    Lq = max(T, 1)
    q = randn(rng, (B, Lq, Hq, D))
    k = randn(rng, (B, T, Hk, D)) if T else None
    v = randn(rng, (B, T, Hk, D)) if T else None
    seq = np.array([7, 12, 9] if case.get("ragged") else [10, 10, 10], dtype=np.int32)
    kw = {n: case[n] for n in ("causal", "window", "softcap") if n in case}
    if case.get("alibi"):
        kw["alibi"] = rng.random((B, Hq)) * 0.3
    idx = case.get("idx")
    leftpad = case.get("leftpad")
    eo, el, ek, ev = _expect_kvcache(q, kc, vc, seq, k, v, idx=idx, leftpad=leftpad, **kw)
    before_q = q.copy()
    out, lse = fc.flash_attn_with_kvcache(
        q,
        kc,
        vc,
        k,
        v,
        cache_seqlens=seq,
        cache_batch_idx=None if idx is None else np.array(idx, np.int32),
        cache_leftpad=None if leftpad is None else np.array(leftpad, np.int32),
        return_softmax_lse=True,
        **_flash_kw(kw),
    )
    np.testing.assert_array_equal(kc, ek)  # written in place, nothing else touched
    np.testing.assert_array_equal(vc, ev)
    np.testing.assert_array_equal(q, before_q)
    np.testing.assert_array_equal(seq, [7, 12, 9] if case.get("ragged") else [10, 10, 10])  # not advanced
    assert out.shape == (B, Lq, Hq, D) and lse.shape == (B, Hq, Lq)
    assert_close(out, eo, np.float32)
    assert_close(lse, el, np.float32, what="lse")


def test_with_kvcache_matches_attention_with_kvcache(rng):
    kc, vc = _cache_setup(rng)
    kc2, vc2 = kc.copy(), vc.copy()
    q, k, v = randn(rng, (3, 1, 4, 16)), randn(rng, (3, 1, 2, 16)), randn(rng, (3, 1, 2, 16))
    seq = np.array([4, 9, 20])
    a = fc.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seq, causal=True)
    b = fastattn.attention_with_kvcache(q, kc2, vc2, seq, k, v, is_causal=True, layout="bshd")
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(kc, kc2)


def test_with_kvcache_int_seqlens_none_seqlens_and_short_causal_rows(rng):
    kc, vc = _cache_setup(rng, B=2, S=8)
    q = randn(rng, (2, 5, 4, 16))
    # cache_seqlens None: the whole cache is valid (no k/v allowed).
    out = fc.flash_attn_with_kvcache(q, kc, vc)
    assert_close(out, _oracle(q, kc, vc)[0], np.float32)
    with pytest.raises(ValueError, match="cache_seqlens"):
        fc.flash_attn_with_kvcache(q, kc, vc, q[:, :1, :2], q[:, :1, :2])
    # An int; 5 queries over 3 keys under causal: the first two rows see no key (zeros), as flash-attn.
    out = fc.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=3, causal=True)
    valid = np.zeros((2, 8), bool)
    valid[:, :3] = True
    assert_close(out, _oracle(q, kc, vc, causal=True, valid=valid)[0], np.float32)
    assert np.all(out[:, :2] == 0)


def test_with_kvcache_16bit_cache_and_overflow(rng):
    kc, vc = (a.astype(np.float16) for a in _cache_setup(rng, B=2, S=8))
    q, k, v = randn(rng, (2, 1, 4, 16)), randn(rng, (2, 1, 2, 16)), randn(rng, (2, 1, 2, 16))
    seq = np.array([2, 5])
    out = fc.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seq, causal=True)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(kc[1, 5], k[1, 0].astype(np.float16))
    before = kc.copy(), vc.copy()
    bad = k.copy()
    bad[1, 0, 0, 3] = 1e6  # beyond float16
    with pytest.raises(ValueError, match="range"):
        fc.flash_attn_with_kvcache(q, kc, vc, bad, v, cache_seqlens=seq + 1, causal=True)
    np.testing.assert_array_equal(kc, before[0])
    np.testing.assert_array_equal(vc, before[1])


def test_with_kvcache_bad_arguments_write_nothing(rng):
    kc, vc = _cache_setup(rng, B=2, S=8)
    before = kc.copy(), vc.copy()
    q, k, v = randn(rng, (2, 1, 4, 16)), randn(rng, (2, 1, 2, 16)), randn(rng, (2, 1, 2, 16))
    seq = np.array([2, 3])
    cos = np.ones((8, 8), np.float32)
    bad = [
        (ValueError, "rotary_cos and rotary_sin", dict(rotary_cos=cos)),
        (ValueError, "positions", dict(rotary_cos=cos[:3], rotary_sin=cos[:3])),
        (ValueError, r"block_table\[0, 0\] = 5", dict(block_table=np.full((2, 1), 5, np.int32))),
        (TypeError, "block_table", dict(block_table=np.zeros((2, 1), np.float32))),
        (
            ValueError,
            "same cache slot",
            dict(block_table=np.zeros((2, 1), np.int32), cache_seqlens=np.array([2, 2])),
        ),
        (ValueError, "exceeds", dict(cache_seqlens=np.array([2, 8]))),
        (ValueError, "cache_seqlens", dict(cache_seqlens=np.array([2, 9]))),
        (ValueError, "cache_seqlens", dict(cache_seqlens=np.array([1, 2, 3]))),
        (TypeError, "cache_seqlens", dict(cache_seqlens=np.array([1.0, 2.0]))),
        (ValueError, "repeat", dict(cache_batch_idx=np.array([1, 1]))),
        (ValueError, "cache_batch_idx", dict(cache_batch_idx=np.array([0, 2]))),
        (ValueError, "cache_leftpad", dict(cache_leftpad=np.array([0, 4]))),
        (ValueError, "softcap", dict(softcap=-2.0)),
        (ValueError, "window_size", dict(window_size=(0, -3))),
        (ValueError, "alibi_slopes", dict(alibi_slopes=np.ones((3, 4)))),
        (TypeError, "scale", dict(softmax_scale=[1.0])),
        (TypeError, "num_splits", dict(num_splits=1.5)),
        (TypeError, "return_softmax_lse", dict(return_softmax_lse=None)),
    ]
    for exc, match, kw in bad:
        kw.setdefault("cache_seqlens", seq)
        with pytest.raises(exc, match=match):
            fc.flash_attn_with_kvcache(q, kc, vc, k, v, **kw)
        np.testing.assert_array_equal(kc, before[0], err_msg=str(kw))
        np.testing.assert_array_equal(vc, before[1], err_msg=str(kw))
    with pytest.raises(ValueError, match="together"):
        fc.flash_attn_with_kvcache(q, kc, vc, k, None, cache_seqlens=seq)
    with pytest.raises(ValueError, match="writable"):
        ro = kc.copy()
        ro.flags.writeable = False
        fc.flash_attn_with_kvcache(q, ro, vc, k, v, cache_seqlens=seq)
    with pytest.raises(ValueError, match="share memory"):
        fc.flash_attn_with_kvcache(q, kc, kc, k, k, cache_seqlens=seq)
    with pytest.raises(TypeError, match="q must have dtype"):
        fc.flash_attn_with_kvcache(q.astype(np.float64), kc, vc, k, v, cache_seqlens=seq)
    with pytest.raises(ValueError, match="cache_batch_idx"):
        fc.flash_attn_with_kvcache(randn(rng, (3, 1, 4, 16)), kc, vc, cache_seqlens=2)
    np.testing.assert_array_equal(kc, before[0])


# --------------------------------------------------------------- torch tensors
def test_torch_tensors_in_and_out(rng):
    torch = optional("torch")
    import ml_dtypes

    q, k, v, _ = _inputs(rng, dict(causal=True, gqa=True))
    tq, tk, tv = (torch.from_numpy(a).to(torch.bfloat16) for a in (q, k, v))
    out = fc.flash_attn_func(tq, tk, tv, causal=True)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
    nq, nk, nv = (t.view(torch.int16).numpy().view(ml_dtypes.bfloat16) for t in (tq, tk, tv))
    np.testing.assert_array_equal(
        out.view(torch.int16).numpy(), fc.flash_attn_func(nq, nk, nv, causal=True).view(np.int16)
    )
    # KV cache tensors are written in place through the zero-copy view.
    kc, vc = (torch.zeros((2, 8, 2, 16)) for _ in range(2))
    tq1, tk1, tv1 = (torch.from_numpy(randn(rng, s)) for s in ((2, 1, 4, 16), (2, 1, 2, 16), (2, 1, 2, 16)))
    out, lse = fc.flash_attn_with_kvcache(
        tq1, kc, vc, tk1, tv1, cache_seqlens=torch.tensor([0, 3], dtype=torch.int32), return_softmax_lse=True
    )
    assert isinstance(out, torch.Tensor) and isinstance(lse, torch.Tensor)
    assert torch.equal(kc[1, 3], tk1[1, 0]) and torch.equal(vc[0, 0], tv1[0, 0])
    # flash_attn_with_kvcache has no backward (nor has flash-attn's): a tensor that
    # requires grad is refused while autograd records
    t = torch.ones((1, 4, 2, 8), requires_grad=True)
    c = torch.zeros((1, 8, 2, 8))
    with pytest.raises(RuntimeError, match="no_grad"):
        fc.flash_attn_with_kvcache(t, c, c)
    with torch.no_grad():
        fc.flash_attn_with_kvcache(t, c, c)


def test_with_kvcache_rotary_tables_as_bf16_tensors():
    """flash-attn's tests pass rotary cos/sin as bf16 tensors: taken as the same float32
    tables (the rotation is the same as with those tables given as arrays)."""
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(0)
    B, S, Hk, Hq, D = 2, 32, 2, 4, 16
    q = torch.randn(B, 1, Hq, D, generator=gen).to(torch.bfloat16)
    k = torch.randn(B, 1, Hk, D, generator=gen).to(torch.bfloat16)
    v = torch.randn(B, 1, Hk, D, generator=gen).to(torch.bfloat16)
    cos, sin = (
        torch.from_numpy(np.asarray(t, np.float32)).to(torch.bfloat16) for t in fastattn.rotary_cos_sin(S, D)
    )
    seq = torch.tensor([3, 5], dtype=torch.int32)
    outs = []
    for c, s in ((cos, sin), (cos.float().numpy(), sin.float().numpy())):
        kc = torch.zeros(B, S, Hk, D, dtype=torch.bfloat16)
        vc = torch.zeros_like(kc)
        outs.append(
            fc.flash_attn_with_kvcache(
                q, kc, vc, k, v, rotary_cos=c, rotary_sin=s, cache_seqlens=seq, causal=True
            )
        )
    assert outs[0].dtype == torch.bfloat16
    assert torch.equal(outs[0], outs[1])


def test_window_size_as_array_or_tensor(rng):
    """window_size given as a 2-value integer array (or CPU tensor) is the same pair."""
    q, k, v = randn(rng, (1, 20, 2, 16)), randn(rng, (1, 20, 2, 16)), randn(rng, (1, 20, 2, 16))
    want = fc.flash_attn_func(q, k, v, causal=True, window_size=(3, 0))
    np.testing.assert_array_equal(
        fc.flash_attn_func(q, k, v, causal=True, window_size=np.array([3, 0])), want
    )
    torch = pytest.importorskip("torch")
    got = fc.flash_attn_func(q, k, v, causal=True, window_size=torch.tensor([3, 0]))
    np.testing.assert_array_equal(got, want)
    with pytest.raises(TypeError, match="window_size"):
        fc.flash_attn_func(q, k, v, window_size=np.array([3.0, 0.0]))


# --------------------------------------------------------------- gradients (torch autograd)
def _torch_oracle(q, k, v, *, causal=False, window=(-1, -1), softcap=0.0, alibi=None, scale=None):
    """flash-attn 2's rules (as _oracle) written with torch ops in float64, so torch's
    autograd differentiates them: an independent gradient.  q (B, Lq, H, D), k/v (B, S, Hk, D)."""
    torch = optional("torch")
    q, k, v = (t.double() for t in (q, k, v))
    B, Lq, H, D = q.shape
    S, Hk = k.shape[1], k.shape[2]
    G = H // Hk
    k, v = k.repeat_interleave(G, dim=2), v.repeat_interleave(G, dim=2)
    scale = 1 / D**0.5 if scale is None else scale
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(Lq)[:, None] + S - Lq
    j = torch.arange(S)[None, :]
    if alibi is not None:
        a = torch.as_tensor(np.asarray(alibi, np.float64))
        a = a[None, :, None, None] if a.ndim == 1 else a[:, :, None, None]
        s = s - a * (i - j).abs()
    keep = torch.ones(Lq, S, dtype=torch.bool)
    if causal:
        keep &= j <= i
    if window[0] >= 0:
        keep &= j >= i - window[0]
    if window[1] >= 0:
        keep &= j <= i + window[1]
    s = s.masked_fill(~keep, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a row with no key: zeros, as flash-attn
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


GRAD_CASES = [
    dict(),
    dict(causal=True),
    dict(causal=True, gqa=True, Lq=5),
    dict(window=(3, 1)),
    dict(softcap=2.0, causal=True),
    dict(alibi=True),
    dict(alibi=True, gqa=True, causal=True, Lq=4),
]


def _grad_inputs(torch, rng, case, dtype):
    B, S, D = 2, 9, 16
    Lq = case.get("Lq", S)
    Hk, H = (2, 4) if case.get("gqa") else (2, 2)
    q = torch.from_numpy(randn(rng, (B, Lq, H, D))).to(dtype).requires_grad_()
    k = torch.from_numpy(randn(rng, (B, S, Hk, D))).to(dtype).requires_grad_()
    v = torch.from_numpy(randn(rng, (B, S, Hk, D))).to(dtype).requires_grad_()
    kw = {n: case[n] for n in ("causal", "window", "softcap") if n in case}
    if case.get("alibi"):
        kw["alibi"] = np.abs(randn(rng, (B, H))).astype(np.float32)
    return q, k, v, kw


@pytest.mark.parametrize("case", GRAD_CASES, ids=lambda c: "-".join(f"{k}" for k in c) or "plain")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_flash_attn_func_gradients_match_torch_autograd(rng, case, dtype):
    """flash_attn_func is differentiable (flash-attn's is): dq, dk, dv against torch's
    autograd through the float64 oracle, every score option, GQA (the group's dK / dV
    summed), bottom-right causal with fewer queries than keys; bf16 tensors too."""
    torch = optional("torch")
    dt = getattr(torch, dtype)
    q, k, v, kw = _grad_inputs(torch, rng, case, dt)
    out = fc.flash_attn_func(q, k, v, **_flash_kw(kw))
    assert out.requires_grad and out.dtype == dt
    g = torch.from_numpy(randn(rng, tuple(out.shape))).to(dt)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), g)
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]  # the inputs' values, in float64
    want = torch.autograd.grad(_torch_oracle(*exact, **kw), exact, g.double())
    tol = 1e-4 if dtype == "float32" else 3e-2
    for got, ref, name in zip((dq, dk, dv), want, "qkv"):
        assert got.dtype == dt and got.shape == ref.shape
        assert_close(got.double().numpy(), ref.numpy(), tol=tol, what=f"d{name}")
    # the forward is the no-grad call's, bit for bit
    with torch.no_grad():
        plain = fc.flash_attn_func(q, k, v, **_flash_kw(kw))
    assert torch.equal(
        out.detach().view(torch.int16) if dtype == "bfloat16" else out.detach(),
        plain.view(torch.int16) if dtype == "bfloat16" else plain,
    )


def test_packed_functions_pass_gradients_to_the_packed_tensor(rng):
    """qkvpacked / kvpacked (dense and varlen): the gradient reaches the packed tensor,
    equal to the unpacked function's gradients."""
    torch = optional("torch")
    B, S, H, D = 2, 7, 2, 8
    qkv = torch.from_numpy(randn(rng, (B, S, 3, H, D))).requires_grad_()
    g = torch.from_numpy(randn(rng, (B, S, H, D)))
    (got,) = torch.autograd.grad(fc.flash_attn_qkvpacked_func(qkv, causal=True), qkv, g)
    parts = [qkv.detach()[:, :, i].clone().requires_grad_() for i in range(3)]
    want = torch.autograd.grad(fc.flash_attn_func(*parts, causal=True), parts, g)
    assert torch.equal(got, torch.stack(want, dim=2))
    q = torch.from_numpy(randn(rng, (B, S, H, D))).requires_grad_()
    kv = qkv.detach()[:, :, 1:].clone().requires_grad_()
    dq, dkv = torch.autograd.grad(fc.flash_attn_kvpacked_func(q, kv, causal=True), (q, kv), g)
    parts = [
        q.detach().clone().requires_grad_(),
        *(kv.detach()[:, :, i].clone().requires_grad_() for i in range(2)),
    ]
    want = torch.autograd.grad(fc.flash_attn_func(*parts, causal=True), parts, g)
    assert torch.equal(dq, want[0]) and torch.equal(dkv, torch.stack(want[1:], dim=2))
    # varlen: two sequences of 3 and 4 tokens
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    qkv = torch.from_numpy(randn(rng, (7, 3, H, D))).requires_grad_()
    g = torch.from_numpy(randn(rng, (7, H, D)))
    (got,) = torch.autograd.grad(fc.flash_attn_varlen_qkvpacked_func(qkv, cu, 4, causal=True), qkv, g)
    parts = [qkv.detach()[:, i].clone().requires_grad_() for i in range(3)]
    want = torch.autograd.grad(fc.flash_attn_varlen_func(*parts, cu, cu, 4, 4, causal=True), parts, g)
    assert torch.equal(got, torch.stack(want, dim=1))
    q = torch.from_numpy(randn(rng, (7, H, D))).requires_grad_()
    kv = qkv.detach()[:, 1:].clone().requires_grad_()
    dq, dkv = torch.autograd.grad(fc.flash_attn_varlen_kvpacked_func(q, kv, cu, cu, 4, 4), (q, kv), g)
    parts = [
        q.detach().clone().requires_grad_(),
        *(kv.detach()[:, i].clone().requires_grad_() for i in range(2)),
    ]
    want = torch.autograd.grad(fc.flash_attn_varlen_func(*parts, cu, cu, 4, 4), parts, g)
    assert torch.equal(dq, want[0]) and torch.equal(dkv, torch.stack(want[1:], dim=1))


@pytest.mark.parametrize("case", [dict(causal=True), dict(window=(2, 0), softcap=3.0), dict(alibi=True)])
def test_varlen_gradients_per_sequence(rng, case):
    """flash_attn_varlen_func's gradients: each sequence's against torch's autograd through
    the oracle on that sequence alone (fewer queries than keys, bottom-right; per-sequence
    ALiBi slopes; GQA)."""
    torch = optional("torch")
    Hq, Hk, D = 4, 2, 16
    nq, nk = [3, 1, 5], [6, 4, 5]
    cq = np.concatenate([[0], np.cumsum(nq)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(nk)]).astype(np.int32)
    q = torch.from_numpy(randn(rng, (int(cq[-1]), Hq, D))).requires_grad_()
    k = torch.from_numpy(randn(rng, (int(ck[-1]), Hk, D))).requires_grad_()
    v = torch.from_numpy(randn(rng, (int(ck[-1]), Hk, D))).requires_grad_()
    kw = {n: case[n] for n in ("causal", "window", "softcap") if n in case}
    if case.get("alibi"):
        kw["alibi"] = np.abs(randn(rng, (3, Hq))).astype(np.float32)
    out = fc.flash_attn_varlen_func(
        q, k, v, torch.from_numpy(cq), torch.from_numpy(ck), 5, 6, **_flash_kw(kw)
    )
    g = torch.from_numpy(randn(rng, tuple(out.shape)))
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), g)
    for b in range(3):
        qs, ks = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        kb = dict(kw)
        if "alibi" in kb:
            kb["alibi"] = kb["alibi"][b : b + 1]
        parts = [t.detach()[s][None].clone().requires_grad_() for t, s in ((q, qs), (k, ks), (v, ks))]
        want = torch.autograd.grad(_torch_oracle(*parts, **kb), parts, g[qs][None].double())
        for got, ref, name in zip((dq[qs], dk[ks], dv[ks]), want, "qkv"):
            assert_close(got.numpy(), ref[0].numpy(), tol=1e-4, what=f"sequence {b} d{name}")


def test_gradient_options_and_refusals(rng):
    """return_attn_probs under autograd gives (out, lse, S_dmask) with the lse not
    differentiable; only the inputs that require grad get one; double backward and a
    paged varlen call that requires grad raise; under no_grad the plain call runs."""
    torch = optional("torch")
    q = torch.from_numpy(randn(rng, (1, 4, 2, 8))).requires_grad_()
    k, v = (torch.from_numpy(randn(rng, (1, 6, 2, 8))) for _ in range(2))
    out, lse, s = fc.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert out.requires_grad and not lse.requires_grad and s.numel() == 0
    mixed = fc.flash_attn_func(q, k.numpy(), v.numpy(), causal=True)  # arrays beside: constants
    assert torch.equal(mixed, out) and mixed.requires_grad
    _, want_lse, _ = fc.flash_attn_func(q.detach(), k, v, causal=True, return_attn_probs=True)
    assert torch.equal(lse, want_lse)
    out.sum().backward()
    assert q.grad is not None and k.grad is None
    (dq,) = torch.autograd.grad(fc.flash_attn_func(q, k, v).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        dq.sum().backward()
    bt = torch.zeros((1, 1), dtype=torch.int32)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    pool = torch.zeros((1, 16, 2, 8))
    # paged varlen (chunked prefill): the forward runs under grad, as flash-attn's does
    # (its test_flash_attn_varlen_causal passes a q that requires grad); the backward raises
    pool = torch.from_numpy(randn(rng, (1, 16, 2, 8)))
    ck = torch.tensor([0, 6], dtype=torch.int32)
    out, lse, _ = fc.flash_attn_varlen_func(
        q[0], pool, pool, cu, ck, 4, 6, block_table=bt, return_attn_probs=True
    )
    with torch.no_grad():
        want, want_lse, _ = fc.flash_attn_varlen_func(
            q[0], pool, pool, cu, ck, 4, 6, block_table=bt, return_attn_probs=True
        )
    assert out.requires_grad and torch.equal(out, want) and torch.equal(lse, want_lse)
    assert torch.equal(fc.flash_attn_varlen_func(q[0], pool, pool, cu, ck, 4, 6, block_table=bt), want)
    with pytest.raises(NotImplementedError, match="block_table has no backward"):
        out.sum().backward()


def _rotate(x, cos, sin, pos, interleaved):
    """flash-attn's rotary embedding of x (..., n, D) at positions pos (n,): the first
    2 * cos.shape[1] dims rotated, in halves or in interleaved pairs (float64)."""
    x = np.array(x, np.float64)
    r = cos.shape[1]
    c, s = cos[pos].astype(np.float64), sin[pos].astype(np.float64)
    if interleaved:
        a, b = x[..., 0 : 2 * r : 2].copy(), x[..., 1 : 2 * r : 2].copy()
        x[..., 0 : 2 * r : 2], x[..., 1 : 2 * r : 2] = a * c - b * s, a * s + b * c
    else:
        a, b = x[..., :r].copy(), x[..., r : 2 * r].copy()
        x[..., :r], x[..., r : 2 * r] = a * c - b * s, a * s + b * c
    return x


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("rot_frac", [1.0, 0.5])
def test_with_kvcache_rotary_with_cache_leftpad(rng, interleaved, causal, rot_frac):
    """Rotary with cache_leftpad, as flash-attn's test_flash_attn_kvcache checks it: the
    positions are cache slots (new key t at cache_seqlens + t; query i at cache_seqlens + i
    when causal, else cache_seqlens), the keys left of cache_leftpad are not attended, and
    causal is aligned to the bottom right of the slots."""
    B, S, Hq, Hk, D, Lq = 3, 24, 4, 2, 16, 3
    r = int(D * rot_frac) // 2
    ang = rng.uniform(0, 2 * np.pi, (S, r))
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    kc, vc = randn(rng, (B, S, Hk, D)), randn(rng, (B, S, Hk, D))
    q, k, v = randn(rng, (B, Lq, Hq, D)), randn(rng, (B, Lq, Hk, D)), randn(rng, (B, Lq, Hk, D))
    seq = np.array([5, 0, 12])
    left = np.array([2, 0, 7])
    want_k, want_v = kc.astype(np.float64), vc.astype(np.float64)
    qr = np.empty((B, Lq, Hq, D))
    for b in range(B):
        t = seq[b] + np.arange(Lq)
        want_k[b, t] = _rotate(k[b].swapaxes(0, 1), cos, sin, t, interleaved).swapaxes(0, 1)
        want_v[b, t] = v[b]
        qpos = t if causal else np.full(Lq, seq[b])
        qr[b] = _rotate(q[b].swapaxes(0, 1), cos, sin, qpos, interleaved).swapaxes(0, 1)
    kw = dict(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=interleaved, causal=causal)
    out = fc.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seq, cache_leftpad=left, **kw)
    assert_close(kc, want_k, tol=1e-5, what="k_cache")
    np.testing.assert_array_equal(vc, want_v.astype(np.float32))
    valid = (np.arange(S)[None] >= left[:, None]) & (np.arange(S)[None] < (seq + Lq)[:, None])
    ro, _ = _oracle(qr, want_k, want_v, causal=causal, valid=valid)
    assert_close(out, ro, tol=1e-4)


def test_forms_flash_attn_accepts_and_refuses(rng):
    """As flash-attn: max_seqlen given as a 0-d integer tensor or array is taken; q, k
    and v of different dtypes are refused (TypeError naming them); nested (jagged)
    tensors get a TypeError that says so (not NumPy's message about subclasses)."""
    torch = optional("torch")
    q = torch.from_numpy(randn(rng, (5, 2, 8)))
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    want = fc.flash_attn_varlen_func(q, q, q, cu, cu, 3, 3, causal=True)
    for m in (torch.tensor(3), np.array(3), (cu[1:] - cu[:-1]).max()):
        assert torch.equal(fc.flash_attn_varlen_func(q, q, q, cu, cu, m, m, causal=True), want)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        fc.flash_attn_varlen_func(q, q, q, cu, cu, torch.tensor(2), 3)
    with pytest.raises(TypeError, match="max_seqlen_q"):
        fc.flash_attn_varlen_func(q, q, q, cu, cu, torch.tensor(3.0), 3)
    h, b = (torch.from_numpy(randn(rng, (1, 4, 2, 8))).to(d) for d in (torch.float16, torch.bfloat16))
    with pytest.raises(TypeError, match="same dtype"):
        fc.flash_attn_func(h, b, b)
    with pytest.raises(TypeError, match="same dtype"):
        fc.flash_attn_varlen_func(q, q.half(), q.half(), cu, cu, 3, 3)
    nt = torch.nested.nested_tensor([torch.randn(3, 2, 8), torch.randn(5, 2, 8)], layout=torch.jagged)
    with pytest.raises(TypeError, match="nested"):
        fc.flash_attn_func(nt, nt, nt)
    from fastattn import torch_compat

    with pytest.raises(TypeError, match="nested"):
        torch_compat.scaled_dot_product_attention(nt, nt, nt)
