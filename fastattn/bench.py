"""Benchmark fastattn against its peers: ``python -m fastattn.bench``.

For every case the command times fastattn, PyTorch's ``scaled_dot_product_attention``
(when torch is installed), ONNX Runtime's ``com.microsoft.MultiHeadAttention`` contrib
op and the standard ONNX ``Attention`` op of opset 23 (when onnx and onnxruntime are
installed) and the plain NumPy ``softmax(Q Kᵀ) V``.  Every implementation is first
checked against :mod:`fastattn.reference` (the float64 oracle) on a slice of the
case; one that fails the check is reported and not timed.  Repetitions are
interleaved (round robin over the implementations, with a pause between them so
that spinning BLAS/OpenMP workers of one library do not slow the next) and the
median per implementation is reported.

All libraries get the same thread count (``--threads``, default: all cores).  The
machine's fp32 GEMM rate (NumPy ``sgemm`` 2048³) and its read bandwidth are
measured in the same run; prefill throughput is shown as a percentage of the GEMM
rate.  Decode throughput is shown as a percentage of a plain read of the case's own
K and V arrays (``kv-read``: the same threads read them with NumPy GEMVs), timed in the
same interleaved rounds, so that both meet the same pages and the same moment of a
shared machine's memory traffic, and of the machine's read bandwidth timed in those
same rounds (``bw``: the same threads read one 1 GiB array, 256 MiB with
``--quick``, as ``measure_bandwidth`` does).  Both yardsticks are medians, like every
time reported; the best-of-six bandwidth measured before and after the cases is
printed too, but on a shared machine it is an optimistic outlier, not a rate to
compare a median with.

FLOPs count the visible (query, key) pairs exactly: ``4 · D · pairs`` with
``pairs`` the number of key positions each query row may see, summed (causal is
aligned bottom-right; a window narrows it).  Decode GB/s is the case's K+V bytes
(Hk heads, the case's K/V dtype) divided by the time.

If ``OPENBLAS_CORETYPE`` / ``OPENBLAS_L2_SIZE`` are set in the environment they
slow NumPy's BLAS (and so the GEMM reference rate and the NumPy baseline); run
``env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python -m fastattn.bench`` to
measure the true limit.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import statistics
import sys
import threading
import time

import numpy as np

import fastattn
from fastattn import reference

__all__ = ["main", "CASES", "Case", "measure_gemm", "measure_bandwidth", "case_flops"]

SCORES_LIMIT = 2 * 10**9  # implementations that materialise the scores skip cases above this
MASK_LIMIT = 1024**3  # peers get an explicit (L, S) mask only below this many bytes


@dataclasses.dataclass(frozen=True)
class Case:
    """One benchmark shape.  ``kind`` is prefill, decode, varlen or small."""

    name: str
    B: int
    Hq: int
    Hk: int
    L: int
    S: int
    D: int
    causal: bool = False
    window: tuple | None = None
    kv_dtype: str | None = None  # None: the --dtype of the run
    kind: str = "prefill"
    seqlens: tuple = ()

    @property
    def gqa(self) -> bool:
        return self.Hq != self.Hk


def _varlen_lengths() -> tuple:
    rng = np.random.default_rng(1234)
    return tuple(int(x) for x in rng.integers(128, 2049, size=8))


CASES = [
    Case("B1 H8 L1024 D64", 1, 8, 8, 1024, 1024, 64),
    Case("B1 H8 L4096 D64", 1, 8, 8, 4096, 4096, 64),
    Case("B1 H8 L1024 D64 causal", 1, 8, 8, 1024, 1024, 64, causal=True),
    Case("B1 H8 L4096 D64 causal", 1, 8, 8, 4096, 4096, 64, causal=True),
    Case("B1 H8 L2048 D128", 1, 8, 8, 2048, 2048, 128),
    Case("B4 H8 L512 D64 causal", 4, 8, 8, 512, 512, 64, causal=True),
    Case("B1 H32 S8192 D128 decode", 1, 32, 32, 1, 8192, 128, kind="decode"),
    Case("B1 H32/8 S8192 D128 decode", 1, 32, 8, 1, 8192, 128, kind="decode"),
    Case("B8 H32/8 S2048 D128 decode", 8, 32, 8, 1, 2048, 128, kind="decode"),
    Case("B1 H64/8 S8192 D128 decode", 1, 64, 8, 1, 8192, 128, kind="decode"),  # GQA groups of 8
    Case("B1 H32 S8192 D128 decode f16kv", 1, 32, 32, 1, 8192, 128, kv_dtype="float16", kind="decode"),
    Case("B1 H32 S8192 D128 decode bf16kv", 1, 32, 32, 1, 8192, 128, kv_dtype="bfloat16", kind="decode"),
    Case("B1 H32/8 S8192 D128 decode f16kv", 1, 32, 8, 1, 8192, 128, kv_dtype="float16", kind="decode"),
    Case("B1 H8 L16384 D64 window512", 1, 8, 8, 16384, 16384, 64, causal=True, window=(512, 0)),
    Case(
        "varlen 8 seqs 128..2048 H8 D64 causal",
        8,
        8,
        8,
        0,
        0,
        64,
        causal=True,
        kind="varlen",
        seqlens=_varlen_lengths(),
    ),
    Case("B1 H8 L16 D64", 1, 8, 8, 16, 16, 64, kind="small"),
]

QUICK_CASES = (
    "B1 H8 L1024 D64",
    "B1 H8 L1024 D64 causal",
    "B1 H32/8 S8192 D128 decode",
    "B1 H32 S8192 D128 decode f16kv",
    "B1 H8 L16 D64",
)

SWEEP_LENGTHS = (256, 512, 1024, 2048, 4096, 8192)


def sweep_cases() -> list:
    """Non-causal B1 H8 D64 cases over L (the ``--sweep`` option)."""
    return [Case(f"B1 H8 L{n} D64", 1, 8, 8, n, n, 64) for n in SWEEP_LENGTHS]


# --------------------------------------------------------------------------- dtypes and sizes


def _np_dtype(name: str):
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def visible_pairs(L: int, S: int, causal: bool, window) -> int:
    """Number of (query, key) pairs a row-wise mask leaves visible (bottom-right aligned)."""
    off = S - L
    left, right = (-1, -1) if window is None else window
    total = 0
    i = np.arange(L, dtype=np.int64) + off  # bottom-right position of each query row
    hi = np.full(L, S - 1, dtype=np.int64)
    lo = np.zeros(L, dtype=np.int64)
    if causal:
        hi = np.minimum(hi, i)
    if right >= 0:
        hi = np.minimum(hi, i + right)
    if left >= 0:
        lo = np.maximum(lo, i - left)
    total = int(np.maximum(hi - lo + 1, 0).sum())
    return total


def case_flops(case: Case) -> float:
    """4·D per visible (query, key) pair per batch and query head."""
    if case.kind == "varlen":
        pairs = sum(visible_pairs(n, n, case.causal, case.window) for n in case.seqlens)
        return 4.0 * case.Hq * case.D * pairs
    return 4.0 * case.B * case.Hq * case.D * visible_pairs(case.L, case.S, case.causal, case.window)


def _kv_bytes(case: Case, dtype: np.dtype) -> int:
    return 2 * case.B * case.Hk * case.S * case.D * dtype.itemsize


def _scores_bytes(case: Case) -> int:
    if case.kind == "varlen":
        return max(case.Hq * n * n * 4 for n in case.seqlens)
    return case.B * case.Hq * case.L * case.S * 4


# --------------------------------------------------------------------------- inputs


@dataclasses.dataclass
class Inputs:
    """q (B,Hq,L,D), k/v (B,Hk,S,D) for one case (lists of per-sequence (1,H,n,D) for varlen)."""

    case: Case
    q: object
    k: object
    v: object

    def as_float32(self) -> Inputs:
        f = (
            (lambda a: a.astype(np.float32))
            if not isinstance(self.q, list)
            else (lambda xs: [a.astype(np.float32) for a in xs])
        )
        return Inputs(self.case, f(self.q), f(self.k), f(self.v))


def make_inputs(case: Case, dtype: str, seed: int = 0) -> Inputs:
    rng = np.random.default_rng(seed)
    qdt = _np_dtype("float32" if case.kv_dtype else dtype)
    kvdt = _np_dtype(case.kv_dtype or dtype)

    def gen(shape, dt):
        return rng.standard_normal(shape, dtype=np.float32).astype(dt)

    if case.kind == "varlen":
        qs = [gen((1, case.Hq, n, case.D), qdt) for n in case.seqlens]
        ks = [gen((1, case.Hk, n, case.D), kvdt) for n in case.seqlens]
        vs = [gen((1, case.Hk, n, case.D), kvdt) for n in case.seqlens]
        return Inputs(case, qs, ks, vs)
    return Inputs(
        case,
        gen((case.B, case.Hq, case.L, case.D), qdt),
        gen((case.B, case.Hk, case.S, case.D), kvdt),
        gen((case.B, case.Hk, case.S, case.D), kvdt),
    )


def check_slice(inp: Inputs) -> Inputs:
    """A cheap slice of the same case to check implementations against the oracle:
    batch 0, key/value head 0 with its query heads, and for square cases the first
    min(L, 512) rows and keys (causal and window stay the same mask there)."""
    case = inp.case
    if case.kind == "varlen":
        n = 4
        cut = [max(16, x // 8) for x in case.seqlens[:n]]  # unequal lengths, as in the case
        sl = lambda xs: [a[:, :, :m] for a, m in zip(xs[:n], cut)]  # noqa: E731
        c = dataclasses.replace(case, seqlens=tuple(cut))
        return Inputs(c, sl(inp.q), sl(inp.k), sl(inp.v))
    g = case.Hq // case.Hk
    L, S = case.L, case.S
    if L == S:
        L = S = min(L, 512)
    c = dataclasses.replace(case, B=1, Hq=g, Hk=1, L=L, S=S)
    return Inputs(c, inp.q[:1, :g, :L], inp.k[:1, :1, :S], inp.v[:1, :1, :S])


def reference_output(inp: Inputs) -> np.ndarray:
    case = inp.case
    if case.kind == "varlen":
        return np.concatenate(
            [
                reference.scaled_dot_product_attention(
                    q, k, v, is_causal=case.causal, enable_gqa=case.gqa, window=case.window
                ).reshape(case.Hq, -1, case.D)
                for q, k, v in zip(inp.q, inp.k, inp.v)
            ],
            axis=1,
        )
    return reference.scaled_dot_product_attention(
        inp.q, inp.k, inp.v, is_causal=case.causal, enable_gqa=case.gqa, window=case.window
    )


def bool_mask(L: int, S: int, causal: bool, window) -> np.ndarray | None:
    """(L, S) bool mask, True = may attend (bottom-right aligned), or None when all visible."""
    if not causal and window is None:
        return None
    i = np.arange(L)[:, None] + (S - L)
    j = np.arange(S)[None, :]
    m = np.ones((L, S), dtype=bool)
    if causal:
        m &= j <= i
    if window is not None:
        left, right = window
        if left >= 0:
            m &= j >= i - left
        if right >= 0:
            m &= j <= i + right
    return m


# --------------------------------------------------------------------------- implementations


class Skip(Exception):
    """An implementation does not run this case (the message says why)."""


class Impl:
    """``prepare(inputs)`` returns a zero-argument callable returning the output
    as a NumPy array shaped like q (or (Hq, T, D) for varlen)."""

    name = ""
    note = ""

    def available(self) -> str | None:
        """None when usable, else the reason it is not."""
        return None

    def prepare(self, inp: Inputs, threads: int):
        raise NotImplementedError


class FastAttn(Impl):
    name = "fastattn"

    def prepare(self, inp, threads):
        case = inp.case
        if case.kind == "varlen":
            q = np.concatenate([a[0].transpose(1, 0, 2) for a in inp.q])  # (T, H, D)
            k = np.concatenate([a[0].transpose(1, 0, 2) for a in inp.k])
            v = np.concatenate([a[0].transpose(1, 0, 2) for a in inp.v])
            cu = np.concatenate([[0], np.cumsum(case.seqlens)]).astype(np.int32)

            def run():
                o = fastattn.varlen_attention(
                    q,
                    k,
                    v,
                    cu,
                    cu,
                    is_causal=case.causal,
                    enable_gqa=case.gqa,
                    window=case.window,
                    num_threads=threads,
                )
                return o.transpose(1, 0, 2)

            return run
        q, k, v = inp.q, inp.k, inp.v
        return lambda: fastattn.scaled_dot_product_attention(
            q, k, v, is_causal=case.causal, enable_gqa=case.gqa, window=case.window, num_threads=threads
        )


class Torch(Impl):
    name = "torch"

    def available(self):
        try:
            import torch  # noqa: F401
        except ImportError:
            return "torch is not installed"
        return None

    @staticmethod
    def _tensor(a):
        import torch

        if a.dtype.name == "bfloat16":
            return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(np.ascontiguousarray(a))

    @staticmethod
    def _numpy(t):
        import torch

        return t.float().numpy() if t.dtype in (torch.bfloat16, torch.float16) else t.numpy()

    def prepare(self, inp, threads):
        import torch
        import torch.nn.functional as F

        torch.set_num_threads(threads)
        case = inp.case
        if case.kv_dtype:
            inp = inp.as_float32()
            self.note = "run on float32 copies of the 16-bit K/V"
        qs = inp.q if case.kind == "varlen" else [inp.q]
        ks = inp.k if case.kind == "varlen" else [inp.k]
        vs = inp.v if case.kind == "varlen" else [inp.v]
        calls = []
        for q, k, v in zip(qs, ks, vs):
            L, S = q.shape[-2], k.shape[-2]
            m = None
            causal = case.causal
            if case.window is not None or (causal and L != S):  # torch's causal is top-left aligned
                if L * S > MASK_LIMIT:
                    raise Skip(f"the {L}x{S} mask would exceed {MASK_LIMIT >> 20} MiB")
                m = torch.from_numpy(bool_mask(L, S, causal, case.window))
                causal = False
            calls.append((self._tensor(q), self._tensor(k), self._tensor(v), m, causal))
        gqa = case.gqa

        def run():
            with torch.inference_mode():
                outs = [
                    F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=c, enable_gqa=gqa)
                    for q, k, v, m, c in calls
                ]
            if case.kind == "varlen":
                return np.concatenate([self._numpy(o)[0] for o in outs], axis=1)
            return self._numpy(outs[0])

        return run


def _ort_session(model, threads):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _onnx_type(dt: np.dtype):
    from onnx import TensorProto

    return {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}[
        dt.name
    ]


class _OrtBase(Impl):
    def available(self):
        try:
            import onnx  # noqa: F401
            import onnxruntime  # noqa: F401
        except ImportError:
            return "onnx/onnxruntime are not installed"
        return None

    def prepare(self, inp, threads):
        case = inp.case
        if case.kv_dtype:
            inp = inp.as_float32()
            self.note = "run on float32 copies of the 16-bit K/V (the op needs one dtype for Q and K)"
        if _scores_bytes(case) > SCORES_LIMIT:
            raise Skip(f"materialises {_scores_bytes(case) / 2**30:.1f} GiB of scores")
        if case.kind == "varlen":
            runs = [
                self._prepare_one(
                    dataclasses.replace(case, B=1, L=q.shape[2], S=q.shape[2]), q, k, v, threads
                )
                for q, k, v in zip(inp.q, inp.k, inp.v)
            ]
            return lambda: np.concatenate([r()[0] for r in runs], axis=1)
        return self._prepare_one(case, inp.q, inp.k, inp.v, threads)

    def _float_mask(self, case, L, S, dtype):
        if case.window is None:
            return None
        if L * S * dtype.itemsize > MASK_LIMIT:
            raise Skip("the window mask would be too large")
        m = bool_mask(L, S, case.causal, case.window)
        return np.where(m, 0.0, -np.inf).astype(dtype)


class OrtMHA(_OrtBase):
    name = "ort-mha"
    op = "com.microsoft.MultiHeadAttention"

    def _prepare_one(self, case, q, k, v, threads):
        from onnx import helper

        B, Hq, L, D = q.shape
        Hk, S = k.shape[1], k.shape[2]
        dt = q.dtype
        if dt.name == "bfloat16":
            raise Skip("no bfloat16 input support")
        if Hq != Hk:  # the op has no GQA: repeat K/V heads (outside the timing)
            k = np.repeat(k, Hq // Hk, axis=1)
            v = np.repeat(v, Hq // Hk, axis=1)
            extra = "K/V heads repeated to Hq (the op has no GQA)"
            if extra not in self.note:
                self.note = "; ".join(filter(None, [self.note, extra]))
        if case.causal and L != S:
            raise Skip("causal with L != S")
        mask = self._float_mask(case, L, S, dt)
        t = _onnx_type(dt)
        inputs = [
            helper.make_tensor_value_info("q", t, ["B", "L", Hq * D]),
            helper.make_tensor_value_info("k", t, ["B", "S", Hq * D]),
            helper.make_tensor_value_info("v", t, ["B", "S", Hq * D]),
        ]
        names = ["q", "k", "v", "", ""]
        feeds = {
            "q": np.ascontiguousarray(q.transpose(0, 2, 1, 3)).reshape(B, L, Hq * D),
            "k": np.ascontiguousarray(k.transpose(0, 2, 1, 3)).reshape(B, S, Hq * D),
            "v": np.ascontiguousarray(v.transpose(0, 2, 1, 3)).reshape(B, S, Hq * D),
        }
        if mask is not None:
            inputs.append(helper.make_tensor_value_info("bias", t, [1, 1, "L", "S"]))
            names.append("bias")
            feeds["bias"] = mask[None, None]
        node = helper.make_node(
            "MultiHeadAttention",
            names,
            ["o"],
            domain="com.microsoft",
            num_heads=Hq,
            unidirectional=int(case.causal and mask is None),
            scale=1.0 / math.sqrt(D),
        )
        graph = helper.make_graph(
            [node], "mha", inputs, [helper.make_tensor_value_info("o", t, ["B", "L", Hq * D])]
        )
        model = helper.make_model(
            graph, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid("com.microsoft", 1)]
        )
        model.ir_version = 10
        sess = _ort_session(model, threads)

        def run():
            o = sess.run(None, feeds)[0]
            return o.reshape(B, L, Hq, D).transpose(0, 2, 1, 3)

        return run


class OrtAttention(_OrtBase):
    name = "ort-attn23"
    op = "ONNX Attention (opset 23)"

    def _prepare_one(self, case, q, k, v, threads):
        from onnx import helper

        B, Hq, L, D = q.shape
        Hk, S = k.shape[1], k.shape[2]
        t = _onnx_type(q.dtype)
        mask = self._float_mask(case, L, S, q.dtype)
        inputs = [
            helper.make_tensor_value_info("q", t, ["B", Hq, "L", D]),
            helper.make_tensor_value_info("k", t, ["B", Hk, "S", D]),
            helper.make_tensor_value_info("v", t, ["B", Hk, "S", D]),
        ]
        names = ["q", "k", "v"]
        feeds = {"q": q, "k": k, "v": v}
        if mask is not None:
            inputs.append(helper.make_tensor_value_info("mask", t, ["L", "S"]))
            names.append("mask")
            feeds["mask"] = mask
        node = helper.make_node(
            "Attention", names, ["o"], is_causal=int(case.causal and mask is None), scale=1.0 / math.sqrt(D)
        )
        graph = helper.make_graph(
            [node], "attn", inputs, [helper.make_tensor_value_info("o", t, ["B", Hq, "L", D])]
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
        model.ir_version = 10
        sess = _ort_session(model, threads)
        return lambda: sess.run(None, feeds)[0]


class NumpyRef(Impl):
    name = "numpy"
    note = ""

    def prepare(self, inp, threads):
        case = inp.case
        if _scores_bytes(case) > SCORES_LIMIT:
            raise Skip(f"scores would take {_scores_bytes(case) / 2**30:.1f} GiB")
        k0 = inp.k[0] if case.kind == "varlen" else inp.k
        q0 = inp.q[0] if case.kind == "varlen" else inp.q
        if q0.dtype != np.float32 or k0.dtype != np.float32:
            inp = inp.as_float32()
            self.note = "computed in float32 on upcast inputs"
        qs = inp.q if case.kind == "varlen" else [inp.q]
        ks = inp.k if case.kind == "varlen" else [inp.k]
        vs = inp.v if case.kind == "varlen" else [inp.v]
        calls = []
        for q, k, v in zip(qs, ks, vs):
            L, S = q.shape[2], k.shape[2]
            m = bool_mask(L, S, case.causal, case.window)
            add = None if m is None else np.where(m, 0.0, -np.inf).astype(np.float32)
            calls.append((q, k, v, add))

        def run():
            with _blas_limit(threads):
                outs = [numpy_attention(*c) for c in calls]
            if case.kind == "varlen":
                return np.concatenate([o[0] for o in outs], axis=1)
            return outs[0]

        return run


class _blas_limit:
    """threadpoolctl limit on BLAS threads, when threadpoolctl is installed.  The
    controller (which scans the loaded libraries, ~3 ms; NumPy's BLAS is loaded
    before the first limit) is made once, so that a limit costs ~0.05 ms and can
    sit inside a timed call."""

    _controller = None

    def __init__(self, n):
        self.n = n
        self.ctx = None

    def __enter__(self):
        if _blas_limit._controller is None:
            try:
                from threadpoolctl import ThreadpoolController
            except ImportError:
                return self
            _blas_limit._controller = ThreadpoolController()
        self.ctx = _blas_limit._controller.limit(limits=self.n, user_api="blas")
        self.ctx.__enter__()
        return self

    def __exit__(self, *exc):
        if self.ctx is not None:
            self.ctx.__exit__(*exc)


def kv_reader(inp: Inputs, threads: int):
    """The decode yardstick: a callable in which ``threads`` Python threads each
    read a share of the case's own K and V bytes with a single-threaded BLAS
    GEMV against a cached vector of ones (the fastest NumPy read measured here:
    faster than a sum or an integer OR-reduce).  The bytes are viewed as float32
    whatever the dtype (16-bit pairs read as float32 are ordinary numbers; only
    the speed matters)."""
    shares: list = [[] for _ in range(threads)]
    for a in (inp.k, inp.v):
        flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8)  # the arrays are contiguous: no copy
        words = flat[: flat.size // 4 * 4].view(np.float32)
        rows = words.size // 4096
        for i, part in enumerate(np.array_split(np.arange(rows), threads)):
            if part.size:
                shares[i].append(words[part[0] * 4096 : (part[-1] + 1) * 4096].reshape(-1, 4096))
        if words.size > rows * 4096:
            shares[-1].append(words[rows * 4096 :].reshape(1, -1))
    return _gemv_reader(shares)


def _gemv_reader(shares: list):
    """A callable in which thread i reads the 2-D float32 arrays of ``shares[i]``
    (at most 4096 columns) with single-threaded BLAS GEMVs against ones."""
    ones = np.ones(4096, dtype=np.float32)

    def read(parts):
        for p in parts:
            p @ ones[: p.shape[1]]

    def run():
        with _blas_limit(1):
            _in_threads(read, shares)

    return run


def _in_threads(fn, parts) -> None:
    """fn(part) for every part, each in its own thread; returns when all are done."""
    ts = [threading.Thread(target=fn, args=(p,)) for p in parts]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


IMPLS = [FastAttn, Torch, OrtMHA, OrtAttention, NumpyRef]


# --------------------------------------------------------------------------- machine limits


def measure_gemm(threads: int, n: int = 2048, repeat: int = 5) -> float:
    """fp32 GEMM rate (GFLOP/s) of NumPy's BLAS, n×n×n."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    c = np.empty((n, n), dtype=np.float32)
    best = math.inf
    with _blas_limit(threads):
        np.matmul(a, b, out=c)
        for _ in range(repeat):
            t0 = time.perf_counter()
            np.matmul(a, b, out=c)
            best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best / 1e9


