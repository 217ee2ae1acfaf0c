"""The benchmark cases, their FLOP and byte counts, masks and the NumPy baseline: written once.

Used by ``fastattn bench`` (forward and ``--backward`` case sets), by the timing table of
``python -m fastattn`` (:data:`TABLE_CASES`) and by the asv benchmarks in ``benchmarks/``.

This module needs NumPy only (ml_dtypes for bfloat16, imported when asked for) and imports
nothing else of fastattn: the asv benchmarks load this file from the checkout that runs
them, so that every commit they time (older ones too) meets the same cases and the same
baseline.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

Array = npt.NDArray[Any]

SCORES_LIMIT = 2 * 10**9  # implementations that materialise the scores skip cases above this
MASK_LIMIT = 1024**3  # peers get an explicit (L, S) mask only below this many bytes

# The attn_mask kinds of a masked case (Case.mask), built by case_mask:
#   "padding":  bool (B, 1, 1, S) key-padding mask, True = may attend;
#   "hf_float": the same padding as a dense float32 (B, 1, L, S) mask, 0 where visible and
#               np.finfo(float32).min where padded (what Hugging Face's eager attention builds);
#   "random":   a dense bool (B, 1, L, S) mask, about 90% True, every row with a True.
MASKS = ("padding", "hf_float", "random")

# The 8-bit K/V formats of a case's kv_dtype (int8; fp8 from ml_dtypes), each with the short
# name of its case names and the largest finite magnitude its per-token scale maps max|x| to
# (the scales fastattn.quantize_kv computes: int8 rounded to nearest, fp8 by ml_dtypes' cast).
KV8 = ("int8", "float8_e4m3fn", "float8_e5m2")
KV8_SHORT = {"int8": "int8", "float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}
KV8_QMAX = {"int8": 127.0, "float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}


@dataclasses.dataclass(frozen=True)
class Case:
    """One benchmark shape.  ``kind`` is prefill, decode, varlen or small.

    ``page`` > 0: K/V are read from a pool of ``page``-token pages through a shuffled block
    table (:func:`paged_pool`): fastattn only, timed against its own call on the same
    contents without pages (a decode case: the contiguous cache) or, for a varlen case with
    ``q_lens`` (chunked prefill), against the separate calls the one call replaces.
    ``q_lens``: a varlen case's queries per sequence (its last positions, bottom-right
    causal) when they are fewer than its keys ``seqlens``; () = ``seqlens``."""

    name: str
    B: int
    Hq: int
    Hk: int
    L: int
    S: int
    D: int
    causal: bool = False
    window: tuple[int, int] | None = None
    kv_dtype: str | None = None  # None: the --dtype of the run; one of KV8: 8-bit K/V (kv8_inputs)
    kind: str = "prefill"
    seqlens: tuple[int, ...] = ()
    mask: str | None = None  # one of MASKS: an explicit attn_mask (case_mask), the same for every peer
    q_dtype: str | None = None  # None: float32 in a case with its own kv_dtype, else the --dtype of the run
    page: int = 0  # > 0: K/V in pages of this many tokens, shuffled (paged_pool); 0: contiguous
    q_lens: tuple[int, ...] = ()  # varlen: queries per sequence, the last of its seqlens keys

    def __post_init__(self) -> None:
        if self.mask is not None:
            if self.mask not in MASKS:
                raise ValueError(f"Case.mask must be None or one of {MASKS}, got {self.mask!r}")
            # one mask per case: the peers would otherwise have to merge it with their
            # causal / window flags (torch takes attn_mask or is_causal, not both)
            if self.causal or self.window is not None or self.kind == "varlen":
                raise ValueError("a masked case cannot be causal, windowed or varlen")
        if self.kv_dtype in KV8 and (self.kind == "varlen" or self.mask is not None):
            raise ValueError("an 8-bit K/V case cannot be varlen or masked")
        if self.page and (self.kind not in ("decode", "varlen") or self.mask is not None):
            raise ValueError("a paged case is decode or varlen, without a mask")
        if self.q_lens and (
            self.kind != "varlen"
            or len(self.q_lens) != len(self.seqlens)
            or any(not 1 <= m <= n for m, n in zip(self.q_lens, self.seqlens))
        ):
            raise ValueError("q_lens: a varlen case's 1 <= queries <= keys of each sequence")

    @property
    def kv8(self) -> bool:
        """K/V in an 8-bit format with per-token scales (:func:`kv8_inputs`)."""
        return self.kv_dtype in KV8

    @property
    def gqa(self) -> bool:
        return self.Hq != self.Hk

    @property
    def query_lens(self) -> tuple[int, ...]:
        """A varlen case's queries per sequence (``q_lens``, else ``seqlens``)."""
        return self.q_lens or self.seqlens


