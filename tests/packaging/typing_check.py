"""A small user script for ``mypy --strict``: the public API is typed well
enough that ordinary use type-checks (run by tests/packaging/test_packaging.py)."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

import fastattn


def attend(q: npt.NDArray[np.float32], k: npt.NDArray[np.float32], v: npt.NDArray[np.float32]) -> float:
    out: np.ndarray = fastattn.scaled_dot_product_attention(q, k, v, is_causal=True, num_threads=1)
    o2, lse = fastattn.scaled_dot_product_attention(q, k, v, return_lse=True, layout="bhsd", window=(8, 0))
    merged, mlse = fastattn.merge_attention_states([out, o2], [lse, lse])
    packed = fastattn.varlen_attention(
        q[0].swapaxes(0, 1),
        k[0].swapaxes(0, 1),
        v[0].swapaxes(0, 1),
        np.array([0, q.shape[2]]),
        np.array([0, k.shape[2]]),
        is_causal=True,
    )
    jx = fastattn.dot_product_attention(
        q.swapaxes(1, 2), k.swapaxes(1, 2), v.swapaxes(1, 2), local_window_size=(4, 0), is_causal=True
    )
    fastattn.set_num_threads(2)
    n: int = fastattn.get_num_threads()
    fastattn.set_num_threads(None)
    isa: str = fastattn.get_isa()
    fastattn.set_isa(isa)
    return float(merged.sum() + mlse.sum() + packed.sum() + jx.sum()) + n


if __name__ == "__main__":
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 2, 16, 8)).astype(np.float32)
    print(attend(q, q, q))
