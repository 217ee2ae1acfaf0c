"""An emulator of fastattn._cuda for machines without a GPU.

"Device" memory is host memory: device pointers are host addresses, so
fastattn.cuda's Python layer (argument checks, uploads, layouts, broadcast
strides, the record handed to C) runs unchanged against it.

``attention(record, stream)`` reads the record the way csrc/cuda/module.c
does: its field table (name, C type, use) is parsed from module.c itself
(:data:`FIELDS`), so the two cannot drift apart; the nvcc build test compares
:data:`FIELDS` with the built module's ``PARAMS``.  It then checks the C
contract of fa_cuda_attention (csrc/cuda/fastattn_cuda.h) and computes the
attention in float64 from the fa_params fields.  The enum values (fa_dtype,
fa_mask_kind) come from the CPU extension, never typed here.
"""

from __future__ import annotations

import ctypes
import operator
import os
import re
from typing import Any

import numpy as np

from fastattn import _kernels
from fastattn._checks import bfloat16_dtype

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODULE_C = os.path.join(ROOT, "csrc", "cuda", "module.c")
FASTATTN_H = os.path.join(ROOT, "csrc", "fastattn.h")

_TYPES = {"INT": "int", "I64": "int64", "F64": "float64", "PTR": "pointer"}
_USES = {"REQUIRED": "required", "UNSUPPORTED": "unsupported", "IGNORED": "ignored"}


def _parse_fields(path: str) -> tuple[tuple[str, str, str], ...]:
    """((name, type, use), ...) of the FA_FIELD lines of module.c's FIELDS, in
    the spelling of the built module's ``PARAMS``."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    body = text[text.index("static const fa_field FIELDS[]") :]
    body = body[: body.index("};")]
    rows = re.findall(r"FA_FIELD\((\w+), FA_T_(\w+), FA_USE_(\w+)\)", body)
    if not rows:
        raise RuntimeError(f"no FA_FIELD entries found in {path}")
    return tuple((n, _TYPES[t], _USES[u]) for n, t, u in rows)


def fa_params_fields(path: str = FASTATTN_H) -> tuple[str, ...]:
    """The field names of ``typedef struct fa_params`` in csrc/fastattn.h, in order."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    body = text[text.index("typedef struct fa_params {") :]
    body = body[body.index("{") + 1 : body.index("} fa_params;")]
    body = re.sub(r"/\*.*?\*/", " ", body, flags=re.S)
    names: list[str] = []
    for decl in body.split(";"):
        decl = decl.strip()
        if not decl:
            continue
        # "const void *q" / "int64_t q_sb, q_sh" / "const int64_t *q_lens, *k_lens"
        first, *rest = decl.split(",")
        names.append(re.findall(r"\w+", first)[-1])
        names.extend(re.findall(r"\w+", r)[-1] for r in rest)
    return tuple(names)


FIELDS = _parse_fields(MODULE_C)


class Params:
    """The fa_params fields read from a record (attribute per field name);
    pointers are ints, or None for NULL."""

    def __getattr__(self, name: str) -> Any:  # fields module.c does not read stay 0 (its memset)
        if name.startswith("__"):
            raise AttributeError(name)
        return None if any(n == name and t == "pointer" for n, t, _ in FIELDS) else 0


def read_record(rec: Any) -> Params:
    """module.c's params_from_record: a dict by key, anything else by attribute."""
    p = Params()
    for name, typ, use in FIELDS:
        if use == "ignored":
            continue
        v: Any
        if isinstance(rec, dict):
            present, v = name in rec, rec.get(name)
        else:
            present, v = hasattr(rec, name), getattr(rec, name, None)
        if not present:
            if use == "unsupported":
                continue
            raise KeyError(f"attention record: missing field {name}")
        if typ == "float64":
            try:  # PyFloat_AsDouble: __float__ or __index__, never a str
                x: Any = float(v) if not isinstance(v, (str, bytes)) else None
            except (TypeError, ValueError):
                x = None
            if x is None:
                raise TypeError(f"attention record: {name} must be a float, got {type(v).__name__}")
            zero = x == 0.0
        elif typ == "pointer" and v is None:
            x, zero = None, True
        else:
            try:
                x = operator.index(v)
            except TypeError:
                what = "an int (device pointer) or None" if typ == "pointer" else "an int"
                raise TypeError(f"attention record: {name} must be {what}, got {type(v).__name__}") from None
            limit = {"int": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1), "pointer": (0, 2**64 - 1)}
            lo, hi = limit[typ]
            if not lo <= x <= hi:
                raise OverflowError(f"attention record: {name} is out of range for a C {typ}")
            zero = x == 0
            if typ == "pointer" and x == 0:
                x = None
        if use == "unsupported" and not zero:
            must = "None" if typ == "pointer" else "0"
            raise ValueError(f"{name} is not supported by the CUDA kernels (it must be {must})")
        setattr(p, name, x)
    return p


