"""fastattn._plan: the call record (Plan) and its leading-dimension merge/split.

The merge/split is checked on its own (shapes, strides, which memory each
4-D plan addresses, with NumPy arrays and with a stand-in for device views)
and end to end against fastattn.reference on layouts that merge and that
must split."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from conftest import assert_close

import fastattn
from fastattn import _kernels, _plan
from fastattn import reference as ref


def test_plan_fields_are_the_c_struct_names():
    names = {f.name for f in dataclasses.fields(_plan.Plan)}
    # fastattn/_kernels.pxd declares fa_params as in csrc/fastattn.h: every Plan
    # field except the varlen lengths names one of its fields (or its pointer).
    with open(_kernels.__file__.rsplit("/", 1)[0] + "/_kernels.pxd") as f:
        pxd = f.read()
    struct = pxd[pxd.index("ctypedef struct fa_params:") : pxd.index("int fa_attention(")]
    for n in names - {"L", "S"}:
        assert f" {n}" in struct or f"*{n}" in struct, n
    per_batch = dict(_plan.PER_BATCH_FIELDS)
    assert per_batch == {
        "q": 3,
        "k": 3,
        "v": 3,
        "o": 3,
        "lse": 2,
        "k_scale": 3,
        "v_scale": 3,
        "mask": 3,
        "alibi": 1,
        "q_lens": 0,
        "k_lens": 0,
        "bmask": 3,
    }


def test_enums_come_from_the_header():
    assert (_kernels.FA_F32, _kernels.FA_F64, _kernels.FA_F16, _kernels.FA_BF16) == (0, 1, 2, 3)
    assert (_kernels.FA_I8, _kernels.FA_E4M3, _kernels.FA_E5M2) == (4, 5, 6)
    assert _kernels.MASK_BOOL == _kernels.FA_MASK_BOOL == int(_kernels.fa_mask_kind.FA_MASK_BOOL)
    assert _kernels.ISA_NAMES == ("scalar", "avx2", "avx512", "amx", "avx512bf16", "neon", "sve")
    assert _plan.MASK_KINDS[np.dtype(np.float64)] == _kernels.FA_MASK_F64


def test_merged_stride():
    assert _plan.merged_stride((2, 3), (12, 4)) == 4
    assert _plan.merged_stride((2, 3), (4, 12)) is None  # transposed
    assert _plan.merged_stride((2, 1, 3), (12, 99, 4)) == 4  # size-1 dims do not count
    assert _plan.merged_stride((2, 3), (0, 0)) == 0  # broadcast
    assert _plan.merged_stride((2, 3), (5, 0)) is None  # broadcast along the inner dim only
    assert _plan.merged_stride((), ()) == 0


def _make_plan(lead, mask=None, o=None):
    rng = np.random.default_rng(0)
    q = rng.standard_normal(lead + (2, 5, 4)).astype(np.float32)
    o = np.empty(lead + (2, 5, 4), np.float32) if o is None else o
    return _plan.Plan(
        q=q, k=q, v=q, o=o, scale=0.5, L=5, S=5, num_threads=1, precision=0, mask=mask,
        k_lens=np.full(lead, 5, np.int64),
    )  # fmt: skip


def _addresses(a):
    """The byte address of every element of a NumPy view."""
    base = a.__array_interface__["data"][0]
    idx = np.indices(a.shape).reshape(a.ndim, -1)
    return base + np.tensordot(np.array(a.strides), idx, axes=1)


def test_kernel_plans_merge_into_views():
    p = _make_plan((2, 3))
    (m,) = list(_plan.kernel_plans(p))
    assert m.q.shape == (6, 2, 5, 4) and np.shares_memory(m.o, p.o) and m.k_lens.shape == (6,)
    assert m.scale == p.scale and m.L == 5


def test_kernel_plans_split_where_strides_do_not_merge():
    # A mask broadcast along the inner leading dim only: (2, 3) cannot merge without a copy.
    mask = np.broadcast_to(np.ones((2, 1, 2, 5, 5), bool), (2, 3, 2, 5, 5))
    o = np.empty((3, 2, 2, 5, 4), np.float32).transpose(1, 0, 2, 3, 4)  # an output that cannot merge either
    p = _make_plan((2, 3), mask=mask, o=o)
    subs = list(_plan.kernel_plans(p))
    assert len(subs) == 2 and all(s.q.ndim == 4 and s.q.shape[0] == 3 for s in subs)
    # Together they address exactly the original output's memory, each batch element once.
    got = np.concatenate([_addresses(s.o) for s in subs])
    assert sorted(got) == sorted(_addresses(o)) and len(set(got)) == got.size
    for i, s in enumerate(subs):
        assert s.mask.strides[0] == 0 and np.shares_memory(s.mask, mask)
        np.testing.assert_array_equal(s.k_lens, p.k_lens[i])
        assert s.sinks is p.sinks and s.causal == p.causal


class _View:
    """A stand-in for a device view: shape, element strides, an offset for a pointer."""

    def __init__(self, shape, strides, off=0):
        self.shape, self.strides, self.off = tuple(shape), tuple(strides), off

    def item(self, i):
        return _View(self.shape[1:], self.strides[1:], self.off + i * self.strides[0])

    def restrided(self, shape, strides):
        return _View(shape, strides, self.off)


def test_kernel_plans_on_device_views():
    def view(shape, strides):
        return _View(shape, strides)

    c = view((2, 3, 2, 5, 4), (120, 40, 20, 4, 1))  # C-contiguous
    bad = view((2, 3, 2, 5, 4), (40, 80, 20, 4, 1))  # leading dims transposed
    p = _plan.Plan(q=c, k=c, v=c, o=c, scale=1.0, L=5, S=5, num_threads=1, precision=0)
    (m,) = list(_plan.kernel_plans(p))
    assert m.q.shape == (6, 2, 5, 4) and m.q.strides == (40, 20, 4, 1)
    subs = list(_plan.kernel_plans(dataclasses.replace(p, o=bad)))
    assert [s.o.off for s in subs] == [0, 40] and [s.q.off for s in subs] == [0, 120]
    assert all(s.o.shape == (3, 2, 5, 4) and s.o.strides == (80, 20, 4, 1) for s in subs)


@pytest.mark.parametrize("case", ["merge", "split_mask", "split_out", "bshd"])
def test_leading_dims_end_to_end(rng, case):
    lead = (2, 3)
    q = rng.standard_normal(lead + (4, 7, 8)).astype(np.float32)
    k = rng.standard_normal(lead + (2, 9, 8)).astype(np.float32)
    v = rng.standard_normal(lead + (2, 9, 5)).astype(np.float32)
    kw = dict(enable_gqa=True, alibi_slopes=rng.random(lead + (4,)), key_lengths=rng.integers(1, 10, lead))
    if case == "split_mask":
        kw["attn_mask"] = np.broadcast_to(rng.random((2, 1, 4, 7, 9)) > 0.3, lead + (4, 7, 9))
    if case == "bshd":
        q, k, v = (np.swapaxes(a, -2, -3).copy() for a in (q, k, v))
        kw["layout"] = "bshd"
    out = None
    if case == "split_out":
        out = np.empty((3, 2, 4, 7, 5), np.float32).transpose(1, 0, 2, 3, 4)
    o, lse = fastattn.scaled_dot_product_attention(q, k, v, return_lse=True, out=out, **kw)
    ro, rlse = ref.scaled_dot_product_attention(q, k, v, return_lse=True, **kw)
    assert_close(o, ro)
    assert_close(lse, rlse)
    if out is not None:
        assert o is out