def measure_gemm_bf16(threads: int, n: int = 2048, repeat: int = 5) -> float | None:
    """bfloat16 GEMM rate (GFLOP/s) of ``torch.mm``, n×n×n: the machine's 16-bit
    limit (oneDNN uses AMX or AVX512-BF16 where present); None without torch."""
    try:
        import torch
    except ImportError:
        return None
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(0)
        a = torch.randn(n, n, generator=g).to(torch.bfloat16)
        b = torch.randn(n, n, generator=g).to(torch.bfloat16)
        torch.mm(a, b)
        best = math.inf
        for _ in range(repeat):
            t0 = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(prev)
    return 2.0 * n**3 / best / 1e9


def numpy_attention(q, k, v, add=None):
    """The plain NumPy baseline: softmax(q k^T / sqrt(D) + add) v in float32,
    materialising the scores; GQA by reshaping q (no copy of K/V)."""
    q, k, v = (a.astype(np.float32, copy=False) for a in (q, k, v))
    B, Hq, L, D = q.shape
    Hk = k.shape[1]
    g = Hq // Hk
    s = np.matmul(q.reshape(B, Hk, g * L, D), k.swapaxes(-1, -2))
    s *= np.float32(1.0 / math.sqrt(D))
    s = s.reshape(B, Hk, g, L, -1)
    if add is not None:
        s += add
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    return np.matmul(s.reshape(B, Hk, g * L, -1), v).reshape(B, Hq, L, -1)


