"""Numerical accuracy report: fastattn against the float64 reference.

For float32, float16 and bfloat16 inputs, over key lengths up to 32k and
several score magnitudes, prints the maximum and mean relative error of
fastattn, of a naive same-precision NumPy softmax(QK^T)V and (when installed)
of PyTorch's SDPA.  Relative error = |out - ref| / max|ref| (max) and
mean|out - ref| / mean|ref| (mean).  The inputs are first rounded to the
dtype, so every implementation sees exactly the same numbers and the
reference computes on them in float64.

Exits non-zero when fastattn's float32 error exceeds twice the naive float32
error at some length (the bound promised in the README).

    python benchmarks/accuracy_report.py [--quick] [--markdown]
"""

from __future__ import annotations

import argparse
import sys

import ml_dtypes
import numpy as np

import fastattn
from fastattn import reference

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": BF16}


def naive(q, k, v, dtype):
    """softmax(QK^T / sqrt(D)) V with every intermediate in the given precision
    (bfloat16: computed in float32, each intermediate rounded to bfloat16)."""
    work = np.float16 if dtype == np.float16 else np.float32

    def rnd(x):
        return x.astype(BF16).astype(np.float32) if dtype == BF16 else x.astype(work)

    q, k, v = (rnd(a.astype(work)) for a in (q, k, v))
    s = rnd(np.matmul(q, np.swapaxes(k, -1, -2)) * work(1.0 / np.sqrt(q.shape[-1])))
    s = rnd(s - s.max(-1, keepdims=True))
    e = rnd(np.exp(s))
    p = rnd(e / rnd(e.sum(-1, keepdims=True)))
    return rnd(np.matmul(p, v))


def torch_sdpa(q, k, v):
    try:
        import torch
    except ImportError:
        return None
    to = {np.dtype(np.float32): torch.float32, np.dtype(np.float16): torch.float16, BF16: torch.bfloat16}
    tq, tk, tv = (torch.from_numpy(a.astype(np.float32)).to(to[a.dtype]) for a in (q, k, v))
    return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv).float().numpy()


def errors(out, ref):
    d = np.abs(out.astype(np.float64) - ref)
    return d.max() / np.abs(ref).max(), d.mean() / np.abs(ref).mean()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="lengths up to 4096 only")
    ap.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = ap.parse_args(argv)
    lengths = [256, 1024, 4096] if args.quick else [256, 1024, 4096, 16384, 32768]
    magnitudes = [1.0, 4.0, 16.0]  # standard deviation of the scaled scores
    rng = np.random.default_rng(0)
    B, H, L, D = 1, 2, 32, 64
    rows = []
    bound_ok = True
    for name, dt in DTYPES.items():
        for S in lengths:
            for mag in magnitudes:
                # q.k / sqrt(D) has standard deviation mag when q, k ~ N(0, sqrt(mag))
                q = (rng.standard_normal((B, H, L, D)) * np.sqrt(mag)).astype(dt)
                k = (rng.standard_normal((B, H, S, D)) * np.sqrt(mag)).astype(dt)
                v = rng.standard_normal((B, H, S, D)).astype(dt)
                ref = reference.scaled_dot_product_attention(q, k, v)
                fa = errors(fastattn.scaled_dot_product_attention(q, k, v), ref)
                nv = errors(naive(q, k, v, dt), ref)
                t = torch_sdpa(q, k, v)
                th = errors(t, ref) if t is not None else (float("nan"), float("nan"))
                rows.append((name, S, mag, fa, nv, th))
                if name == "float32" and fa[0] > 2 * nv[0]:
                    bound_ok = False
    hdr = [
        "dtype",
        "S",
        "score std",
        "fastattn max",
        "fastattn mean",
        "naive max",
        "naive mean",
        "torch max",
        "torch mean",
    ]
    if args.markdown:
        print("| " + " | ".join(hdr) + " |")
        print("|" + "---|" * len(hdr))
    else:
        print(" ".join(f"{h:>13s}" for h in hdr))
    for name, S, mag, fa, nv, th in rows:
        cells = [name, str(S), f"{mag:g}"] + [f"{x:.2e}" for x in (*fa, *nv, *th)]
        print(("| " + " | ".join(cells) + " |") if args.markdown else " ".join(f"{c:>13s}" for c in cells))
    print(
        f"\nfloat32 bound (fastattn max error <= 2 x naive float32 max error): "
        f"{'holds' if bound_ok else 'VIOLATED'}"
    )
    return 0 if bound_ok else 1


if __name__ == "__main__":
    sys.exit(main())
