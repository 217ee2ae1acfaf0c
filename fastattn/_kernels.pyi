"""Type stubs for the compiled module ``fastattn._kernels`` (fastattn/_kernels.pyx).

A thin binding to the C kernels: the public API is in :mod:`fastattn.functional`;
these functions trust their arguments (the callers have validated them).
"""

import numpy as np
import numpy.typing as npt

ISA_NAMES: tuple[str, ...]
DTYPE_CODES: dict[str, int]
MASK_NONE: int
MASK_BOOL: int
MASK_F32: int
MASK_F64: int

def attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    out: np.ndarray,
    lse: np.ndarray | None,
    mask: np.ndarray | None,
    mask_kind: int,
    scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi: npt.NDArray[np.float64] | None,
    sinks: npt.NDArray[np.float64] | None,
    q_lens: npt.NDArray[np.int64] | None,
    k_lens: npt.NDArray[np.int64] | None,
    cu_q: npt.NDArray[np.int64] | None,
    cu_k: npt.NDArray[np.int64] | None,
    bmask: npt.NDArray[np.bool_] | None,
    bm_q: int,
    bm_k: int,
    num_threads: int,
    seq_q: int = ...,
    seq_k: int = ...,
    precision: int = ...,
) -> None:
    """Run the fused kernel on 4-D ``(B, H, L, D)`` views; every argument is trusted."""

def exp2(x: npt.NDArray[np.float32], isa: str) -> npt.NDArray[np.float32]:
    """The vectorised exp2 of one ISA path (a test hook)."""

def cpu_has(isa: str) -> bool: ...
def isa_best() -> str: ...
def isa_get() -> str: ...
def isa_set(isa: str) -> bool:
    """Select an ISA path; returns False when the CPU lacks it."""

def cpu_features() -> dict[str, bool]: ...
def openmp_enabled() -> bool: ...
def omp_max_threads() -> int: ...
def attention_backward(
    dout: np.ndarray,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    out: np.ndarray,
    lse: np.ndarray,
    dq: np.ndarray,
    dk: np.ndarray,
    dv: np.ndarray,
    mask: np.ndarray | None,
    mask_kind: int,
    scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi: npt.NDArray[np.float64] | None,
    sinks: npt.NDArray[np.float64] | None,
    dsinks: npt.NDArray[np.float64] | None,
    q_lens: npt.NDArray[np.int64] | None,
    k_lens: npt.NDArray[np.int64] | None,
    num_threads: int,
) -> None:
    """Run the fused backward kernel on 4-D views in the compute dtype; every argument is trusted."""