def _read_parts(threads: int, nbytes: int) -> list:
    """A float32 array of ``nbytes`` as ``threads`` row blocks of 4096 values."""
    a = np.ones(nbytes // 4, dtype=np.float32)
    return np.array_split(a.reshape(-1, 4096), threads)


def mem_reader(threads: int, nbytes: int):
    """The machine-bandwidth yardstick of decode cases, timed in their interleaved
    rounds: a callable in which ``threads`` Python threads each read a share of one
    ``nbytes`` float32 array with a single-threaded GEMV against ones (the faster of
    the two reads ``measure_bandwidth`` tries, on every run here)."""
    return _gemv_reader([[p] for p in _read_parts(threads, nbytes)])


def measure_bandwidth(threads: int, nbytes: int = 1 << 30, repeat: int = 3) -> float:
    """Read bandwidth (GB/s): ``threads`` Python threads each reduce a part of a
    ``nbytes`` float32 array (NumPy releases the GIL), best of a sum and a GEMV
    against a cached vector."""
    parts = _read_parts(threads, nbytes)
    ones = np.ones(4096, dtype=np.float32)
    best = math.inf

    def go(fn):
        t0 = time.perf_counter()
        _in_threads(fn, parts)
        return time.perf_counter() - t0

    with _blas_limit(1):
        for fn in (lambda p: np.add.reduce(p, axis=None), lambda p: p @ ones):
            go(fn)
            for _ in range(repeat):
                best = min(best, go(fn))
    return nbytes / best / 1e9


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(threads: int, gemm: float | None, bw: float | None) -> dict:
    import importlib

    versions = {"numpy": np.__version__, "fastattn": fastattn.__version__}
    for mod in ("torch", "onnxruntime", "onnx"):
        try:
            versions[mod] = importlib.import_module(mod).__version__
        except ImportError:
            pass
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "isa": fastattn.get_isa(),
        "threads": threads,
        "gemm_gflops": gemm,
        "bandwidth_gbps": bw,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "versions": versions,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "OPENBLAS_CORETYPE": os.environ.get("OPENBLAS_CORETYPE"),
        "OPENBLAS_L2_SIZE": os.environ.get("OPENBLAS_L2_SIZE"),
    }