@dataclasses.dataclass(frozen=True)
class BackwardCase:
    """One forward + backward shape (``fastattn bench --backward``): float32, Hq = Hk, L = S;
    ``dropout``: the attention dropout probability of both implementations (training)."""

    name: str
    B: int
    H: int
    L: int
    D: int
    causal: bool = False
    dropout: float = 0.0

    def quick(self) -> BackwardCase:
        """The ``--quick`` smoke-test shape (:data:`QUICK_WHAT`); its name stays the case's."""
        return dataclasses.replace(self, H=2, L=max(self.L // 8, 16))


# What BackwardCase.quick does, in the words of ``fastattn bench --backward --quick``'s output.
QUICK_WHAT = "2 heads and L / 8 (at least 16)"


def _varlen_lengths() -> tuple[int, ...]:
    rng = np.random.default_rng(1234)
    return tuple(int(x) for x in rng.integers(128, 2049, size=8))


def _kv8_cases() -> list[Case]:
    """Decode B1 H32 S32768 D128 and GQA B1 H32/8 S65536 D128 (float32 queries), and a causal
    B1 H8 L2048 D128 prefill (bfloat16 queries), in each 8-bit format."""
    out = []
    for fmt in KV8:
        kv = KV8_SHORT[fmt] + "kv"
        out += [
            Case(f"B1 H32 S32768 D128 decode {kv}", 1, 32, 32, 1, 32768, 128, kv_dtype=fmt, kind="decode"),
            Case(f"B1 H32/8 S65536 D128 decode {kv}", 1, 32, 8, 1, 65536, 128, kv_dtype=fmt, kind="decode"),
            Case(
                f"B1 H8 L2048 D128 causal {kv}",
                1,
                8,
                8,
                2048,
                2048,
                128,
                causal=True,
                kv_dtype=fmt,
                q_dtype="bfloat16",
            ),
        ]
    return out


def _paged_cases() -> list[Case]:
    """Paged decode of B4 GQA 32/8 sequences of 8192 tokens, D128, in 16-token pages (vLLM's
    size) with K/V in bfloat16, the run's dtype and int8 (per-token scales paged with the
    tokens), of B4 multi-head (32/32) sequences of 2048 tokens in bfloat16 and int8, and of
    one int8 sequence of 512 tokens; and one chunked-prefill call: decode
    rows of 6 sequences of 4096 cached tokens beside a 512-query prefill chunk of a seventh
    (2048 tokens with the chunk), bottom-right causal, the same pages."""
    out = [
        Case(
            f"B4 H32/8 S8192 D128 decode{kv} page16",
            4,
            32,
            8,
            1,
            8192,
            128,
            kv_dtype=dt,
            kind="decode",
            page=16,
        )
        for dt, kv in (("bfloat16", " bf16kv"), (None, ""), ("int8", " int8kv"))
    ]
    # Multi-head (no GQA: Llama-2-class models), one query row per kv head: the decode's
    # single-row path, whose products per key are a quarter of GQA 32/8's.
    out += [
        Case(
            f"B4 H32 S2048 D128 decode{kv} page16",
            4,
            32,
            32,
            1,
            2048,
            128,
            kv_dtype=dt,
            kind="decode",
            page=16,
        )
        for dt, kv in (("bfloat16", " bf16kv"), ("int8", " int8kv"))
    ]
    # A short context (one sequence of 512 tokens): the call's fixed cost, checks included,
    # weighs beside its 1 MiB of pages as it does in a serving step of a small batch.
    out.append(
        Case(
            "B1 H32/8 S512 D128 decode int8kv page16",
            1,
            32,
            8,
            1,
            512,
            128,
            kv_dtype="int8",
            kind="decode",
            page=16,
        )
    )
    out.append(
        Case(
            "chunked prefill H32/8 D128 page16: 6 decode rows + a 512-query chunk",
            7,
            32,
            8,
            0,
            0,
            128,
            causal=True,
            kind="varlen",
            seqlens=(4096,) * 6 + (2048,),
            q_lens=(1,) * 6 + (512,),
            page=16,
        )
    )
    return out


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
    # explicit attn_mask cases (case_mask), each beside its unmasked shape (MASK_PAIRS)
    Case("B8 H12 L512 D64", 8, 12, 12, 512, 512, 64),
    Case("B8 H12 L512 D64 padding", 8, 12, 12, 512, 512, 64, mask="padding"),
    Case("B8 H12 L512 D64 hf_float", 8, 12, 12, 512, 512, 64, mask="hf_float"),
    Case("B8 H12 L512 D64 random", 8, 12, 12, 512, 512, 64, mask="random"),
    Case("B1 H32 L2048 D128", 1, 32, 32, 2048, 2048, 128),
    Case("B1 H32 L2048 D128 padding", 1, 32, 32, 2048, 2048, 128, mask="padding"),
    Case("B1 H32 L2048 D128 hf_float", 1, 32, 32, 2048, 2048, 128, mask="hf_float"),
    # 8-bit K/V with per-token scales (kv8_inputs); fastattn on float32 and bfloat16 K/V of the
    # same contents is timed beside each in its own rounds (runner.run_case, KV8_COMPARE)
    *_kv8_cases(),
    # paged K/V (paged_pool); fastattn on the same contents without pages, or the separate
    # calls a chunked-prefill call replaces, is timed beside each (runner.run_case)
    *_paged_cases(),
]

QUICK_CASES = (
    "B1 H8 L1024 D64",
    "B1 H8 L1024 D64 causal",
    "B1 H32/8 S8192 D128 decode",
    "B1 H32 S8192 D128 decode f16kv",
    "B1 H8 L16 D64",
    "B8 H12 L512 D64 padding",
    "B1 H32/8 S65536 D128 decode int8kv",  # at quick_case's size: S8192
    "B1 H8 L2048 D128 causal e5m2kv",  # L512
    "B4 H32/8 S8192 D128 decode int8kv page16",  # at quick_case's size: S2048
    "chunked prefill H32/8 D128 page16: 6 decode rows + a 512-query chunk",  # keys / 4
)

# What fastattn's 8-bit K/V calls are timed against in the same rounds: fastattn on the same
# contents (the dequantised K/V) in these dtypes, as implementations named fastattn-<short>kv.
KV8_COMPARE = {"bfloat16": "bf16", "float32": "f32"}


def quick_case(case: Case) -> Case:
    """The case at the size ``--quick`` runs it: an 8-bit K/V case at S / 8 (decode) or
    L = S / 4 (prefill), renamed to that size; a paged decode case at S / 4, a chunked
    prefill case with a quarter of each sequence's keys (its queries capped there); every
    other case unchanged."""
    if case.page and case.kind == "decode":
        S = max(case.S // 4, 16)
        return dataclasses.replace(case, name=case.name.replace(f"S{case.S}", f"S{S}"), S=S)
    if case.page:
        keys = tuple(max(n // 4, 1) for n in case.seqlens)
        return dataclasses.replace(
            case, seqlens=keys, q_lens=tuple(min(m, n) for m, n in zip(case.query_lens, keys))
        )
    if not case.kv8:
        return case
    if case.kind == "decode":
        S = max(case.S // 8, 16)
        return dataclasses.replace(case, name=case.name.replace(f"S{case.S}", f"S{S}"), S=S)
    L = max(case.L // 4, 16)
    return dataclasses.replace(case, name=case.name.replace(f"L{case.L}", f"L{L}"), L=L, S=L)


# The pairs of the causal / non-causal summary of a forward run.
CAUSAL_PAIRS = (
    ("B1 H8 L1024 D64", "B1 H8 L1024 D64 causal"),
    ("B1 H8 L4096 D64", "B1 H8 L4096 D64 causal"),
)

# The pairs of the masked / unmasked summary: every masked case and the unmasked case of its shape.
MASK_PAIRS = tuple(
    (u.name, c.name)
    for c in CASES
    if c.mask is not None
    for u in CASES
    if u.mask is None and u == dataclasses.replace(c, name=u.name, mask=None)
)

SWEEP_LENGTHS = (256, 512, 1024, 2048, 4096, 8192)

BACKWARD_CASES = [
    BackwardCase("B1 H8 L2048 D64", 1, 8, 2048, 64),
    BackwardCase("B1 H8 L2048 D64 causal", 1, 8, 2048, 64, causal=True),
    BackwardCase("B4 H8 L512 D128 causal", 4, 8, 512, 128, causal=True),
    # training with attention dropout: a BERT-base fine-tuning batch and a causal LM
    BackwardCase("B8 H12 L128 D64 dropout 0.1", 8, 12, 128, 64, dropout=0.1),
    BackwardCase("B1 H8 L2048 D64 dropout 0.1 causal", 1, 8, 2048, 64, causal=True, dropout=0.1),
]


def _table_case(B: int, H: int, L: int, S: int, D: int, causal: bool = False) -> Case:
    kind = "decode" if L == 1 else "prefill"
    return Case(f"B{B} H{H} L{L} S{S} D{D}{' causal' if causal else ''}", B, H, H, L, S, D, causal, kind=kind)


# The float32 timing table of ``python -m fastattn`` (fastattn against numpy_attention).
TABLE_CASES = [
    _table_case(1, 8, 512, 512, 64),
    _table_case(1, 8, 512, 512, 64, causal=True),
    _table_case(1, 8, 1024, 1024, 64),
    _table_case(1, 8, 1024, 1024, 64, causal=True),
    _table_case(1, 8, 2048, 2048, 64),
    _table_case(1, 8, 2048, 2048, 64, causal=True),
    _table_case(1, 8, 1, 4096, 64),  # decode
    _table_case(4, 32, 1, 2048, 128),  # batched decode, larger heads
]


def sweep_cases() -> list[Case]:
    """Non-causal B1 H8 D64 cases over L (the ``--sweep`` option)."""
    return [Case(f"B1 H8 L{n} D64", 1, 8, 8, n, n, 64) for n in SWEEP_LENGTHS]


def by_name(name: str) -> Case:
    """The case of :data:`CASES` called ``name`` (KeyError if none)."""
    for c in CASES:
        if c.name == name:
            return c
    raise KeyError(name)


def select_cases(patterns: Sequence[str] | None, cases: Sequence[Any]) -> list[Any]:
    """The cases named in ``patterns`` exactly, or whose names contain one (any case);
    SystemExit with the list of names when none matches."""
    if not patterns:
        return list(cases)
    names = {c.name for c in cases}
    exact = [p for p in patterns if p in names]
    loose = [p.lower() for p in patterns if p not in names]
    chosen = [c for c in cases if c.name in exact or any(p in c.name.lower() for p in loose)]
    if not chosen:
        raise SystemExit(f"no case matches {list(patterns)}; cases: {', '.join(c.name for c in cases)}")
    return chosen


# --------------------------------------------------------------------------- dtypes and sizes


def np_dtype(name: str) -> np.dtype[Any]:
    """The NumPy dtype called ``name`` (bfloat16 from ml_dtypes)."""
    if name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        import ml_dtypes

        named: np.dtype[Any] = np.dtype(getattr(ml_dtypes, name))
        return named
    return np.dtype(name)


def visible_pairs(L: int, S: int, causal: bool, window: tuple[int, int] | None) -> int:
    """Number of (query, key) pairs a row-wise mask leaves visible (bottom-right aligned)."""
    off = S - L
    left, right = (-1, -1) if window is None else window
    i = np.arange(L, dtype=np.int64) + off  # bottom-right position of each query row
    hi = np.full(L, S - 1, dtype=np.int64)
    lo = np.zeros(L, dtype=np.int64)
    if causal:
        hi = np.minimum(hi, i)
    if right >= 0:
        hi = np.minimum(hi, i + right)
    if left >= 0:
        lo = np.maximum(lo, i - left)
    return int(np.maximum(hi - lo + 1, 0).sum())


def case_flops(case: Case) -> float:
    """4·D per visible (query, key) pair per batch and query head."""
    if case.kind == "varlen":
        pairs = sum(
            visible_pairs(m, n, case.causal, case.window) for m, n in zip(case.query_lens, case.seqlens)
        )
        return 4.0 * case.Hq * case.D * pairs
    if case.mask is not None:  # the pairs the mask leaves visible, over the batch
        return 4.0 * case.Hq * case.D * mask_pairs(case)
    return 4.0 * case.B * case.Hq * case.D * visible_pairs(case.L, case.S, case.causal, case.window)


def kv_bytes(case: Case, dtype: np.dtype[Any]) -> int:
    """Bytes of the case's K and V (Hk heads) in ``dtype``: what a decode step must read;
    an 8-bit ``dtype`` adds its float32 per-token scales (one per token and head of K and
    of V: 4 / D bytes per cache byte)."""
    n = 2 * case.B * case.Hk * case.S
    scales = 4 * n if dtype.itemsize == 1 else 0
    return n * case.D * dtype.itemsize + scales


def scores_bytes(case: Case) -> int:
    """Bytes of the float32 scores an implementation that materialises them needs at once."""
    if case.kind == "varlen":
        return max(case.Hq * m * n * 4 for m, n in zip(case.query_lens, case.seqlens))
    return case.B * case.Hq * case.L * case.S * 4


# --------------------------------------------------------------------------- inputs, masks, the baseline


def random_inputs(case: Case, dtype: str, seed: int = 0) -> tuple[Any, Any, Any]:
    """Standard normal q (B,Hq,L,D), k/v (B,Hk,S,D) in ``dtype`` (lists of per-sequence
    (1,H,n,D) arrays for varlen); a case with its own K/V dtype keeps q in float32 (or its
    ``q_dtype``).  An 8-bit K/V case: ValueError (its scales come with :func:`kv8_inputs`)."""
    if case.kv8:
        raise ValueError(f"case {case.name!r} has 8-bit K/V: its inputs are kv8_inputs(case)")
    rng = np.random.default_rng(seed)
    qdt = np_dtype(case.q_dtype or ("float32" if case.kv_dtype else dtype))
    kvdt = np_dtype(case.kv_dtype or dtype)

    def gen(shape: tuple[int, ...], dt: np.dtype[Any]) -> Array:
        return rng.standard_normal(shape, dtype=np.float32).astype(dt)

    if case.kind == "varlen":
        qs = [gen((1, case.Hq, m, case.D), qdt) for m in case.query_lens]
        ks = [gen((1, case.Hk, n, case.D), kvdt) for n in case.seqlens]
        vs = [gen((1, case.Hk, n, case.D), kvdt) for n in case.seqlens]
        return qs, ks, vs
    return (
        gen((case.B, case.Hq, case.L, case.D), qdt),
        gen((case.B, case.Hk, case.S, case.D), kvdt),
        gen((case.B, case.Hk, case.S, case.D), kvdt),
    )


def quantize_per_token(x: Array, fmt: str) -> tuple[Array, Array]:
    """``(q, scale)``: float32 ``x`` (..., D) in the 8-bit format ``fmt`` (one of :data:`KV8`)
    with one float32 scale per row, ``max|x| / KV8_QMAX[fmt]`` (1 for a row of zeros), shape
    (..., 1): int8 rounded to nearest (ties to even), fp8 by ml_dtypes' cast; what
    ``fastattn.quantize_kv(x, fmt)`` returns, written here in NumPy (this module imports no
    fastattn: asv loads it on its own)."""
    qmax = np.float32(KV8_QMAX[fmt])
    amax = np.max(np.abs(x), axis=-1, keepdims=True).astype(np.float32)
    s = np.where(amax > 0, amax / qmax, np.float32(1.0)).astype(np.float32)
    s = np.maximum(s, np.finfo(np.float32).tiny)  # a scale that would be a denormal: the least normal
    y = x.astype(np.float32) / s
    if fmt == "int8":
        q = np.clip(np.rint(y), -127, 127).astype(np.int8)
    else:
        q = np.clip(y, -qmax, qmax).astype(np_dtype(fmt))
    return q, s


def kv8_inputs(case: Case, seed: int = 0) -> tuple[Array, Array, Array, Array, Array]:
    """``(q, k, v, k_scale, v_scale)`` of an 8-bit K/V case: the standard normal q, k, v of
    :func:`random_inputs` (the same draws as the float cases), q in ``case.q_dtype`` (default
    float32), K and V quantised to ``case.kv_dtype`` with per-token float32 scales
    (B, Hk, S, 1) (:func:`quantize_per_token`).  Dequantised K is
    ``k.astype(float32) * k_scale``."""
    assert case.kv_dtype in KV8, case
    rng = np.random.default_rng(seed)
    qdt = np_dtype(case.q_dtype or "float32")
    q = rng.standard_normal((case.B, case.Hq, case.L, case.D), dtype=np.float32).astype(qdt)
    k, ks = quantize_per_token(
        rng.standard_normal((case.B, case.Hk, case.S, case.D), dtype=np.float32), case.kv_dtype
    )
    v, vs = quantize_per_token(
        rng.standard_normal((case.B, case.Hk, case.S, case.D), dtype=np.float32), case.kv_dtype
    )
    return q, k, v, ks, vs


def paged_pool(xs: Sequence[Array], page: int, seed: int = 0) -> tuple[Array, Array]:
    """Sequences' K, V or per-token scales (each ``(H, n_b, X)``) as one pool of ``page``-token
    pages ``(num_pages, H, page, X)`` and its block table ``(len(xs), max pages)`` int32:
    logical page i of sequence b is ``pool[table[b, i]]``.  The pages lie in a random order
    (``seed``: one order for a case's K, V and scales), so that a sequence's pages lie
    scattered, as in a server's pool after many sequences came and went; a
    sequence's last page is zero past its end, unused table entries are 0."""
    counts = [-(-x.shape[1] // page) for x in xs]
    order = np.random.default_rng(seed).permutation(sum(counts))
    H, X = xs[0].shape[0], xs[0].shape[2]
    pool = np.zeros((len(order), H, page, X), xs[0].dtype)
    table = np.zeros((len(xs), max(counts)), np.int32)
    at = 0
    for b, (x, c) in enumerate(zip(xs, counts)):
        ids = order[at : at + c]
        at += c
        table[b, :c] = ids
        padded = np.zeros((H, c * page, X), x.dtype)
        padded[:, : x.shape[1]] = x
        pool[ids] = padded.reshape(H, c, page, X).transpose(1, 0, 2, 3)
    return pool, table


def bool_mask(L: int, S: int, causal: bool, window: tuple[int, int] | None) -> Array | None:
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


def additive_mask(
    L: int, S: int, causal: bool, window: tuple[int, int] | None, dtype: Any = np.float32
) -> Array | None:
    """The (L, S) mask of :func:`bool_mask` as 0 / -inf in ``dtype``, or None when all visible."""
    m = bool_mask(L, S, causal, window)
    return None if m is None else np.where(m, 0.0, -np.inf).astype(dtype)


def padding_lengths(case: Case) -> Array:
    """The valid key lengths (B,) of the padding masks: drawn (fixed seed) between S/2 and S,
    batch 0 full, as in a padded batch whose longest sequence sets S; a single sequence
    (B = 1) keeps 80% of S."""
    S = case.S
    if case.B == 1:
        return np.array([max(1, round(0.8 * S))], dtype=np.int64)
    n = np.random.default_rng(4321).integers(max(1, S // 2), S + 1, size=case.B)
    n[0] = S
    return n


def case_mask(case: Case) -> Array | None:
    """The attn_mask of a masked case (see :data:`MASKS`), None for the others; the same
    for every implementation (each converts it to its own convention outside the timing)."""
    if case.mask is None:
        return None
    B, L, S = case.B, case.L, case.S
    if case.mask == "random":
        m = np.random.default_rng(8765).random((B, 1, L, S)) < 0.9
        m[..., 0] |= ~m.any(axis=-1)  # no row without a visible key (its softmax would be 0/0)
        return m
    keep = np.arange(S)[None, :] < padding_lengths(case)[:, None]  # (B, S)
    if case.mask == "padding":
        out: Array = keep[:, None, None, :]
        return out
    # "hf_float": materialised at (B, 1, L, S) as Hugging Face's eager attention gets it
    add = np.where(keep, np.float32(0), np.finfo(np.float32).min).astype(np.float32)
    return np.ascontiguousarray(np.broadcast_to(add[:, None, None, :], (B, 1, L, S)))


def mask_visible(mask: Array) -> Array:
    """Where ``mask`` lets a query see a key: True of a bool mask; above float32's lowest
    value (Hugging Face's "masked") and not -inf of a float one."""
    if mask.dtype == np.bool_:
        return mask
    out: Array = mask > np.finfo(np.float32).min
    return out


def mask_additive(mask: Array) -> Array:
    """``mask`` as a float32 array added to the scores (a bool one as 0 / -inf); same shape."""
    if mask.dtype == np.bool_:
        return np.where(mask, np.float32(0), np.float32(-np.inf))
    return mask.astype(np.float32, copy=False)


@functools.lru_cache(maxsize=16)
def mask_pairs(case: Case) -> int:
    """The (query, key) pairs of one head the case's mask leaves visible, over the batch."""
    m = case_mask(case)
    assert m is not None
    return int(np.broadcast_to(mask_visible(m), (case.B, 1, case.L, case.S)).sum())


def numpy_attention(q: Array, k: Array, v: Array, add: Array | None = None) -> Array:
    """The plain NumPy baseline: softmax(q k^T / sqrt(D) + add) v in float32,
    materialising the scores; GQA by reshaping q (no copy of K/V), so ``add`` broadcasts
    against scores shaped (B, Hk, Hq / Hk, L, S)."""
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
    out: Array = np.matmul(s.reshape(B, Hk, g * L, -1), v).reshape(B, Hq, L, -1)
    return out
