"""The implementations a case is timed with, each an adapter with one interface (:class:`Impl`).

fastattn itself, PyTorch's ``scaled_dot_product_attention``, ONNX Runtime's two attention
ops (:mod:`fastattn.bench.ort`), JAX's ``jax.nn.dot_product_attention`` (only where JAX is
installed) and the plain NumPy baseline.  Optional libraries are imported through
:func:`optional` (an untyped module object), so that this module type-checks the same
whether they are installed or not.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import Any, get_args

import numpy as np

import fastattn
from fastattn._config import Precision
from fastattn.bench.cases import (
    KV8_COMPARE,
    MASK_LIMIT,
    SCORES_LIMIT,
    Array,
    Case,
    additive_mask,
    bool_mask,
    mask_additive,
    numpy_attention,
    paged_pool,
)
from fastattn.bench.cases import scores_bytes as _scores_bytes
from fastattn.bench.inputs import TOL_16BIT, Inputs, first
from fastattn.bench.yardsticks import blas_limit

Runner = Callable[[], Array]
# torch's float32 matmul precision levels (fastattn's precision=, fastattn bench --precision).
PRECISIONS: tuple[Precision, ...] = get_args(Precision)


class Skip(Exception):
    """An implementation does not run this case (the message says why)."""


def optional(name: str) -> Any:
    """The optional module ``name`` (ImportError when it is not installed)."""
    return importlib.import_module(name)


def missing(*names: str) -> str | None:
    """None when every module in ``names`` imports, else '<names> is/are not installed'."""
    for n in names:
        try:
            optional(n)
        except ImportError:
            return f"{'/'.join(names)} {'are' if len(names) > 1 else 'is'} not installed"
    return None


class Impl:
    """``prepare(inputs, threads)`` returns a zero-argument callable returning the output
    as a NumPy array shaped like q (or (Hq, T, D) for varlen).  Everything that is not
    the attention itself (conversions, masks, sessions) happens in ``prepare``, outside
    the timing.  ``note`` (set by ``prepare``) says how the case was adapted;
    ``precision`` is the float32 matmul level fastattn's calls use (None for the peers)
    and ``tolerance`` the least error bound its check against the oracle takes;
    ``kv_dtype``: the dtype of the K/V it reads when not the case's (its bytes per second
    count that dtype's bytes)."""

    name = ""
    note = ""
    precision: Precision | None = None
    tolerance = 0.0
    kv_dtype: str | None = None

    def available(self) -> str | None:
        """None when usable, else the reason it is not."""
        return None

    def prepare(self, inp: Inputs, threads: int) -> Runner:
        raise NotImplementedError


def concat_varlen(outs: list[Array]) -> Array:
    """Per-sequence outputs (1, H, n, D) as the (H, T, D) output of a varlen case."""
    return np.concatenate([o[0] for o in outs], axis=1)


class FastAttn(Impl):
    """fastattn's own calls, at the float32 matmul level ``precision`` (``--precision``;
    the kernel applies it to float32 inputs only)."""

    name = "fastattn"

    def __init__(self, precision: Precision = "highest") -> None:
        self.precision = precision
        # "medium" rounds Q, K, V and P to bfloat16: checked as a 16-bit input would be
        self.tolerance = TOL_16BIT if precision == "medium" else 0.0

    def prepare(self, inp: Inputs, threads: int) -> Runner:
        case = inp.case
        prec = self.precision
        if case.page:
            return self._paged(inp, threads)
        if case.kind == "varlen":
            seqs = inp.seqs()
            q, k, v = (
                np.concatenate([s[i][0].transpose(1, 0, 2) for s in seqs]) for i in range(3)
            )  # (T,H,D)
            cu = np.concatenate([[0], np.cumsum(case.seqlens)]).astype(np.int32)
            return _varlen_runner(case, q, k, v, cu, cu, threads, prec)
        q, k, v = inp.dense()
        mask = inp.mask  # bool: True = may attend; float: added to the scores
        ks, vs = inp.k_scale, inp.v_scale  # 8-bit K/V: per-token scales (B, Hk, S, 1)

        def run_dense() -> Array:
            out: Array = fastattn.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                is_causal=case.causal,
                enable_gqa=case.gqa,
                window=case.window,
                num_threads=threads,
                precision=prec,
                k_scale=ks,
                v_scale=vs,
            )
            return out

        return run_dense

    def _paged(self, inp: Inputs, threads: int) -> Runner:
        """A paged case's one call: ``attention_with_kvcache`` over a bhsd pool (decode), or
        ``varlen_attention`` over a pool in flash-attn's page layout ``(pages, page, Hk, D)``
        (chunked prefill); pages from :func:`~fastattn.bench.cases.paged_pool`."""
        case = inp.case
        if case.kind == "decode":
            q, k, v = inp.dense()
            kp, bt = paged_pool(list(k), case.page)
            vp, _ = paged_pool(list(v), case.page)
            ks, vs = (
                None if s is None else paged_pool(list(s), case.page)[0] for s in (inp.k_scale, inp.v_scale)
            )
            return _kvcache_runner(case, q, kp, vp, k.shape[2], ks, vs, threads, self.precision, bt)
        q, kp, vp, bt, cu_q, cu_k = chunked_inputs(inp)
        return _varlen_runner(case, q, kp, vp, cu_q, cu_k, threads, self.precision, bt)