def _codes() -> tuple[dict[int, np.dtype[Any]], dict[int, np.dtype[Any]]]:
    """{fa_dtype: storage dtype} for the GPU's dtypes and {fa_mask_kind: mask
    element dtype}, with the CPU extension's values."""
    dt: dict[int, np.dtype[Any]] = {
        _kernels.FA_F32: np.dtype(np.float32),
        _kernels.FA_F16: np.dtype(np.float16),
        _kernels.FA_BF16: bfloat16_dtype(),
    }
    masks: dict[int, np.dtype[Any]] = {
        _kernels.FA_MASK_BOOL: np.dtype(np.uint8),
        _kernels.FA_MASK_F32: np.dtype(np.float32),
        _kernels.FA_MASK_F64: np.dtype(np.float64),
    }
    return dt, masks


def host_view(ptr: int, shape: tuple[int, ...], strides: tuple[int, ...], dtype: Any) -> np.ndarray:
    """ndarray over raw memory at ptr with element strides (may be 0 or negative)."""
    dtype = np.dtype(dtype)
    item = dtype.itemsize
    if any(n == 0 for n in shape):
        return np.empty(shape, dtype)
    lo = hi = 0
    for n, s in zip(shape, strides):
        d = (n - 1) * s * item
        lo, hi = (lo + d, hi) if d < 0 else (lo, hi + d)
    nbytes = hi - lo + item
    buf = (ctypes.c_uint8 * nbytes).from_address(ptr + lo)
    return np.ndarray(shape, dtype, buffer=buf, offset=-lo, strides=[s * item for s in strides])


