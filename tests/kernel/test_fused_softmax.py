"""The prefill path's one-pass softmax (softmax_row_lazy in csrc/kernel_impl.h).

Whole, unmasked key tiles take their online softmax in one pass right after
their Q.K^T (softmax_block), and partial tiles (the causal diagonal, window
edges) right after their mask; each keeps a row's reference max while every score is below it plus
FA_SM_SLACK (8 in log2 units: P < 2^8), and falling back to the exact max
otherwise: the row's first tile, a max that jumps, NaN scores.  These
cases put the jump at keys all over the tiles (64-key tiles on AVX2 and the
scalar kernels, 128 on AVX-512), let the max creep up in steps below and
above the slack, and compare with the float64 reference on every ISA path.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import check_sdpa, randn

import fastattn

sdpa = fastattn.scaled_dot_product_attention


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("spike", [0, 5, 17, 40, 63, 64, 100, 130, 200, 255, 300, 383, 470, 511])
def test_max_jumps_at_any_key(isa, rng, dtype, spike):
    # A score of at least 120 (173 in log2 units: exp2 overflows float32 unless
    # the reference moves) at one key, O(1) elsewhere:
    # the row's reference moves there, rescaling what came before; the output
    # is that key's value row.
    q = randn(rng, (1, 2, 40, 16), dtype, scale=0.25)
    q[..., 0] = 4.0 + np.abs(q[..., 0])
    k = randn(rng, (1, 2, 512, 16), dtype, scale=0.25)
    k[:, :, spike, 0] = 30.0
    v = randn(rng, (1, 2, 512, 24), dtype)
    o, _ = check_sdpa(q, k, v, scale=1.0)
    np.testing.assert_allclose(o, np.broadcast_to(v[:, :, spike : spike + 1], o.shape), rtol=0, atol=1e-3)


@pytest.mark.parametrize("step", [0.5, 2.0, 6.0, 7.5, 9.0, 30.0])
def test_max_creeps_up_tile_by_tile(isa, rng, step):
    # Scores grow by `step` (natural units) every 16 keys: below the slack
    # the reference stays behind the max and P grows past 1; above it every
    # tile moves the reference.
    L, S, D = 24, 512, 8
    q = np.zeros((1, 1, L, D), np.float32)
    q[..., 0] = 1.0
    k = randn(rng, (1, 1, S, D), scale=0.1)
    k[0, 0, :, 0] = step * (np.arange(S) // 16) / 16.0
    k[0, 0, :, 0] += randn(rng, (S,), scale=0.1)
    v = randn(rng, (1, 1, S, 16))
    for scale in (1.0, 16.0 / max(step, 1.0)):
        check_sdpa(q, k, v, scale=scale)


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_nan_score_in_a_fused_tile(isa, rng, where):
    # A NaN in one key row makes that key's score NaN for every query: every
    # output row is NaN, whichever panel and tile it falls in.
    S = 384
    j = {"first": 3, "middle": 200, "last": S - 1}[where]
    q = randn(rng, (1, 2, 30, 32))
    k = randn(rng, (1, 2, S, 32))
    v = randn(rng, (1, 2, S, 32))
    k[0, 1, j, 5] = np.nan
    o = sdpa(q, k, v)
    assert np.all(np.isnan(o[0, 1]))
    assert np.all(np.isfinite(o[0, 0]))
    check_sdpa(q, k, v, lse_too=False)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n_inf", [1, 64, 130, 256, 300])
def test_minus_inf_scores_in_the_first_tiles(isa, rng, dtype, n_inf):
    # -inf in the first n_inf key rows makes those scores -inf for every query
    # (a positive q . k elsewhere): whole tiles of -inf before any finite
    # score must leave the row empty (P = 0), not NaN from exp2(-inf - -inf).
    q = randn(rng, (1, 2, 20, 8), dtype)
    q[..., 0] = 1.0 + np.abs(q[..., 0])
    k = randn(rng, (1, 2, 400, 8), dtype)
    k[:, :, :n_inf, 0] = -np.inf
    v = randn(rng, (1, 2, 400, 8), dtype)
    o, _ = check_sdpa(q, k, v)
    assert np.all(np.isfinite(o))


def test_large_uniform_scores(isa, rng):
    # Every score near 1e4 (log2 units): the first panel sets the reference,
    # the rest stay within the slack; nothing overflows.
    q = np.full((1, 1, 20, 4), 50.0, np.float32)
    k = np.full((1, 1, 300, 4), 50.0, np.float32) + randn(rng, (1, 1, 300, 4), scale=1e-3)
    v = randn(rng, (1, 1, 300, 8))
    check_sdpa(q, k, v, scale=1.0)


def test_fused_and_masked_tiles_together(isa, rng):
    # Fused tiles before and after the causal diagonal's partial tiles, and a
    # last tile shorter than a whole one, in one row.
    q = randn(rng, (2, 2, 150, 24))
    k = randn(rng, (2, 2, 300, 24))
    v = randn(rng, (2, 2, 300, 24))
    check_sdpa(q, k, v, is_causal=True)
    check_sdpa(q, k, v)


def test_thread_counts_bit_identical_on_fused_tiles(isa, rng):
    q = randn(rng, (1, 4, 300, 64))
    k = randn(rng, (1, 4, 700, 64))
    v = randn(rng, (1, 4, 700, 64))
    k[0, 2, 450] *= 20.0  # a jump in a later tile
    ref = sdpa(q, k, v, num_threads=1)
    for nt in (2, 3):
        np.testing.assert_array_equal(sdpa(q, k, v, num_threads=nt), ref)


# ---- Partial tiles: the causal diagonal and window edges (masked, then one pass)


@pytest.mark.parametrize("spike", [0, 7, 63, 64, 65, 127, 128, 150, 200, 255, 299])
def test_max_jumps_on_the_causal_diagonal(isa, rng, spike):
    # One dominant key: rows at or past it (bottom-right causal, L == S) see
    # it and output its value row, whichever diagonal tile and register block
    # it falls in; rows before it never see it.
    L = S = 300
    q = randn(rng, (1, 2, L, 16), scale=0.25)
    q[..., 0] = 4.0 + np.abs(q[..., 0])
    k = randn(rng, (1, 2, S, 16), scale=0.25)
    k[:, :, spike, 0] = 30.0
    v = randn(rng, (1, 2, S, 24))
    o, _ = check_sdpa(q, k, v, scale=1.0, is_causal=True)
    seen = o[:, :, spike:]
    want = np.broadcast_to(v[:, :, spike : spike + 1], seen.shape)
    np.testing.assert_allclose(seen, want, rtol=0, atol=1e-3)


@pytest.mark.parametrize("step", [0.5, 6.0, 7.5, 9.0, 30.0])
@pytest.mark.parametrize("mask", ["causal", "window"])
def test_max_creeps_up_over_partial_tiles(isa, rng, step, mask):
    # Scores grow by `step` every 16 keys, so that each row's newest keys (the
    # partial tiles' visible part) hold its max: below the slack the
    # reference stays behind it, above it every diagonal tile moves it.
    L = S = 400
    q = np.zeros((1, 1, L, 8), np.float32)
    q[..., 0] = 1.0
    k = randn(rng, (1, 1, S, 8), scale=0.1)
    k[0, 0, :, 0] = step * (np.arange(S) // 16) / 16.0 + randn(rng, (S,), scale=0.1)
    v = randn(rng, (1, 1, S, 16))
    kw = {"is_causal": True} if mask == "causal" else {"window": (70, 0)}
    for scale in (1.0, 16.0 / max(step, 1.0)):
        check_sdpa(q, k, v, scale=scale, **kw)


@pytest.mark.parametrize("j", [5, 64, 130, 299])
def test_nan_key_on_the_causal_diagonal(isa, rng, j):
    # A NaN key row poisons exactly the rows that see it (i >= j).
    q = randn(rng, (1, 1, 300, 32))
    k = randn(rng, (1, 1, 300, 32))
    v = randn(rng, (1, 1, 300, 32))
    k[0, 0, j, 3] = np.nan
    o = sdpa(q, k, v, is_causal=True)
    assert np.all(np.isnan(o[0, 0, j:]))
    assert np.all(np.isfinite(o[0, 0, :j]))
    check_sdpa(q, k, v, is_causal=True, lse_too=False)


@pytest.mark.parametrize("n_inf", [1, 40, 64, 130, 200])
def test_minus_inf_keys_before_the_diagonal(isa, rng, n_inf):
    # -inf scores at the first n_inf keys: rows that see only those have no
    # finite score (the reference's empty-row result), the rest start their
    # softmax on a diagonal tile past -inf ones.
    q = randn(rng, (1, 2, 260, 8))
    q[..., 0] = 1.0 + np.abs(q[..., 0])
    k = randn(rng, (1, 2, 260, 8))
    k[:, :, :n_inf, 0] = -np.inf
    v = randn(rng, (1, 2, 260, 8))
    o, _ = check_sdpa(q, k, v, is_causal=True)
    assert np.all(np.isfinite(o[:, :, n_inf:]))


def test_partial_tiles_with_alibi_and_softcap(isa, rng):
    # The per-element variants take the partial tiles' one pass too (ALiBi's
    # bias and the soft cap are applied by the mask before it).
    q = randn(rng, (1, 2, 200, 16))
    k = randn(rng, (1, 2, 200, 16))
    v = randn(rng, (1, 2, 200, 16))
    check_sdpa(q, k, v, is_causal=True, alibi_slopes=np.array([0.5, 0.0625], np.float32))
    check_sdpa(q, k, v, is_causal=True, softcap=2.0)
    check_sdpa(q, k, v, window=(50, 10), softcap=5.0)


def test_thread_counts_bit_identical_on_partial_tiles(isa, rng):
    q = randn(rng, (2, 3, 333, 64))
    k = randn(rng, (2, 3, 333, 64))
    v = randn(rng, (2, 3, 333, 64))
    k[1, 2, 200] *= 20.0
    ref = sdpa(q, k, v, is_causal=True, num_threads=1)
    for nt in (2, 3):
        np.testing.assert_array_equal(sdpa(q, k, v, is_causal=True, num_threads=nt), ref)