# --------------------------------------------------------------------------- timing


def _tolerance(inp: Inputs) -> float:
    q = inp.q[0] if isinstance(inp.q, list) else inp.q
    k = inp.k[0] if isinstance(inp.k, list) else inp.k
    return 3e-2 if (q.dtype.itemsize < 4) else (2e-3 if k.dtype.itemsize < 4 else 1e-3)


def check(fn, inp: Inputs, ref: np.ndarray) -> float:
    """Max error relative to the output scale."""
    out = np.asarray(fn(), dtype=np.float64)
    if out.shape != ref.shape:
        raise AssertionError(f"shape {out.shape} != {ref.shape}")
    return float(np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1e-30))


def _calls_per_sample(first: float, args) -> int:
    """Calls timed together per sample so that one sample lasts about args.min_time."""
    return max(1, min(100000, int(args.min_time / max(first, 1e-7))))


def run_case(case: Case, impls: list, args, log) -> list:
    """Check, then time every implementation of one case; returns records."""
    inp = make_inputs(case, args.dtype)
    small = check_slice(inp)
    ref = reference_output(small)
    tol = _tolerance(small)
    flops = case_flops(case)
    records, runners = [], []
    for cls in impls:
        impl = cls()
        rec = {
            "case": case.name,
            "impl": impl.name,
            "seconds": None,
            "seconds_min": None,
            "gflops": None,
            "gbps": None,
            "ratio": None,
            "status": "ok",
            "note": "",
            "max_err": None,
            "kind": case.kind,
            "dtype": case.kv_dtype or args.dtype,
            "L": case.L,
            "S": case.S,
        }
        records.append(rec)
        why = impl.available()
        if why is None and args.quick and case.window is not None and impl.name != "fastattn":
            why = "peers skipped in --quick (they compute the full L×S)"
        if why is not None:
            rec.update(status="skipped", note=why)
            continue
        try:
            err = check(impl.prepare(small, args.threads), small, ref)
        except Skip as e:
            rec.update(status="skipped", note=str(e))
            continue
        except Exception as e:  # noqa: BLE001 - a failing peer is reported, not fatal
            rec.update(status="failed", note=f"{type(e).__name__}: {str(e).splitlines()[0][:100]}")
            continue
        rec["max_err"] = err
        if not err <= tol:
            rec.update(status="failed", note=f"wrong result: max error {err:.2e} > {tol:.0e} of output scale")
            continue
        try:
            fn = impl.prepare(inp, args.threads)
            t0 = time.perf_counter()
            fn()
            first = time.perf_counter() - t0
        except Skip as e:
            rec.update(status="skipped", note=str(e))
            continue
        except Exception as e:  # noqa: BLE001
            rec.update(status="failed", note=f"{type(e).__name__}: {str(e).splitlines()[0][:100]}")
            continue
        rec["note"] = impl.note
        # a call slower than the whole budget is timed once: its first call is the sample
        runners.append((rec, fn, _calls_per_sample(first, args), [first] if first > args.budget else []))
    read_times: list = []
    mem_times: list = []
    if case.kind == "decode" and runners:
        reader = kv_reader(inp, args.threads)
        t0 = time.perf_counter()
        reader()
        first = time.perf_counter() - t0
        runners.append(({"impl": "kv-read"}, reader, _calls_per_sample(first, args), read_times))
        mem = mem_reader(args.threads, args.bw_bytes)
        t0 = time.perf_counter()
        mem()
        first = time.perf_counter() - t0
        runners.append(({"impl": "mem-read"}, mem, _calls_per_sample(first, args), mem_times))
    for _ in range(args.repeat):
        for _rec, fn, number, times in runners:
            if times and sum(times) * number > args.budget:  # slow peer: fewer rounds
                continue
            time.sleep(args.pause)
            t0 = time.perf_counter()
            for _ in range(number):
                fn()
            times.append((time.perf_counter() - t0) / number)
    fa = None
    read_gbps = mem_gbps = None
    if read_times:
        kv_bytes = _kv_bytes(case, _np_dtype(case.kv_dtype or args.dtype))
        read_gbps = kv_bytes / statistics.median(read_times) / 1e9
        mem_gbps = args.bw_bytes / statistics.median(mem_times) / 1e9
        del runners[-2:]
    for rec, _fn, _number, times in runners:
        rec["seconds"] = statistics.median(times)
        if read_gbps is not None:
            rec["read_gbps"] = read_gbps
            rec["mem_gbps"] = mem_gbps
        rec["seconds_min"] = min(times)
        rec["rounds"] = len(times)
        rec["gflops"] = flops / rec["seconds"] / 1e9
        if case.kind == "decode":
            rec["gbps"] = _kv_bytes(case, _np_dtype(case.kv_dtype or args.dtype)) / rec["seconds"] / 1e9
        if rec["impl"] == "fastattn":
            fa = rec["seconds"]
    if fa is not None:
        for rec in records:
            if rec["seconds"] is not None:
                rec["ratio"] = rec["seconds"] / fa  # fastattn's speedup over this implementation
    return records