def _varlen_runner(
    case: Case,
    q: Array,
    k: Array,
    v: Array,
    cu_q: Array,
    cu_k: Array,
    threads: int,
    prec: Precision | None,
    block_table: Array | None = None,
) -> Runner:
    """One ``varlen_attention`` call (packed K/V, or page pools with ``block_table``); the
    output as ``(Hq, T, D)``."""

    def run() -> Array:
        o = fastattn.varlen_attention(
            q,
            k,
            v,
            cu_q,
            cu_k,
            block_table=block_table,
            is_causal=case.causal,
            enable_gqa=case.gqa,
            window=case.window,
            num_threads=threads,
            precision=prec,
        )
        out: Array = o.transpose(1, 0, 2)
        return out

    return run


def _kvcache_runner(
    case: Case,
    q: Array,
    k: Array,
    v: Array,
    S: int,
    ks: Array | None,
    vs: Array | None,
    threads: int,
    prec: Precision | None,
    block_table: Array | None = None,
) -> Runner:
    """One ``attention_with_kvcache`` decode call over ``S`` cached tokens per sequence (a
    contiguous cache, or page pools with ``block_table``), with the 8-bit cache's scales."""
    lens = np.full(q.shape[0], S, np.int64)

    def run() -> Array:
        out: Array = fastattn.attention_with_kvcache(
            q,
            k,
            v,
            lens,
            block_table=block_table,
            is_causal=case.causal,
            k_scale=ks,
            v_scale=vs,
            num_threads=threads,
            precision=prec,
        )
        return out

    return run


def chunked_inputs(inp: Inputs) -> tuple[Array, Array, Array, Array, Array, Array]:
    """A paged varlen case's packed queries ``(T, Hq, D)``, K and V pools in flash-attn's page
    layout ``(pages, page, Hk, D)``, block table and cumulative query / key lengths."""
    case = inp.case
    seqs = inp.seqs()
    q = np.concatenate([s[0][0].transpose(1, 0, 2) for s in seqs])
    kp, bt = paged_pool([s[1][0] for s in seqs], case.page)
    vp, _ = paged_pool([s[2][0] for s in seqs], case.page)
    kp, vp = (np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (kp, vp))
    cu_q, cu_k = (
        np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (case.query_lens, case.seqlens)
    )
    return q, kp, vp, bt, cu_q, cu_k


class FastAttnContiguous(FastAttn):
    """fastattn's decode on the contiguous cache ``(B, Hk, S, D)`` that a paged decode case
    reads through pages (the same ``attention_with_kvcache`` call without ``block_table``),
    timed beside it in the same rounds: their ratio is what the pages cost."""

    name = "fastattn-contig"

    def prepare(self, inp: Inputs, threads: int) -> Runner:
        q, k, v = inp.dense()
        return _kvcache_runner(
            inp.case, q, k, v, k.shape[2], inp.k_scale, inp.v_scale, threads, self.precision
        )


