"""The prefill path's register blocks: the query operand packed per block of
rows (near-equal blocks of at most the kernel's row count, groups of 8 rows
transposed together, a last group of fewer), the last K panel only as wide as
its keys, against the float64 reference on every ISA path.

Rows per task of 9..40 cover one and several blocks and every partial group
of the 12-row (AVX-512), 6-row (AVX2) and 4-row (scalar) blocks; head dims
around 8 and 16 the 8 x 8 transposes and their scalar tails; key counts
around the panel widths every last-panel width."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import check_sdpa, optional, randn

import fastattn
from fastattn import reference as ref

sdpa = fastattn.scaled_dot_product_attention


@pytest.mark.parametrize("L", [9, 11, 13, 15, 16, 17, 23, 25, 40])
@pytest.mark.parametrize("D", [1, 7, 8, 9, 16, 24, 64, 72])
def test_rows_and_head_dims(isa, rng, L, D):
    q = randn(rng, (1, 2, L, D))
    k = randn(rng, (1, 2, 33, D))
    v = randn(rng, (1, 2, 33, 16))
    check_sdpa(q, k, v)


@pytest.mark.parametrize("S", [1, 5, 8, 15, 16, 17, 31, 32, 33, 47, 48, 63, 64, 65, 127, 128, 129])
def test_last_panel_widths(isa, rng, S):
    q = randn(rng, (1, 1, 20, 24))
    k = randn(rng, (1, 1, S, 24))
    v = randn(rng, (1, 1, S, 24))
    check_sdpa(q, k, v)
    check_sdpa(q, k, v, is_causal=True)


@pytest.mark.parametrize("G", [2, 3, 5])
def test_blocks_across_grouped_heads(isa, rng, G):
    # A register block spans the end of one query head and the start of the
    # next (rows of a task stack G heads): each row reads its own head.
    q = randn(rng, (2, 2 * G, 7, 40))
    k = randn(rng, (2, 2, 50, 40))
    v = randn(rng, (2, 2, 50, 24))
    check_sdpa(q, k, v, enable_gqa=True)


@pytest.mark.parametrize("qdt", [np.float16, "bfloat16"])
def test_sixteen_bit_queries(isa, rng, qdt):
    # Queries of another dtype are converted row by row into the packed block.
    # The output is rounded to 16 bits (and bfloat16 may run on the matrix
    # units with bf16 products), so the bound is loose: a row packed in the
    # wrong place is off by O(1).
    tol = 4e-3
    if qdt == "bfloat16":
        ml_dtypes = optional("ml_dtypes")
        qdt, tol = ml_dtypes.bfloat16, 3e-2
    q = randn(rng, (1, 3, 14, 40)).astype(qdt)
    k = randn(rng, (1, 3, 40, 40)).astype(qdt)
    v = randn(rng, (1, 3, 40, 40)).astype(qdt)
    o = sdpa(q, k, v)
    ro = ref.scaled_dot_product_attention(q, k, v)
    assert o.dtype == np.dtype(qdt)
    np.testing.assert_allclose(o.astype(np.float64), ro, rtol=0, atol=tol * np.abs(ro).max())


def test_strided_queries(isa, rng):
    # Rows of a non-contiguous query (a slice of a wider array) are read in place.
    big = randn(rng, (1, 2, 30, 100))
    q = big[:, :, 3:22, 10:74]
    k = randn(rng, (1, 2, 45, 64))
    v = randn(rng, (1, 2, 45, 64))
    check_sdpa(q, k, v)


def test_thread_counts_bit_identical(isa, rng):
    q = randn(rng, (2, 4, 37, 72))
    k = randn(rng, (2, 4, 70, 72))
    v = randn(rng, (2, 4, 70, 72))
    ref = sdpa(q, k, v, num_threads=1)
    for nt in (2, 3):
        np.testing.assert_array_equal(sdpa(q, k, v, num_threads=nt), ref)


# Partial tiles (the causal diagonal, a window's edge, a key length inside the
# tile): each register block computes only the keys some row of it may see
# (block_keys in kernel_impl.h) and leaves the rest to the mask.  A block whose
# span is too narrow drops visible keys; these cases put block edges, panel
# edges and tile edges at many offsets from the band's edges.


@pytest.fixture(params=[None, 24, 40, 100])
def rows(request):
    # the default row block and forced ones (several blocks per task, tasks
    # that start inside a tile)
    fastattn.set_tiles(request.param)
    yield request.param
    fastattn.set_tiles(None)


@pytest.mark.parametrize("L,S", [(37, 37), (130, 130), (50, 63), (63, 50), (140, 300), (12, 200)])
def test_causal_diagonal_blocks(isa, rng, rows, L, S):
    q = randn(rng, (1, 2, L, 24))
    k = randn(rng, (1, 2, S, 24))
    v = randn(rng, (1, 2, S, 40))
    check_sdpa(q, k, v, is_causal=True)


@pytest.mark.parametrize("window", [(0, 0), (5, 3), (17, -1), (-1, 9), (40, 40), (130, 2)])
def test_window_edge_blocks(isa, rng, rows, window):
    q = randn(rng, (1, 2, 150, 16))
    k = randn(rng, (1, 2, 170, 16))
    v = randn(rng, (1, 2, 170, 16))
    check_sdpa(q, k, v, window=window)


@pytest.mark.parametrize("G,L", [(2, 7), (3, 13), (5, 30)])
def test_diagonal_blocks_across_grouped_heads(isa, rng, rows, G, L):
    # A block that spans two heads covers every position of the task.
    q = randn(rng, (2, 2 * G, L, 32))
    k = randn(rng, (2, 2, L + 5, 32))
    v = randn(rng, (2, 2, L + 5, 32))
    check_sdpa(q, k, v, is_causal=True, enable_gqa=True)
    check_sdpa(q, k, v, window=(6, 2), enable_gqa=True)


def test_key_lengths_and_masks_on_partial_tiles(isa, rng, rows):
    # Key lengths end inside a tile; with a float mask or ALiBi every element
    # is masked on its own, and causal still makes the diagonal tiles partial.
    q = randn(rng, (3, 2, 90, 32))
    k = randn(rng, (3, 2, 150, 32))
    v = randn(rng, (3, 2, 150, 32))
    lens = np.array([150, 77, 131])
    check_sdpa(q, k, v, is_causal=True, key_lengths=lens)
    mask = randn(rng, (3, 2, 90, 150))
    check_sdpa(q, k, v, attn_mask=mask, is_causal=True)
    check_sdpa(q, k, v, is_causal=True, alibi_slopes=np.array([0.5, 0.125]), window=(33, 0))
