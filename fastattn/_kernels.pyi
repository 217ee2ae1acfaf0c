"""Type stubs for the compiled module ``fastattn._kernels`` (fastattn/_kernels.pyx).

A thin binding to the C kernels: the public API is in :mod:`fastattn.functional`;
these functions trust their arguments (fastattn._args has checked them).
"""

import enum
from typing import Any

import numpy as np
import numpy.typing as npt

from ._plan import Plan

ISA_NAMES: tuple[str, ...]
DTYPE_CODES: dict[np.dtype[Any], int]
MASK_NONE: int
MASK_BOOL: int
MASK_F32: int
MASK_F64: int

# csrc/fastattn.h's enums (fastattn/_kernels.pxd), as classes and as plain ints.
class fa_dtype(enum.IntEnum):
    FA_F32 = 0
    FA_F64 = 1
    FA_F16 = 2
    FA_BF16 = 3
    FA_I8 = 4
    FA_E4M3 = 5
    FA_E5M2 = 6

class fa_mask_kind(enum.IntEnum):
    FA_MASK_NONE = 0
    FA_MASK_BOOL = 1
    FA_MASK_F32 = 2
    FA_MASK_F64 = 3

class fa_isa(enum.IntEnum):
    FA_ISA_SCALAR = 0
    FA_ISA_AVX2 = 1
    FA_ISA_AVX512 = 2
    FA_ISA_AMX = 3
    FA_ISA_AVX512BF16 = 4
    FA_ISA_NEON = 5
    FA_ISA_SVE = 6

class fa_precision(enum.IntEnum):
    FA_PRECISION_HIGHEST = 0
    FA_PRECISION_HIGH = 1
    FA_PRECISION_MEDIUM = 2

class fa_status(enum.IntEnum):
    FA_OK = 0
    FA_ENOMEM = 1
    FA_EINVAL = 2
    FA_ETHREADS = 3

FA_F32: int
FA_F64: int
FA_F16: int
FA_BF16: int
FA_I8: int
FA_E4M3: int
FA_E5M2: int
FA_MASK_NONE: int
FA_MASK_BOOL: int
FA_MASK_F32: int
FA_MASK_F64: int
FA_ISA_SCALAR: int
FA_ISA_AVX2: int
FA_ISA_AVX512: int
FA_ISA_AMX: int
FA_ISA_AVX512BF16: int
FA_ISA_NEON: int
FA_ISA_SVE: int
FA_PRECISION_HIGHEST: int
FA_PRECISION_HIGH: int
FA_PRECISION_MEDIUM: int
FA_OK: int
FA_ENOMEM: int
FA_EINVAL: int
FA_ETHREADS: int

def attention(plan: Plan) -> None:
    """Run the fused kernel on a 4-D ``fastattn._plan.Plan`` (trusted: checked when built)."""

def small_call_dims(q: object, k: object, v: object) -> tuple[int, int, int, int, int, int] | None:
    """``(B, Hq, L, D, S, Dv)`` when q, k, v suit the small-call fast path unchanged, else None."""

def heads_together(on: bool) -> bool:
    """Paged single-row decode runs several kv heads' tasks together (on, the default)
    or one task per head; returns the old setting (a test hook, process-wide)."""
    ...

def exp2(x: npt.NDArray[np.float32], isa: str) -> npt.NDArray[np.float32]:
    """The vectorised exp2 of one ISA path (a test hook)."""

def positive_normal_f32(a: npt.NDArray[np.float32]) -> bool:
    """Every value of the C-contiguous float32 ``a`` a finite positive normal (one pass)."""

def cpu_has(isa: str) -> bool: ...
def isa_best() -> str: ...
def isa_get() -> str: ...
def isa_set(isa: str) -> bool:
    """Select an ISA path; returns False when the CPU lacks it."""

def cpu_features() -> dict[str, bool | int]: ...
def amx_fp16_usable() -> bool: ...
def cache_sizes() -> dict[str, int]: ...
def tiles_set_rows(rows: int) -> bool: ...
def tiles_get_rows() -> int: ...
def tiles_rows(D: int, Dv: int, L: int, dtype: str, causal: bool = False, heads: int = 1) -> int: ...
def openmp_enabled() -> bool: ...
def omp_max_threads() -> int: ...
def attention_backward(
    plan: Plan,
    dout: np.ndarray,
    dq: np.ndarray,
    dk: np.ndarray,
    dv: np.ndarray,
    dsinks: npt.NDArray[np.float64] | None,
) -> None:
    """Run the fused backward kernel on the forward's 4-D plan (compute dtype); every argument is trusted."""
