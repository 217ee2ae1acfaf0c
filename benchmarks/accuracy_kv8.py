"""Accuracy of 8-bit K/V caches: fastattn on quantised keys and values against float32 attention.

For int8, fp8 e4m3fn and fp8 e5m2, with per-token scales (one per token and head, as
``fastattn.quantize_kv`` and ``KVCache(dtype=...)`` make them) and with the keys scaled per
channel (one scale per head-dim channel over the whole cache, as KIVI and OpenVINO quantise
keys; values stay per token), prints the error of fastattn's output and LSE against the
float64 oracle (:mod:`fastattn.reference`) on the float32 keys and values before
quantisation; bfloat16 and float16 K/V (no scales) are printed beside them for scale.

The data look like a real model's cache rather than standard normals: keys with a few outlier
channels (4 of D = 128 scaled by 10 to 20, the pattern KIVI and KVQuant report for
pre-RoPE/post-RoPE keys) plus a per-token offset shared by all channels of a token, values
standard normal, queries standard normal.  The outlier channels make the scores large (a
standard deviation near 3), so each query attends to a few keys and the output's largest
values are those of single value rows (``ref max|out|`` in each table's header).  Errors:
``out max`` / ``out mean`` = max / mean ``|out - ref|`` over the outputs; ``lse max`` = max
``|lse - ref lse|`` (natural log units: 0.01 is a 1% error in the softmax denominator).
One seeded draw per length: the same numbers on every machine up to the last digit or so
(the kernels' float32 rounding differs between instruction sets; the quantisation error
is far larger).

    python benchmarks/accuracy_kv8.py [--quick] [--markdown]
"""

from __future__ import annotations

import argparse
import sys

import ml_dtypes
import numpy as np

import fastattn
from fastattn import reference

FORMATS = ("int8", "float8_e4m3fn", "float8_e5m2")
QMAX = {"int8": 127.0, "float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}
HALF = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16)}


def cache_like(rng, B, H, S, D, outliers=4):
    """Keys with ``outliers`` channels (the same ones in every head) scaled by 10 to 20 and a
    per-token offset N(0, 1) added to every channel of the token; standard normal values."""
    k = rng.standard_normal((B, H, S, D), dtype=np.float32)
    chans = rng.choice(D, size=outliers, replace=False)
    k[..., chans] *= rng.uniform(10, 20, size=outliers).astype(np.float32)
    k += rng.standard_normal((B, H, S, 1), dtype=np.float32)
    v = rng.standard_normal((B, H, S, D), dtype=np.float32)
    return k, v


def per_channel_scale(x, fmt):
    """One scale per head-dim channel over the whole sequence: max over tokens of |x| / QMAX,
    shape (B, H, 1, D)."""
    s = np.abs(x).max(axis=2, keepdims=True) / np.float32(QMAX[fmt])
    return np.maximum(s, np.finfo(np.float32).tiny).astype(np.float32)


def oracle(q, k, v):
    """The float64 oracle's output and LSE on the float32 keys and values."""
    out, lse = reference.scaled_dot_product_attention(q, k, v, return_lse=True)
    return np.asarray(out, np.float64), np.asarray(lse, np.float64)


def errors(out, lse, ref, ref_lse):
    d = np.abs(np.asarray(out, np.float64) - ref)
    return d.max(), d.mean(), np.abs(np.asarray(lse, np.float64) - ref_lse).max()


def rows_for(q, k, v):
    """(format, K scales, V scales, out max, out mean, lse max) for every scheme on one cache."""
    ref, ref_lse = oracle(q, k, v)
    rows = []
    for name, dt in HALF.items():
        out, lse = fastattn.scaled_dot_product_attention(q, k.astype(dt), v.astype(dt), return_lse=True)
        rows.append((name, "-", "-", *errors(out, lse, ref, ref_lse)))
    for fmt in FORMATS:
        v8, vs = fastattn.quantize_kv(v, fmt)  # values: per token in both schemes
        k8, ks = fastattn.quantize_kv(k, fmt)
        out, lse = fastattn.scaled_dot_product_attention(q, k8, v8, k_scale=ks, v_scale=vs, return_lse=True)
        rows.append((fmt, "per token", "per token", *errors(out, lse, ref, ref_lse)))
        kc, kcs = fastattn.quantize_kv(k, fmt, scale=per_channel_scale(k, fmt))
        out, lse = fastattn.scaled_dot_product_attention(q, kc, v8, k_scale=kcs, v_scale=vs, return_lse=True)
        rows.append((fmt, "per channel", "per token", *errors(out, lse, ref, ref_lse)))
    return rows, float(np.abs(ref).max())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="S = 1024 only")
    ap.add_argument("--markdown", action="store_true", help="print Markdown tables")
    args = ap.parse_args(argv)
    lengths = [1024] if args.quick else [1024, 8192]
    B, H, L, D = 1, 8, 32, 128
    hdr = ["K/V", "K scale", "V scale", "out max", "out mean", "lse max"]
    for S in lengths:
        rng = np.random.default_rng(S)
        q = rng.standard_normal((B, H, L, D), dtype=np.float32)
        k, v = cache_like(rng, B, H, S, D)
        rows, ref_max = rows_for(q, k, v)
        print(
            f"\nB{B} H{H} L{L} S{S} D{D}: keys with 4 outlier channels (x10-20) and a per-token offset, "
            f"values N(0, 1); errors against float32 attention (ref max|out| {ref_max:.3f})\n"
        )
        if args.markdown:
            print("| " + " | ".join(hdr) + " |")
            print("|" + "---|" * len(hdr))
        else:
            print(" ".join(f"{h:>13s}" for h in hdr))
        for name, ksc, vsc, *err in rows:
            cells = [name, ksc, vsc] + [f"{x:.2e}" for x in err]
            print(
                ("| " + " | ".join(cells) + " |") if args.markdown else " ".join(f"{c:>13s}" for c in cells)
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