class FastAttnSeparate(FastAttn):
    """The separate calls one chunked-prefill call replaces, over the same pages: the
    sequences with one query in one batched ``attention_with_kvcache`` decode call, each
    longer chunk in a call of its own (the pool's bhsd view)."""

    name = "fastattn-separate"

    def prepare(self, inp: Inputs, threads: int) -> Runner:
        case, prec = inp.case, self.precision
        q, kp, vp, bt, cu_q, cu_k = chunked_inputs(inp)
        kb, vb = kp.transpose(0, 2, 1, 3), vp.transpose(0, 2, 1, 3)
        lens = np.asarray(case.seqlens, np.int64)
        rows = [b for b, m in enumerate(case.query_lens) if m == 1]
        chunks = [b for b, m in enumerate(case.query_lens) if m > 1]
        q_rows = q[cu_q[rows]][:, :, None]  # (rows, Hq, 1, D)
        q_chunks = [q[cu_q[b] : cu_q[b + 1]].transpose(1, 0, 2)[None] for b in chunks]  # (1, Hq, m, D)

        def call(qx: Array, b: slice | list[int]) -> Array:
            out: Array = fastattn.attention_with_kvcache(
                qx,
                kb,
                vb,
                lens[b],
                block_table=bt[b],
                is_causal=case.causal,
                num_threads=threads,
                precision=prec,
            )
            return out

        def run() -> Array:
            outs: list[Array] = [np.empty(0)] * len(case.query_lens)
            if rows:
                o = call(q_rows, rows)
                for i, b in enumerate(rows):
                    outs[b] = o[i]
            for b, qc in zip(chunks, q_chunks):
                outs[b] = call(qc, slice(b, b + 1))[0]
            return np.concatenate(outs, axis=1)

        return run


class FastAttnKV(FastAttn):
    """fastattn on the same contents as an 8-bit K/V case with K/V in ``kv_dtype``
    (float32 or bfloat16: the dequantised ``k * k_scale``, rounded to that dtype), timed
    beside fastattn's 8-bit call in the same rounds (``fastattn-f32kv``,
    ``fastattn-bf16kv``).  q keeps its dtype, but a bfloat16 q goes to float32 with
    float32 K/V (fastattn takes float32 K/V with a float32 q only)."""

    def __init__(self, kv_dtype: str, precision: Precision = "highest") -> None:
        super().__init__(precision)
        self.kv_dtype = self.same_dtype = kv_dtype
        if kv_dtype == "bfloat16":
            # checked against the oracle on the float32 dequantised K/V: rounding them to
            # bfloat16 moves the output by up to ~2^-9 of its scale, a 16-bit input's bound
            self.tolerance = TOL_16BIT
        self.name = f"fastattn-{KV8_COMPARE[kv_dtype]}kv"

    def prepare(self, inp: Inputs, threads: int) -> Runner:
        q_dtype = "float32" if self.same_dtype == "float32" else None
        same = inp.dequantised(self.same_dtype, q_dtype) if inp.k_scale is not None else inp
        if q_dtype and first(inp.q).dtype != np.float32:
            self.note = "q in float32 too"
        return super().prepare(same, threads)


class FastAttnHighest(FastAttn):
    """fastattn at precision "highest", timed beside fastattn in a run at a lower
    ``--precision``, so that one run shows what the level buys."""

    name = "fastattn-highest"

    def __init__(self) -> None:
        super().__init__("highest")


class Torch(Impl):
    name = "torch"

    def available(self) -> str | None:
        return missing("torch")

    @staticmethod
    def _tensor(a: Array) -> Any:
        torch = optional("torch")
        if a.dtype.name == "bfloat16":
            return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(np.ascontiguousarray(a))

    @staticmethod
    def _numpy(t: Any) -> Array:
        torch = optional("torch")
        out: Array = t.float().numpy() if t.dtype in (torch.bfloat16, torch.float16) else t.numpy()
        return out

    def prepare(self, inp: Inputs, threads: int) -> Runner:
        torch = optional("torch")
        F = optional("torch.nn.functional")
        torch.set_num_threads(threads)
        case = inp.case
        if case.kv_dtype:
            inp = inp.as_float32()
            self.note = "run on float32 copies of the 16-bit K/V"
        calls = []
        for q, k, v in inp.seqs():
            L, S = q.shape[-2], k.shape[-2]
            m = None
            causal = case.causal
            if inp.mask is not None:
                # the case's own mask, as is: torch's bool is True = may attend too, and it
                # adds a float32 mask to the scores of 16-bit queries as well
                m = torch.from_numpy(inp.mask)
            elif case.window is not None or (causal and L != S):  # torch's causal is top-left aligned
                if L * S > MASK_LIMIT:
                    raise Skip(f"the {L}x{S} mask would exceed {MASK_LIMIT >> 20} MiB")
                m = torch.from_numpy(bool_mask(L, S, causal, case.window))
                causal = False
            calls.append((self._tensor(q), self._tensor(k), self._tensor(v), m, causal))
        gqa = case.gqa

        def run() -> Array:
            with torch.inference_mode():
                outs = [
                    F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=c, enable_gqa=gqa)
                    for q, k, v, m, c in calls
                ]
            if case.kind == "varlen":
                return concat_varlen([self._numpy(o) for o in outs])
            return self._numpy(outs[0])

        return run


