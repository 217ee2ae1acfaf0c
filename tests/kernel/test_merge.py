"""merge_attention_states, and the driver's split-KV decoding path checked
against chunked attention merged in Python and against the reference."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from conftest import assert_close, randn

import fastattn
from fastattn import reference as ref

sdpa = fastattn.scaled_dot_product_attention
merge = fastattn.merge_attention_states


def random_partition(rng, S, parts):
    """Sorted cut points splitting range(S) into ``parts`` pieces, some of them empty."""
    cuts = np.sort(rng.integers(0, S + 1, size=parts - 1))
    cuts[rng.integers(0, parts - 1)] = cuts[0]  # force at least one empty piece
    cuts = np.sort(cuts)
    return np.concatenate([[0], cuts, [S]])


# --- merge_attention_states -------------------------------------------------


@pytest.mark.parametrize("parts", [2, 3, 6])
def test_merge_random_partitions_float64(rng, parts):
    B, H, L, S, D = 2, 3, 5, 40, 7
    q, k, v = (
        randn(rng, (B, H, L, D), np.float64),
        randn(rng, (B, H, S, D), np.float64),
        randn(rng, (B, H, S, D), np.float64),
    )
    full_o, full_lse = ref.scaled_dot_product_attention(q, k, v, return_lse=True)
    cuts = random_partition(rng, S, parts)
    outs, lses = [], []
    for a, b in zip(cuts[:-1], cuts[1:]):
        o, lse = ref.scaled_dot_product_attention(q, k[:, :, a:b], v[:, :, a:b], return_lse=True)
        if a == b:  # an empty part: zeros and -inf
            assert np.all(np.isneginf(lse)) and np.all(o == 0)
        outs.append(o)
        lses.append(lse)
    o, lse = merge(outs, lses)
    assert o.dtype == np.float64 and lse.dtype == np.float64
    assert_close(o, full_o, np.float64)
    assert_close(lse, full_lse, np.float64, what="lse")
    # the parts stacked on axis 0 are accepted too
    o2, lse2 = merge(np.stack(outs), np.stack(lses))
    np.testing.assert_array_equal(o2, o)
    np.testing.assert_array_equal(lse2, lse)


def test_merge_fastattn_parts_float32_causal(rng):
    # Causal decode of 3 queries over 300 keys, computed in three fastattn calls over key chunks.
    B, Hq, Hk, L, S, D = 1, 4, 2, 3, 300, 16
    q, k, v = randn(rng, (B, Hq, L, D)), randn(rng, (B, Hk, S, D)), randn(rng, (B, Hk, S, D))
    full = ref.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, return_lse=True)
    # Causal restriction on the chunks: query i sees keys j <= i + S - L; only the last chunk is cut.
    cuts = [0, 120, 298, 300]
    outs, lses = [], []
    for a, b in zip(cuts[:-1], cuts[1:]):
        mask = np.arange(a, b)[None, :] <= np.arange(L)[:, None] + S - L
        o, lse = sdpa(q, k[:, :, a:b], v[:, :, a:b], attn_mask=mask, enable_gqa=True, return_lse=True)
        outs.append(o)
        lses.append(lse)
    o, lse = merge(outs, lses)
    assert o.dtype == np.float32 and lse.dtype == np.float32
    assert_close(o, full[0], np.float32)
    assert_close(lse, full[1], np.float32, what="lse")


def test_merge_all_parts_empty_rows():
    o = [np.ones((2, 3)), np.full((2, 3), 5.0)]
    lse = [np.array([-np.inf, 0.0]), np.array([-np.inf, -np.inf])]
    out, l2 = merge(o, lse)
    np.testing.assert_array_equal(out[0], 0.0)  # no part saw a key: zeros, -inf
    assert np.isneginf(l2[0])
    np.testing.assert_array_equal(out[1], 1.0)  # only part 0 counts
    assert l2[1] == 0.0


def test_merge_hand_worked():
    # Two parts with denominators e^0 = 1 and e^(ln 3) = 3: weights 1/4 and 3/4.
    outs = [np.array([[4.0, 0.0]]), np.array([[0.0, 8.0]])]
    out, lse = merge(outs, [np.array([0.0]), np.array([np.log(3.0)])])
    np.testing.assert_allclose(out, [[1.0, 6.0]], rtol=1e-15)
    np.testing.assert_allclose(lse, [np.log(4.0)], rtol=1e-15)


def test_merge_nan_propagates():
    o = [np.ones((3, 2), np.float32), np.ones((3, 2), np.float32)]
    lse = [np.array([0.0, np.nan, 1.0], np.float32), np.array([0.0, 0.0, -np.inf], np.float32)]
    o[1][0, 1] = np.nan  # a NaN value in a part that counts
    out, l2 = merge(o, lse)
    assert np.isnan(out[0, 1]) and out[0, 0] == 1.0
    assert np.all(np.isnan(out[1])) and np.isnan(l2[1])  # NaN LSE poisons the row
    np.testing.assert_array_equal(out[2], 1.0)
    assert l2[2] == np.float32(1.0)


def test_merge_overflowed_lse():
    out, lse = merge([np.ones((1, 2)), np.zeros((1, 2))], [np.array([np.inf]), np.array([0.0])])
    assert np.all(np.isnan(out)) and lse[0] == np.inf  # weights undefined: no silent zeros


def test_merge_keeps_16bit_dtype_and_inputs(rng):
    bf = np.dtype(ml_dtypes.bfloat16)
    o = [randn(rng, (2, 4, 8)).astype(bf) for _ in range(2)]
    lse = [randn(rng, (2, 4)) for _ in range(2)]
    copies = [a.copy() for a in o + lse]
    out, l2 = merge(o, lse)
    assert out.dtype == bf and l2.dtype == np.float32
    w = np.exp(np.stack(lse).astype(np.float64))
    expect = (w[0][..., None] * o[0].astype(np.float64) + w[1][..., None] * o[1].astype(np.float64)) / (
        w[0] + w[1]
    )[..., None]
    assert np.all(np.abs(out.astype(np.float64) - expect) <= 2**-8 * np.abs(expect) + 1e-6)
    for a, c in zip(o + lse, copies):
        np.testing.assert_array_equal(a, c)


def test_merge_bad_input():
    a, s = np.zeros((2, 3)), np.zeros(2)
    with pytest.raises(TypeError, match="outs"):
        merge(None, None)
    with pytest.raises(ValueError, match="outs"):
        merge([], [])
    with pytest.raises(ValueError, match="same number"):
        merge([a, a], [s])
    with pytest.raises(ValueError, match=r"outs\[1\]"):
        merge([a, np.zeros((2, 4))], [s, s])
    with pytest.raises(ValueError, match=r"lses\[0\]"):
        merge([a], [np.zeros(3)])
    with pytest.raises(TypeError, match=r"outs\[0\]"):
        merge([a.astype(int)], [s])
    with pytest.raises(TypeError, match=r"lses\[0\]"):
        merge([a], [s.astype(int)])


# --- split-KV decoding in the driver -----------------------------------------


@pytest.mark.parametrize("S,D,Hk,G", [(1024, 64, 2, 4), (4100, 17, 1, 3), (2500, 80, 2, 1)])
def test_split_kv_decode_equals_chunks_and_reference(isa, rng, S, D, Hk, G):
    # q (1, Hq, 1, D), S >= 1024, few kv heads: B*Hk*query-blocks < 16, so the keys are split.
    Hq = Hk * G
    q, k, v = randn(rng, (1, Hq, 1, D)), randn(rng, (1, Hk, S, D)), randn(rng, (1, Hk, S, D))
    o, lse = sdpa(q, k, v, enable_gqa=G > 1, return_lse=True)
    ro, rlse = ref.scaled_dot_product_attention(q, k, v, enable_gqa=G > 1, return_lse=True)
    assert_close(o, ro, np.float32)
    assert_close(lse, rlse, np.float32, what="lse")
    # The same attention as 5 chunk calls (each small enough not to split), merged in Python.
    cuts = np.linspace(0, S, 6).astype(int)
    parts = [
        sdpa(q, k[:, :, a:b], v[:, :, a:b], enable_gqa=G > 1, return_lse=True)
        for a, b in zip(cuts[:-1], cuts[1:])
    ]
    mo, mlse = merge([p[0] for p in parts], [p[1] for p in parts])
    np.testing.assert_allclose(o, mo, rtol=0, atol=1e-5 * np.abs(ro).max())
    np.testing.assert_allclose(lse, mlse, rtol=2e-6, atol=0)
    # Unsplit: 16 identical batch rows (a stride-0 view) give enough tasks that nothing splits.
    qb, kb, vb = (np.broadcast_to(a, (16,) + a.shape[1:]) for a in (q, k, v))
    ob, lseb = sdpa(qb, kb, vb, enable_gqa=G > 1, return_lse=True)
    np.testing.assert_allclose(o[0], ob[7], rtol=0, atol=1e-5 * np.abs(ro).max())
    np.testing.assert_allclose(lse[0], lseb[7], rtol=2e-6, atol=0)


def test_split_kv_with_key_lengths_and_causal(isa, rng):
    # Some split parts lie wholly past a sequence's length: they must count as empty (-inf).
    B, Hq, Hk, L, S, D = 2, 2, 1, 2, 3000, 32
    q, k, v = randn(rng, (B, Hq, L, D)), randn(rng, (B, Hk, S, D)), randn(rng, (B, Hk, S, D))
    kl = np.array([700, 2999])
    o, lse = sdpa(q, k, v, enable_gqa=True, is_causal=True, key_lengths=kl, return_lse=True)
    ro, rlse = ref.scaled_dot_product_attention(
        q, k, v, enable_gqa=True, is_causal=True, key_lengths=kl, return_lse=True
    )
    assert_close(o, ro, np.float32)
    assert_close(lse, rlse, np.float32, what="lse")


def test_split_kv_bit_identical_across_threads(rng):
    q, k, v = randn(rng, (1, 2, 1, 64)), randn(rng, (1, 2, 2048, 64)), randn(rng, (1, 2, 2048, 64))
    o1 = sdpa(q, k, v, num_threads=1)
    o2 = sdpa(q, k, v, num_threads=2)
    o3 = sdpa(q, k, v, num_threads=7)
    np.testing.assert_array_equal(o1, o2)
    np.testing.assert_array_equal(o1, o3)
