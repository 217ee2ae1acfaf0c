"""Greedy decoding with a KV cache on a tiny random-weight decoder, checked step by step.

A 2-layer decoder (embedding 64, 4 query heads, 2 key/value heads, RoPE,
RMSNorm, SwiGLU MLP; random weights, all in NumPy) generates tokens for a
ragged batch of two prompts (lengths 5 and 9).  Each layer keeps a
:class:`fastattn.KVCache`; the prompts are prefilled one sequence at a time
with ``batch_index`` and then both sequences decode together, one token per
step, attending over their own cached prefixes.

At every step the logits are recomputed from scratch: the whole sequence so
far through the model with full causal attention
(:func:`fastattn.scaled_dot_product_attention`, keys/values rounded to the
cache dtype as the cache stores them).  The script prints the largest
difference and exits with status 1 if it exceeds the tolerance.

    python examples/generate.py [--steps 16] [--dtype float32|float16|bfloat16]
"""

from __future__ import annotations

import argparse
import sys

import ml_dtypes
import numpy as np

import fastattn

VOCAB, EMBED, HEADS, KV_HEADS, LAYERS, HIDDEN = 97, 64, 4, 2, 2, 128
HEAD_DIM = EMBED // HEADS


def make_weights(rng):
    def w(*shape):
        return (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)

    layers = [
        dict(
            wq=w(EMBED, HEADS * HEAD_DIM),
            wk=w(EMBED, KV_HEADS * HEAD_DIM),
            wv=w(EMBED, KV_HEADS * HEAD_DIM),
            wo=w(HEADS * HEAD_DIM, EMBED),
            w_gate=w(EMBED, HIDDEN),
            w_up=w(EMBED, HIDDEN),
            w_down=w(HIDDEN, EMBED),
            norm1=np.ones(EMBED, np.float32),
            norm2=np.ones(EMBED, np.float32),
        )
        for _ in range(LAYERS)
    ]
    return dict(
        embed=rng.standard_normal((VOCAB, EMBED)).astype(np.float32),
        layers=layers,
        norm=np.ones(EMBED, np.float32),
        head=w(EMBED, VOCAB),
    )


def rms_norm(x, g, eps=1e-6):
    return (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * g).astype(np.float32)


def rope(x, pos):
    """Rotary embedding of x (n, H, T, Dh) at absolute positions pos (n, T)."""
    half = HEAD_DIM // 2
    freq = 10000.0 ** (-np.arange(half) / half)
    ang = (pos[:, None, :, None] * freq).astype(np.float32)  # (n, 1, T, half)
    c, s = np.cos(ang), np.sin(ang)
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1).astype(np.float32)


def heads(x, h):
    """(n, T, h*Dh) -> (n, h, T, Dh)."""
    n, T, _ = x.shape
    return x.reshape(n, T, h, HEAD_DIM).transpose(0, 2, 1, 3)


def forward(weights, tokens, pos, attend):
    """Logits (n, T, VOCAB) of tokens (n, T) at positions pos (n, T); ``attend(layer, q, k, v)``
    does the attention of one layer on (n, H, T, Dh) arrays and returns (n, HEADS, T, Dh)."""
    x = weights["embed"][tokens]
    for li, p in enumerate(weights["layers"]):
        h = rms_norm(x, p["norm1"])
        q = rope(heads(h @ p["wq"], HEADS), pos)
        k = rope(heads(h @ p["wk"], KV_HEADS), pos)
        v = heads(h @ p["wv"], KV_HEADS)
        o = attend(li, q, k, v)
        n, _, T, _ = o.shape
        x = x + o.transpose(0, 2, 1, 3).reshape(n, T, EMBED) @ p["wo"]
        h = rms_norm(x, p["norm2"])
        g = h @ p["w_gate"]
        x = x + ((g / (1 + np.exp(-g))) * (h @ p["w_up"])) @ p["w_down"]
    return rms_norm(x, weights["norm"]) @ weights["head"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=16, help="tokens to generate")
    ap.add_argument(
        "--dtype", default="float32", choices=["float32", "float16", "bfloat16"], help="KV cache dtype"
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    dtype = np.dtype(ml_dtypes.bfloat16) if args.dtype == "bfloat16" else np.dtype(args.dtype)
    rng = np.random.default_rng(args.seed)
    weights = make_weights(rng)
    prompts = [rng.integers(0, VOCAB, size=5), rng.integers(0, VOCAB, size=9)]  # a ragged batch
    B = len(prompts)
    max_len = max(len(p) for p in prompts) + args.steps
    caches = [fastattn.KVCache(B, KV_HEADS, max_len, HEAD_DIM, dtype=dtype) for _ in range(LAYERS)]

    def cached_attention(index):
        def attend(li, q, k, v):
            caches[li].append(k, v, batch_index=index)
            return caches[li].attend(q, batch_index=index)

        return attend

    def full_logits(seq):
        """Recompute the whole sequence without a cache; logits of its last token."""
        toks = np.asarray(seq)[None]
        pos = np.arange(len(seq))[None]

        def attend(li, q, k, v):  # the cache stores k, v rounded to its dtype: do the same
            return fastattn.scaled_dot_product_attention(
                q, k.astype(dtype), v.astype(dtype), is_causal=True, enable_gqa=True
            )

        return forward(weights, toks, pos, attend)[0, -1]

    seqs = [list(p) for p in prompts]
    last = np.zeros((B, VOCAB), np.float32)
    for b, p in enumerate(prompts):  # ragged prefill: one sequence at a time
        logits = forward(weights, p[None], np.arange(len(p))[None], cached_attention(b))
        last[b] = logits[0, -1]
    max_diff, scale = 0.0, 0.0
    for _ in range(args.steps):
        for b in range(B):  # check the cached logits against a full recomputation
            ref = full_logits(seqs[b])
            max_diff = max(max_diff, float(np.abs(last[b] - ref).max()))
            scale = max(scale, float(np.abs(ref).max()))
        nxt = last.argmax(axis=-1)
        for b in range(B):
            seqs[b].append(int(nxt[b]))
        pos = np.array([[len(s) - 1] for s in seqs])
        last = forward(weights, nxt[:, None], pos, cached_attention(None))[:, -1]
    # float32 arithmetic through 2 layers: the two paths differ in summation order (~1e-6), and with
    # a 16-bit cache a key or value computed in a different order may round to the neighbouring
    # 16-bit number, a change of one ulp that a small fraction of reaches the logits.
    eps16 = 0.0 if dtype == np.float32 else float(ml_dtypes.finfo(dtype).eps)
    tol = (1e-4 + eps16 / 8) * max(1.0, scale)
    for b in range(B):
        print(f"sequence {b}: prompt {prompts[b].tolist()} -> generated {seqs[b][len(prompts[b]) :]}")
    print(f"cache dtype {dtype}, lengths {caches[0].lengths.tolist()}, {sum(c.nbytes for c in caches)} bytes")
    print(
        f"max |cached - full| over {args.steps} steps = {max_diff:.3e} (logit scale {scale:.3g}, "
        f"tolerance {tol:.1e})"
    )
    if not max_diff <= tol:
        print("FAILED: the cached decoding differs from full attention", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
