"""The per-call helpers that stand in for NumPy calls to save their fixed cost
(fastattn._checks: ``broadcast_view`` for ``np.broadcast_to``, ``int_bounds`` for an
integer array's min and max), checked against NumPy itself on random inputs: the
same view (shape, strides, memory, read-only), the same values, the same errors."""

from __future__ import annotations

import random
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from fastattn._checks import broadcast_view, int_bounds

DTYPES: list[Any] = [
    np.float32, np.int8, np.float64, np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn,
    np.bool_, ">f4", np.int64, np.uint64, object,
]  # fmt: skip


def _outcome(f: Any, a: Any, shape: Any) -> tuple[Any, Any]:
    try:
        return f(a, shape), None
    except Exception as e:  # the error itself is compared
        return None, (type(e), str(e))


def _random_case(rng: np.random.Generator, r: random.Random) -> tuple[np.ndarray, Any]:
    """A random array (contiguous, strided, reversed, a broadcast view, a subclass) and
    a random target shape (broadcastable or not, new leading dims, a list)."""
    nd = r.randint(0, 4)
    shp = tuple(r.choice([0, 1, 1, 2, 3]) for _ in range(nd))
    base = np.asarray(rng.standard_normal([s * 2 + 1 for s in shp]) * 10).astype(r.choice(DTYPES))

    def cut(s: int) -> slice:
        return r.choice([slice(0, s), slice(None, None, -1), slice(1, 2 * s + 1, 2), slice(0, s * 2, 2)])

    a = base[tuple(cut(s) for s in shp)][tuple(slice(0, s) for s in shp)] if nd else base
    u = r.random()
    if u < 0.3 and nd:
        a = np.broadcast_to(a[tuple(slice(0, 1) if r.random() < 0.5 else slice(None) for _ in shp)], a.shape)
    elif u < 0.4:
        a = np.ascontiguousarray(a)
    elif u < 0.45 and a.dtype != object:
        a = a.view(np.ma.MaskedArray)
    tgt: list[int] = [r.choice([1, 2, 3]) for _ in range(r.randint(0, 2))]
    tgt += [r.choice([s, s, 1, 2, 4, 0]) if s == 1 else r.choice([s, s, s, 1, 0, s + 1]) for s in a.shape]
    if r.random() < 0.1 and tgt:
        tgt = tgt[1:]
    return a, (tuple(tgt) if r.random() < 0.9 else tgt)


@pytest.mark.parametrize("seed", range(4))
def test_broadcast_view_is_numpys_broadcast_to(seed: int) -> None:
    rng, r = np.random.default_rng(seed), random.Random(seed)
    for _ in range(1500):
        a, shape = _random_case(rng, r)
        ref, ref_err = _outcome(np.broadcast_to, a, shape)
        got, got_err = _outcome(broadcast_view, a, shape)
        assert got_err == ref_err, (a.shape, a.strides, a.dtype, shape)
        if ref is None:
            continue
        assert type(got) is type(ref) and got.dtype == ref.dtype
        assert got.shape == ref.shape and got.strides == ref.strides, (a.shape, a.strides, shape)
        assert not got.flags.writeable
        assert got.__array_interface__["data"][0] == ref.__array_interface__["data"][0]
        if ref.size:
            assert (
                np.array_equal(got, ref)
                if ref.dtype == object
                else np.array_equal(got.astype(np.float64), ref.astype(np.float64), equal_nan=True)
            )


def test_broadcast_view_of_the_calls_stand_ins() -> None:
    """The shapes a paged call makes (one token of a pool over the gathered K/V, a
    stand-in of ones, a per-sequence scale over the keys): the same as broadcast_to."""
    pool = np.zeros((7, 8, 16, 128), np.int8)
    cases = [
        (pool[:1, :1, :1], (2, 8, 32, 128)),
        (np.broadcast_to(np.ones((1, 1, 1, 1), np.float32), (2, 8, 16, 1)), (2, 8, 16, 1)),
        (np.ones((4, 8, 16, 1), np.float32), (4, 8, 16, 128)),
        (np.ones((), np.float32), (3, 8, 5, 64)),
    ]
    for a, shape in cases:
        got, ref = broadcast_view(a, shape), np.broadcast_to(a, shape)
        assert got.shape == ref.shape and got.strides == ref.strides and not got.flags.writeable
        assert np.shares_memory(got, a)


@pytest.mark.parametrize(
    "values",
    [
        np.array([3, -1, 7], np.int64),
        np.array([[5]], np.int32),
        np.array([0, 2**64 - 1, 5], np.uint64),
        np.array([-(2**63), 2**63 - 1], np.int64),
        np.arange(200, dtype=np.int16)[::-3],
        np.array([1.5, -2.0]),
    ],
)
def test_int_bounds_is_min_and_max(values: np.ndarray) -> None:
    lo, hi = int_bounds(values)
    assert (lo, hi) == (int(values.min()), int(values.max()))
    assert type(lo) is int and type(hi) is int
