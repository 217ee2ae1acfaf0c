"""Bad arguments raise TypeError/ValueError naming the argument, before any C
code runs (the kernel entry point is replaced by a tripwire here)."""

from __future__ import annotations

import numpy as np
import pytest

import fastattn
from fastattn import _kernels

sdpa = fastattn.scaled_dot_product_attention


class KernelCalled(Exception):
    pass


@pytest.fixture(autouse=True)
def tripwire(monkeypatch):
    def boom(*args, **kwargs):
        raise KernelCalled("the C kernel was reached with a bad argument")

    monkeypatch.setattr(_kernels, "attention", boom)


def t(*shape, dtype=np.float32):
    return np.zeros(shape, dtype)


Q, K, V = t(2, 4, 8, 16), t(2, 4, 10, 16), t(2, 4, 10, 16)


def check(exc, match, *args, **kw):
    with pytest.raises(exc, match=match):
        sdpa(*args, **kw)


def test_tripwire_works():
    with pytest.raises(KernelCalled):
        sdpa(Q, K, V)


@pytest.mark.parametrize(
    "args,match",
    [
        ((t(16), K, V), "query"),
        ((t(1, 16), t(2, 10, 16), V), "dimensions"),
        ((Q, t(4, 10, 16), V), "dimensions"),
        ((Q, K, t(2, 4, 10)), "dimensions"),
        ((Q, t(2, 4, 10, 15), V), "head dim"),
        ((Q, t(3, 4, 10, 16), t(3, 4, 10, 16)), "batch"),
        ((t(2, 3, 4, 8, 16), t(2, 2, 4, 10, 16), t(2, 2, 4, 10, 16)), "batch"),
        ((Q, K, t(2, 4, 11, 16)), "key and value"),
        ((Q, K, t(2, 2, 10, 16)), "key and value"),
        ((Q, t(2, 2, 10, 16), t(2, 2, 10, 16)), "enable_gqa"),
        ((t(2, 4, 8, 0), t(2, 4, 10, 0), V), "head dim"),
        ((Q, K, t(2, 4, 10, 0)), "head dim"),
    ],
)
def test_shapes(args, match):
    check(ValueError, match, *args)


def test_gqa_not_divisible():
    check(ValueError, "multiple", t(1, 6, 8, 16), t(1, 4, 10, 16), t(1, 4, 10, 16), enable_gqa=True)


def test_bshd_needs_3_dims():
    check(ValueError, "query", t(8, 16), t(10, 16), t(10, 16), layout="bshd")


@pytest.mark.parametrize("dt", [np.int32, np.int64, np.uint8, np.complex64, np.bool_, object, "U3"])
@pytest.mark.parametrize("which", [0, 1, 2])
def test_bad_dtypes(dt, which):
    args = [Q, K, V]
    args[which] = np.zeros(args[which].shape, dtype=dt)
    name = ("query", "key", "value")[which]
    check(TypeError, name, *args)


def test_mixed_precision():
    check(TypeError, "float64", Q.astype(np.float64), K, V)
    check(TypeError, "float64", Q, K.astype(np.float64), V.astype(np.float64))
    check(TypeError, "key and value", Q, K, V.astype(np.float16))


@pytest.mark.parametrize("bad", [None, "abc", {"a": 1}, 3.0, [[1, 2], [3]]])
def test_not_arrays(bad):
    with pytest.raises((TypeError, ValueError), match="query"):
        sdpa(bad, K, V)


@pytest.mark.parametrize(
    "mask,exc",
    [
        (t(8, 9), ValueError),
        (t(3, 8, 10), ValueError),
        (t(2, 4, 8, 10, 1)[..., 0][None, None], ValueError),
        (np.zeros((8, 10), np.int32), TypeError),
        (np.zeros((8, 10), np.uint8), TypeError),
        (np.zeros((8, 10), np.complex64), TypeError),
        (np.zeros((8, 10), object), TypeError),
        ("mask", TypeError),
    ],
)
def test_bad_masks(mask, exc):
    check(exc, "attn_mask", Q, K, V, attn_mask=mask)


@pytest.mark.parametrize(
    "scale,exc",
    [
        (float("nan"), ValueError),
        (float("inf"), ValueError),
        (-float("inf"), ValueError),
        ("1", TypeError),
        (True, TypeError),
        (1j, TypeError),
        ([1.0], TypeError),
    ],
)
def test_bad_scale(scale, exc):
    check(exc, "scale", Q, K, V, scale=scale)


@pytest.mark.parametrize(
    "n,exc",
    [
        (0, ValueError),
        (-1, ValueError),
        (1.5, TypeError),
        (2.0, TypeError),
        ("2", TypeError),
        (True, TypeError),
    ],
)
def test_bad_num_threads(n, exc):
    check(exc, "num_threads", Q, K, V, num_threads=n)


def test_set_num_threads_bad():
    with pytest.raises(ValueError, match="num_threads"):
        fastattn.set_num_threads(0)
    with pytest.raises(TypeError, match="num_threads"):
        fastattn.set_num_threads(2.0)


@pytest.mark.parametrize("layout", ["BHSD", "bsdh", "", None, 1])
def test_bad_layout(layout):
    check(ValueError, "layout", Q, K, V, layout=layout)


def test_bad_isa():
    with pytest.raises(ValueError, match="isa"):
        fastattn.set_isa("sse9")


@pytest.mark.parametrize(
    "out,exc,match",
    [
        (t(2, 4, 8, 15), ValueError, "shape"),
        (t(2, 4, 8), ValueError, "shape"),
        (t(2, 4, 8, 16, dtype=np.float64), TypeError, "dtype"),
        (t(2, 4, 8, 16, dtype=np.float16), TypeError, "dtype"),
        ([[0.0]], TypeError, "out"),
    ],
)
def test_bad_out(out, exc, match):
    with pytest.raises(exc, match="out") as e:
        sdpa(Q, K, V, out=out)
    assert match in str(e.value)


def test_read_only_out():
    out = t(2, 4, 8, 16)
    out.flags.writeable = False
    check(ValueError, "out", Q, K, V, out=out)


def test_out_aliases_input():
    q = np.zeros((2, 4, 8, 16), np.float32)
    check(ValueError, "query", q, t(2, 4, 8, 16), t(2, 4, 8, 16), out=q)
    v = np.zeros((2, 4, 10, 16), np.float32)
    check(ValueError, "value", Q, K, v, out=v[:, :, 1:9])
    m = np.zeros((2, 4, 8, 16), np.float32)  # an out that overlaps a float mask of shape (L, S)
    check(ValueError, "attn_mask", Q, t(2, 4, 16, 16), t(2, 4, 16, 16), attn_mask=m[0, 0, :, :16], out=m)


@pytest.mark.parametrize(
    "p,msg",
    [(0.1, "dropout_seed is required"), (1.5, "dropout_p must be in"), (-0.5, "dropout_p must be in")],
)
def test_dropout(p, msg):
    with pytest.raises(ValueError, match=msg):
        sdpa(Q, K, V, dropout_p=p)


def test_dropout_type():
    check(TypeError, "dropout_p", Q, K, V, dropout_p="0")


def test_nothing_modified_on_error():
    q = np.ones((2, 4, 8, 16), np.float32)
    out = np.full((2, 4, 8, 16), 3.0, np.float32)
    with pytest.raises(ValueError):
        sdpa(q, K, t(2, 4, 11, 16), out=out)
    assert np.all(q == 1) and np.all(out == 3)
