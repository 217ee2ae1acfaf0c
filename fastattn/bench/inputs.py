"""The inputs of a case, the slice every implementation is checked on, and the oracle's answer."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from fastattn import reference
from fastattn.bench.cases import Array, Case, case_mask, kv8_inputs, mask_visible, np_dtype, random_inputs

# One array (B, H, n, D), or for varlen cases a list of per-sequence (1, H, n, D) arrays.
Batch = Array | list[Array]


@dataclasses.dataclass
class Inputs:
    """q (B,Hq,L,D), k/v (B,Hk,S,D) for one case (lists of per-sequence (1,H,n,D) for varlen);
    ``mask``: the masked case's attn_mask (:func:`fastattn.bench.cases.case_mask`), else None;
    ``k_scale``/``v_scale``: the per-token float32 scales (B,Hk,S,1) of 8-bit K/V, else None."""

    case: Case
    q: Batch
    k: Batch
    v: Batch
    mask: Array | None = None
    k_scale: Array | None = None
    v_scale: Array | None = None

    def seqs(self) -> list[tuple[Array, Array, Array]]:
        """(q, k, v) per sequence: one triple, or one per varlen sequence."""
        if isinstance(self.q, list):
            assert isinstance(self.k, list) and isinstance(self.v, list)
            return list(zip(self.q, self.k, self.v))
        assert not isinstance(self.k, list) and not isinstance(self.v, list)
        return [(self.q, self.k, self.v)]

    def dense(self) -> tuple[Array, Array, Array]:
        """(q, k, v) of a case that is not varlen."""
        (qkv,) = self.seqs()
        return qkv

    def as_float32(self) -> Inputs:
        """Everything in float32 (8-bit K/V dequantised: K = k * k_scale)."""
        if self.k_scale is not None:
            return self.dequantised("float32", "float32")

        def f(x: Batch) -> Batch:
            return [a.astype(np.float32) for a in x] if isinstance(x, list) else x.astype(np.float32)

        return Inputs(self.case, f(self.q), f(self.k), f(self.v), self.mask)

    def dequantised(self, kv_dtype: str, q_dtype: str | None = None) -> Inputs:
        """The same contents with K/V in ``kv_dtype`` (8-bit K/V dequantised, ``k * k_scale``
        in float32, then rounded to ``kv_dtype``) and q in ``q_dtype`` (None: as it is)."""
        q, k, v = self.dense()
        ks, vs = self.k_scale, self.v_scale
        kf = k.astype(np.float32) * ks if ks is not None else k.astype(np.float32)
        vf = v.astype(np.float32) * vs if vs is not None else v.astype(np.float32)
        dt = np_dtype(kv_dtype)
        qa = q if q_dtype is None else q.astype(np_dtype(q_dtype))
        return Inputs(self.case, qa, kf.astype(dt, copy=False), vf.astype(dt, copy=False), self.mask)


def first(x: Batch) -> Array:
    """The array, or the first sequence's of a varlen list."""
    return x[0] if isinstance(x, list) else x


def make_inputs(case: Case, dtype: str, seed: int = 0) -> Inputs:
    """The case's inputs (:func:`fastattn.bench.cases.random_inputs`, or
    :func:`~fastattn.bench.cases.kv8_inputs` for 8-bit K/V) and mask."""
    if case.kv8:
        q, k, v, ks, vs = kv8_inputs(case, seed)
        return Inputs(case, q, k, v, k_scale=ks, v_scale=vs)
    return Inputs(case, *random_inputs(case, dtype, seed), mask=case_mask(case))


def check_slice(inp: Inputs) -> Inputs:
    """A cheap slice of the same case to check implementations against the oracle:
    batch 0, key/value head 0 with its query heads, and for square cases the first
    min(L, 512) rows and keys (causal and window stay the same mask there).  A masked
    case keeps the batch its mask hides most of (batch 0 of a padding mask is full), all
    S keys (padding sits at the end) and the first min(L, 512) rows of the mask."""
    case = inp.case
    if case.q_lens:  # chunked prefill: checked whole (its decode rows and chunk side by side)
        return inp
    if case.kind == "varlen":
        n = 4
        cut = [max(16, x // 8) for x in case.seqlens[:n]]  # unequal lengths, as in the case
        seqs = inp.seqs()[:n]
        c = dataclasses.replace(case, seqlens=tuple(cut))
        return Inputs(
            c,
            [q[:, :, :m] for (q, _, _), m in zip(seqs, cut)],
            [k[:, :, :m] for (_, k, _), m in zip(seqs, cut)],
            [v[:, :, :m] for (_, _, v), m in zip(seqs, cut)],
        )
    q, k, v = inp.dense()
    g = case.Hq // case.Hk
    L, S = case.L, case.S
    m = inp.mask
    if m is None:
        b = 0
        if L == S:
            L = S = min(L, 512)
    else:
        b = int(np.argmin(np.broadcast_to(mask_visible(m), (case.B, 1, L, S)).sum(axis=(1, 2, 3))))
        L = min(L, 512)
        m = m[b : b + 1, :, : min(m.shape[2], L)]
    c = dataclasses.replace(case, B=1, Hq=g, Hk=1, L=L, S=S)
    ks, vs = (None if s is None else s[b : b + 1, :1, :S] for s in (inp.k_scale, inp.v_scale))
    return Inputs(c, q[b : b + 1, :g, :L], k[b : b + 1, :1, :S], v[b : b + 1, :1, :S], m, ks, vs)


def reference_output(inp: Inputs) -> Array:
    """The float64 oracle's output: shaped like q, or (Hq, T, D) for varlen; 8-bit K/V
    dequantised (the oracle computes on ``k * k_scale``)."""
    case = inp.case
    if inp.k_scale is not None:
        inp = inp.dequantised("float32")

    def one(q: Array, k: Array, v: Array) -> Array:
        # the oracle has no annotations (yet)
        # (without return_lse the oracle returns the output alone)
        out = reference.scaled_dot_product_attention(
            q, k, v, inp.mask, is_causal=case.causal, enable_gqa=case.gqa, window=case.window
        )
        assert isinstance(out, np.ndarray)
        return out

    if case.kind == "varlen":
        return np.concatenate([one(q, k, v).reshape(case.Hq, -1, case.D) for q, k, v in inp.seqs()], axis=1)
    return one(*inp.dense())


TOL_16BIT = 3e-2  # the error bound of a call with 16-bit queries (bf16 products)


def tolerance(inp: Inputs) -> float:
    """Largest error (relative to the output scale) an implementation may make on ``inp``."""
    q, k = first(inp.q), first(inp.k)
    return TOL_16BIT if (q.dtype.itemsize < 4) else (2e-3 if k.dtype.itemsize < 4 else 1e-3)


def check(fn: Callable[[], Array], inp: Inputs, ref: Array) -> float:
    """Max error relative to the output scale."""
    out = np.asarray(fn(), dtype=np.float64)
    if out.shape != ref.shape:
        raise AssertionError(f"shape {out.shape} != {ref.shape}")
    return float(np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1e-30))