class EmulatedCuda:
    """Stands in for fastattn._cuda: 'device' memory is host memory."""

    BUILD_ARCHS, NVCC_VERSION, MAX_HEAD_DIM = "emulated", "emulated", 256
    PARAMS = FIELDS

    def __init__(self) -> None:
        self.blocks: dict[int, np.ndarray] = {}
        self.launches: list[dict[str, Any]] = []  # each record as launched, plus its "stream"
        self.dtypes, self.masks = _codes()

    def device_count(self) -> int:
        return 1

    def device_count_error(self) -> str | None:
        return None

    def device_name(self, i: int = 0) -> tuple[str, int, int]:
        return ("emulator", 0, 0)

    def versions(self) -> tuple[int, int]:
        return (0, 0)

    def malloc(self, n: int) -> int:
        a = np.full(n, 0xAB, dtype=np.uint8)  # garbage, as cudaMalloc gives
        self.blocks[a.ctypes.data] = a
        return int(a.ctypes.data)

    def free(self, ptr: int) -> None:
        del self.blocks[ptr]

    def memcpy_htod(self, dst: int, src: int, n: int) -> None:
        ctypes.memmove(dst, src, n)

    memcpy_dtoh = memcpy_htod

    def synchronize(self) -> None:
        pass

    def stream_synchronize(self, s: int) -> None:
        pass

    def _check(self, p: Params) -> None:
        """fa_cuda_attention's checks of the C contract (RuntimeError, as the module raises)."""

        def fail(msg: str) -> None:
            raise RuntimeError(f"fastattn CUDA attention: {msg}")

        if p.B < 0 or p.Hq < 0 or p.Hk < 1 or p.L < 0 or p.S < 0 or p.D < 1 or p.Dv < 1:
            fail("invalid sizes")
        if p.Hq % p.Hk:
            fail("Hq must be a multiple of Hk")
        if p.D > self.MAX_HEAD_DIM or p.Dv > self.MAX_HEAD_DIM:
            fail("head dims must be <= 256 on the GPU")
        if p.mask_kind not in (_kernels.FA_MASK_NONE, *self.masks) or (
            p.mask_kind != _kernels.FA_MASK_NONE and p.mask is None
        ):
            fail(f"invalid mask kind {p.mask_kind}")
        if p.o_dtype != p.q_dtype or p.v_dtype != p.k_dtype:
            fail("o_dtype must equal q_dtype, v_dtype must equal k_dtype")
        f32 = _kernels.FA_F32
        if (
            p.q_dtype not in self.dtypes
            or p.k_dtype not in self.dtypes
            or (p.k_dtype != p.q_dtype and p.q_dtype != f32)
        ):
            fail(f"unsupported dtype combination q={p.q_dtype} kv={p.k_dtype}")

    def attention(self, rec: Any, stream: int | None = 0) -> None:
        p = read_record(rec)
        self.launches.append({**(rec if isinstance(rec, dict) else vars(rec)), "stream": stream or 0})
        self._check(p)
        if p.B == 0 or p.Hq == 0 or p.L == 0:
            return
        B, Hq, Hk, L, S, D, Dv = p.B, p.Hq, p.Hk, p.L, p.S, p.D, p.Dv
        qt, kt = self.dtypes[p.q_dtype], self.dtypes[p.k_dtype]
        q = host_view(p.q, (B, Hq, L, D), (p.q_sb, p.q_sh, p.q_sl, 1), qt).astype(np.float64)
        k = host_view(p.k, (B, Hk, S, D), (p.k_sb, p.k_sh, p.k_sl, 1), kt).astype(np.float64)
        v = host_view(p.v, (B, Hk, S, Dv), (p.v_sb, p.v_sh, p.v_sl, 1), kt).astype(np.float64)
        o = host_view(p.o, (B, Hq, L, Dv), (p.o_sb, p.o_sh, p.o_sl, 1), qt)
        G = Hq // Hk
        k, v = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)
        s = np.einsum("bhld,bhsd->bhls", q, k) * p.scale
        if p.softcap:
            s = p.softcap * np.tanh(s / p.softcap)
        Sb = np.full(B, S) if p.k_lens is None else host_view(p.k_lens, (B,), (1,), np.int64).copy()
        ip = np.arange(L)[None, :, None] + (Sb - L)[:, None, None]  # (B, L, 1)
        j = np.arange(S)[None, None, :]
        if p.alibi is not None:
            sl = host_view(p.alibi, (B, Hq), (p.alibi_sb, p.alibi_sh), np.float64)
            s = s - sl[:, :, None, None] * np.abs(ip - j)[:, None]
        if p.mask_kind != _kernels.FA_MASK_NONE:
            m = host_view(p.mask, (B, Hq, L, S), (p.m_sb, p.m_sh, p.m_sl, p.m_ss), self.masks[p.mask_kind])
            s = (
                np.where(m != 0, s, -np.inf)
                if p.mask_kind == _kernels.FA_MASK_BOOL
                else s + m.astype(np.float64)
            )
        ok = j < Sb[:, None, None]
        if p.causal:
            ok = ok & (j <= ip)
        if p.window_left >= 0:
            ok = ok & (j >= ip - p.window_left)
        if p.window_right >= 0:
            ok = ok & (j <= ip + p.window_right)
        s = np.where(ok[:, None], s, -np.inf)
        mx = s.max(axis=-1, keepdims=True) if S else np.full(s.shape[:-1] + (1,), -np.inf)
        mx = np.where(np.isfinite(mx), mx, 0.0)
        e = np.exp(s - mx)
        den = e.sum(-1, keepdims=True)
        with np.errstate(divide="ignore", invalid="ignore"):
            res = np.where(den > 0, (e @ v) / den, 0.0)
            lse = np.where(den[..., 0] > 0, mx[..., 0] + np.log(den[..., 0]), -np.inf)
        poisoned = np.isnan(s).any(-1)  # a NaN score in a row's visible range poisons the row
        res[poisoned] = np.nan
        lse[poisoned] = np.nan
        o[...] = res.astype(qt)
        if p.lse is not None:
            lv = host_view(p.lse, (B, Hq, L), (p.lse_sb, p.lse_sh, p.lse_sl), np.float32)
            lv[...] = lse