def _fmt_time(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 1e-3:
        return f"{s * 1e6:8.1f} µs"
    if s < 1:
        return f"{s * 1e3:8.2f} ms"
    return f"{s:8.2f} s "


def print_case(case: Case, records: list, machine: dict, out) -> None:
    print(
        f"\n{case.name}  ({case_flops(case) / 1e9:.2f} GFLOP"
        + (
            f", K+V {_kv_bytes(case, _np_dtype(records[0]['dtype'])) / 2**20:.0f} MiB"
            if case.kind == "decode"
            else ""
        )
        + ")",
        file=out,
    )
    for r in records:
        if r["seconds"] is None:
            print(f"  {r['impl']:11s} {r['status']}: {r['note']}", file=out)
            continue
        if case.kind == "decode":
            rate = f"{r['gbps']:7.1f} GB/s"
            peak = r.get("read_gbps") or machine.get("bandwidth_gbps")
        else:
            rate = f"{r['gflops']:7.1f} GFLOP/s"
            peak = machine.get("gemm_bf16_gflops") or machine.get("gemm_gflops")
        what = ("kv-read" if r.get("read_gbps") else "bw") if case.kind == "decode" else "gemm"
        pct = (
            f"{100 * (r['gbps'] or r['gflops']) / peak:5.0f}% of {what:4s}"
            if peak and case.kind != "small"
            else " " * 16
        )
        if r.get("mem_gbps"):
            pct += f" {100 * r['gbps'] / r['mem_gbps']:4.0f}% of bw"
        ratio = ""
        if r["impl"] != "fastattn" and r["ratio"] is not None:
            ratio = (
                f"  fastattn {r['ratio']:.2f}x faster"
                if r["ratio"] >= 1
                else f"  fastattn {1 / r['ratio']:.2f}x slower"
            )
        note = f"  [{r['note']}]" if r["note"] else ""
        print(f"  {r['impl']:11s} {_fmt_time(r['seconds'])}  {rate}  {pct}{ratio}{note}", file=out)
    read = next((r for r in records if r.get("read_gbps")), None)
    if read:
        what = "(the same K and V read by the same threads: NumPy GEMVs)"
        print(f"  {'kv-read':11s} {'':11s}  {read['read_gbps']:7.1f} GB/s  {what}", file=out)
        what = "(one large array read by the same threads in the same rounds: the machine's bandwidth)"
        print(f"  {'bw':11s} {'':11s}  {read['mem_gbps']:7.1f} GB/s  {what}", file=out)


def causal_summary(records: list, out) -> None:
    """time(causal)/time(non-causal) per implementation: about 0.5 means masked work is skipped."""
    pairs = [("B1 H8 L1024 D64", "B1 H8 L1024 D64 causal"), ("B1 H8 L4096 D64", "B1 H8 L4096 D64 causal")]
    by = {(r["case"], r["impl"]): r["seconds"] for r in records}
    lines = []
    for full, causal in pairs:
        for impl in dict.fromkeys(r["impl"] for r in records):
            a, b = by.get((full, impl)), by.get((causal, impl))
            if a and b:
                lines.append(
                    f"  {impl:11s} {causal}: {b / a:.2f} of the non-causal time"
                    + ("  (masked work not skipped)" if b / a > 0.85 else "")
                )
    if lines:
        print(
            "\ncausal / non-causal time (0.5 = the masked half is skipped; two cases timed apart, "
            "so noisy on a busy machine):",
            file=out,
        )
        for line in lines:
            print(line, file=out)


def markdown_table(records: list, machine: dict) -> str:
    """One row per case: fastattn's time and rate, then fastattn's speedup over each peer."""
    impls = list(dict.fromkeys(r["impl"] for r in records if r["impl"] != "fastattn"))
    head = "| case | fastattn | rate | " + " | ".join(f"speedup vs {i}" for i in impls) + " |"
    lines = [head, "|" + "---|" * (3 + len(impls))]
    cases = list(dict.fromkeys(r["case"] for r in records))
    by = {(r["case"], r["impl"]): r for r in records}
    for c in cases:
        fa = by.get((c, "fastattn"))
        if fa is None or fa["seconds"] is None:
            continue
        if fa["kind"] == "decode":
            rate = f"{fa['gbps']:.1f} GB/s"
            if fa.get("read_gbps"):
                rate += f" ({100 * fa['gbps'] / fa['read_gbps']:.0f}% of kv-read"
                rate += f", {100 * fa['gbps'] / fa['mem_gbps']:.0f}% of bw)"
            elif machine.get("bandwidth_gbps"):
                rate += f" ({100 * fa['gbps'] / machine['bandwidth_gbps']:.0f}% bw)"
        elif fa["kind"] == "small":
            rate = "-"
        else:
            rate = f"{fa['gflops']:.1f} GFLOP/s"
            peak = machine.get("gemm_bf16_gflops") or machine.get("gemm_gflops")
            if peak:
                rate += f" ({100 * fa['gflops'] / peak:.0f}% gemm)"
        cells = []
        for i in impls:
            r = by.get((c, i))
            cells.append("-" if r is None or r["ratio"] is None else f"{r['ratio']:.2f}x")
        lines.append(f"| {c} | {_fmt_time(fa['seconds']).strip()} | {rate} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def select_cases(patterns: list | None, cases: list) -> list:
    if not patterns:
        return list(cases)
    names = {c.name for c in cases}
    exact = [p for p in patterns if p in names]
    loose = [p.lower() for p in patterns if p not in names]
    chosen = [c for c in cases if c.name in exact or any(p in c.name.lower() for p in loose)]
    if not chosen:
        raise SystemExit(f"no case matches {patterns}; cases: {', '.join(c.name for c in cases)}")
    return chosen


DESCRIPTION = __doc__.split("\n\n")[0].replace("``python -m fastattn.bench``", "``fastattn bench``")


EPILOG = "cases:\n  " + "\n  ".join(c.name for c in CASES)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``fastattn bench`` (the parser is :func:`fastattn.cli.build_parser`'s)."""
    p.add_argument("--threads", type=int, default=None, help="threads for every library (default: all cores)")
    p.add_argument("--cases", nargs="+", default=None, help="case names or substrings")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32")
    p.add_argument("--json", metavar="PATH", default=None, help="write records and machine info as JSON")
    p.add_argument(
        "--repeat", type=int, default=None, help="interleaved rounds per case (default 5, quick 2)"
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="a subset of the cases (unless --cases), fewer rounds, shorter samples (< 1 minute)",
    )
    p.add_argument(
        "--sweep",
        action="store_true",
        help="throughput vs L (256..8192, B1 H8 D64) for fastattn, torch, numpy (for benchmarks/plot.py)",
    )
    p.add_argument("--impls", nargs="+", default=None, help="restrict to these implementations")
    p.add_argument("--markdown", action="store_true", help="also print a Markdown summary table")
    p.add_argument("--no-machine", action="store_true", help="skip the GEMM and bandwidth measurements")


def finish_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Check the parsed options (``p.error`` on a bad one) and fill in the derived settings."""
    if args.threads is None:
        args.threads = os.cpu_count() or 1
    if args.threads < 1:
        p.error("--threads must be >= 1")
    if args.repeat is None:
        args.repeat = 2 if args.quick else 5
    if args.repeat < 1:
        p.error("--repeat must be >= 1")
    args.min_time = 0.02 if args.quick else 0.05
    args.pause = 0.1 if args.quick else 0.25
    args.bw_bytes = (256 << 20) if args.quick else (1 << 30)  # the bandwidth yardstick's array
    args.budget = 3.0 if args.quick else 10.0  # seconds of timed calls per implementation and case
    return args


def parse_args(argv):
    """The options of ``fastattn bench ARGV`` (parsed by the one command-line parser)."""
    from fastattn import cli

    p = cli.build_parser()
    return finish_args(p, p.parse_args(["bench", *argv]))


def main(argv=None) -> int:
    """``fastattn bench ARGV`` (``python -m fastattn.bench ARGV``); returns the exit status."""
    from fastattn import cli

    return cli.main(["bench", *(sys.argv[1:] if argv is None else argv)])


def run(args: argparse.Namespace) -> int:
    """Run the benchmark with parsed options (:func:`finish_args`); returns the exit status."""
    out = sys.stdout
    cases = sweep_cases() if args.sweep else CASES
    if args.quick and not args.cases and not args.sweep:
        cases = [c for c in cases if c.name in QUICK_CASES]
    cases = select_cases(args.cases, cases)
    impls = [FastAttn, Torch, NumpyRef] if args.sweep else IMPLS
    if args.impls:
        names = {cls.name: cls for cls in IMPLS}
        bad = [n for n in args.impls if n not in names]
        if bad:
            raise SystemExit(f"unknown implementation(s) {bad}; known: {', '.join(names)}")
        impls = [c for c in impls if c.name in args.impls]
        if FastAttn not in impls:
            impls.insert(0, FastAttn)
    print(
        f"fastattn {fastattn.__version__} on {cpu_model()} ({fastattn.get_isa()} kernels), "
        f"{args.threads} thread(s), dtype {args.dtype}",
        file=out,
    )
    for var in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"):
        if os.environ.get(var):
            print(
                f"note: {var}={os.environ[var]} is set and slows NumPy's BLAS (GEMM reference, numpy "
                "baseline); for the true limit run\n  env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE "
                "python -m fastattn.bench",
                file=out,
            )
            break
    gemm = bw = None
    if not args.no_machine:
        gemm = measure_gemm(args.threads)
        bw = measure_bandwidth(args.threads, nbytes=args.bw_bytes)
        print(
            f"machine: fp32 GEMM (numpy sgemm 2048^3) {gemm:.1f} GFLOP/s, read bandwidth {bw:.1f} GB/s"
            " (best of 6; decode cases compare with the median of their own rounds)",
            file=out,
        )
    machine = machine_info(args.threads, gemm, bw)
    if not args.no_machine and args.dtype == "bfloat16":
        gemm16 = measure_gemm_bf16(args.threads)
        if gemm16 is not None:
            # 16-bit cases are compared with the 16-bit limit, printed beside the fp32 one.
            machine["gemm_bf16_gflops"] = gemm16
            print(
                f"machine: bf16 GEMM (torch.mm 2048^3) {gemm16:.1f} GFLOP/s "
                f"({gemm16 / gemm:.1f}x the fp32 GEMM; bfloat16 cases are compared with it)",
                file=out,
            )
    records = []
    t_start = time.perf_counter()
    for case in cases:
        recs = run_case(case, impls, args, out)
        for r in recs:
            r["sweep"] = bool(args.sweep)
        print_case(case, recs, machine, out)
        out.flush()
        records.extend(recs)
    causal_summary(records, out)
    if not args.no_machine:  # measured again: on a busy machine one measurement may be low
        gemm2 = measure_gemm(args.threads)
        bw2 = measure_bandwidth(args.threads, nbytes=args.bw_bytes)
        print(
            f"\nmachine again at the end: fp32 GEMM {gemm2:.1f} GFLOP/s, read bandwidth {bw2:.1f} GB/s "
            "(the JSON keeps the higher of the two)",
            file=out,
        )
        machine["gemm_gflops"] = max(gemm, gemm2)
        machine["bandwidth_gbps"] = max(bw, bw2)
        if machine.get("gemm_bf16_gflops"):
            g16 = measure_gemm_bf16(args.threads) or 0.0
            print(f"bf16 GEMM again at the end: {g16:.1f} GFLOP/s", file=out)
            machine["gemm_bf16_gflops"] = max(machine["gemm_bf16_gflops"], g16)
    print(
        f"\n(time = median of {args.repeat} interleaved rounds (fewer for calls over "
        f"{args.budget / args.repeat:.0f} s); speedup = peer time / fastattn time; "
        f"total {time.perf_counter() - t_start:.0f} s)",
        file=out,
    )
    if args.markdown:
        print("\n" + markdown_table(records, machine), file=out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "records": records}, f, indent=1)
        print(f"wrote {args.json}", file=out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