class Jax(Impl):
    """``jax.nn.dot_product_attention`` (XLA on the CPU), float32.  XLA sizes its own
    thread pool when JAX starts: the run's thread count is not applied to it (the note
    says so when they may differ)."""

    name = "jax"

    def available(self) -> str | None:
        return missing("jax")

    def prepare(self, inp: Inputs, threads: int) -> Runner:
        jax = optional("jax")
        jnp = optional("jax.numpy")
        case = inp.case
        if first(inp.q).dtype != np.float32 or first(inp.k).dtype != np.float32:
            inp = inp.as_float32()
            self.note = "run on float32 copies"
        extra = "XLA's own thread pool (all cores), not --threads"
        if threads != (os.cpu_count() or 1) and extra not in self.note:
            self.note = "; ".join(filter(None, [self.note, extra]))
        calls = []
        for q, k, v in inp.seqs():
            L, S = q.shape[2], k.shape[2]
            m = bias = None
            causal = case.causal
            if inp.mask is not None:
                # (B, 1, L or 1, S) broadcasts to jax's (B, N, T, S): a bool one is its mask=
                # (True = may attend), a float one its bias= (added to the scores)
                if inp.mask.dtype == np.bool_:
                    m = jnp.asarray(inp.mask)
                else:
                    bias = jnp.asarray(inp.mask)
            elif case.window is not None or (causal and L != S):  # jax's causal is top-left aligned
                if L * S > MASK_LIMIT:
                    raise Skip(f"the {L}x{S} mask would exceed {MASK_LIMIT >> 20} MiB")
                m = jnp.asarray(bool_mask(L, S, causal, case.window))
                causal = False
            # jax.nn.dot_product_attention takes (B, T, N, H); GQA: K/V heads divide the query heads
            calls.append(tuple(jnp.asarray(a.transpose(0, 2, 1, 3)) for a in (q, k, v)) + (m, bias, causal))
        fn = jax.jit(jax.nn.dot_product_attention, static_argnames=("is_causal",))

        def run() -> Array:
            outs = [
                np.asarray(fn(q, k, v, bias=b, mask=m, is_causal=c).block_until_ready()).transpose(0, 2, 1, 3)
                for q, k, v, m, b, c in calls
            ]
            return concat_varlen(outs) if case.kind == "varlen" else outs[0]

        run()  # compiles (once per shape): not part of the first call the runner times
        return run


class NumpyRef(Impl):
    name = "numpy"
    note = ""

    def prepare(self, inp: Inputs, threads: int) -> Runner:
        case = inp.case
        if _scores_bytes(case) > SCORES_LIMIT:
            raise Skip(f"scores would take {_scores_bytes(case) / 2**30:.1f} GiB")
        if first(inp.q).dtype != np.float32 or first(inp.k).dtype != np.float32:
            inp = inp.as_float32()
            self.note = "computed in float32 on upcast inputs"
        calls: list[tuple[Array, Array, Array, Array | None]]
        if inp.mask is not None:
            # (B, 1, L or 1, S) -> (B, 1, 1, L or 1, S): the baseline's scores are (B, Hk, g, L, S)
            calls = [(*inp.dense(), mask_additive(inp.mask)[:, :, None])]
        else:
            calls = [
                (q, k, v, additive_mask(q.shape[2], k.shape[2], case.causal, case.window))
                for q, k, v in inp.seqs()
            ]

        def run() -> Array:
            with blas_limit(threads):
                outs = [numpy_attention(*c) for c in calls]
            return concat_varlen(outs) if case.kind == "varlen" else outs[0]

        return run
