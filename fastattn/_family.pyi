"""Type stubs for the compiled module ``fastattn._family`` (fastattn/_family.pyx).

A thin binding to the additive-attention, LSH-attention and rotary kernels
(csrc/family.h): the public API is in :mod:`fastattn.additive`, :mod:`fastattn.lsh`
and :mod:`fastattn.positions`; these
functions trust their arguments (the callers have validated them).
"""

import numpy as np

ISA_CODES: dict[str, int]
DTYPE_CODES: dict[np.dtype, int]

def additive(
    pq: np.ndarray,
    pk: np.ndarray,
    w: np.ndarray,
    v: np.ndarray,
    out: np.ndarray,
    lse: np.ndarray | None,
    wts: np.ndarray | None,
    mask: np.ndarray | None,
    mask_kind: int,
    isa: str,
    num_threads: int,
) -> None: ...
def lsh(
    x: np.ndarray,
    v: np.ndarray,
    rot: np.ndarray,
    out: np.ndarray,
    lse: np.ndarray,
    n_buckets: int,
    n_hashes: int,
    chunk: int,
    causal: bool,
    scale: float,
    isa: str,
    num_threads: int,
) -> None: ...
def rotary(
    src: np.ndarray,
    dst: np.ndarray,
    pos: np.ndarray,
    cos: np.ndarray,
    sin: np.ndarray,
    interleaved: bool,
    num_threads: int,
    dst_at_pos: bool = False,
) -> None: ...
