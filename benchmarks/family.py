"""Benchmarks of the attention family beyond dot-product (issue 23).

Run as a script for the targets, in interleaved rounds (A, B, A, B, ...; the
median of each; the machine may be shared)::

    python benchmarks/family.py [--threads N] [--rounds R] [--only additive,lsh,rotary]

- additive: ``fastattn.additive_attention`` against the same computation
  written in torch (broadcast ``tanh`` over (L, S, A), then matmul), L = S =
  1024, A = D = 128 (target >= 3x);
- lsh: ``fastattn.lsh_attention`` at L = 65536, D = 64, 2 rounds, chunk 64
  against fastattn's own full attention over the same tokens (target >= 20x);
  ``--cpu`` adds both at 1 thread in CPU time of the calling thread (robust to
  a loaded machine);
- rotary: a decode step of ``attention_with_kvcache`` (B1 H32/8 S8192 D128,
  float16 cache) with fused rotary against the same step without (target:
  within 10%).

The classes below are asv benchmarks over the same cases (smaller LSH length:
asv repeats each case many times).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

import fastattn

try:
    from .common import THREADS, cases
except ImportError:  # run as a script: python benchmarks/family.py
    from common import THREADS, cases  # type: ignore[no-redef]

# the rotary decode step: the f16 KV cache case of ``fastattn bench``
DECODE = cases.by_name("B1 H32/8 S8192 D128 decode f16kv")


# ------------------------------------------------------------------ inputs


def additive_inputs(L=1024, S=1024, D=128, A=128, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, L, D), dtype=np.float32)
    k = rng.standard_normal((1, S, D), dtype=np.float32)
    v = rng.standard_normal((1, S, D), dtype=np.float32)
    wq = (rng.standard_normal((A, D)) / np.sqrt(D)).astype(np.float32)
    wk = (rng.standard_normal((A, D)) / np.sqrt(D)).astype(np.float32)
    w = rng.standard_normal(A).astype(np.float32)
    b = (0.1 * rng.standard_normal(A)).astype(np.float32)
    return q, k, v, wq, wk, w, b


def torch_additive(threads):
    """The torch formulation (None when torch is absent)."""
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(threads)

    def run(q, k, v, wq, wk, w, b):
        with torch.inference_mode():
            q, k, v, wq, wk, w, b = (torch.from_numpy(a) for a in (q, k, v, wq, wk, w, b))
            pq = q @ wq.T + b
            pk = k @ wk.T
            e = torch.tanh(pq[..., :, None, :] + pk[..., None, :, :]) @ w  # (B, L, S, A) -> (B, L, S)
            return (torch.softmax(e, dim=-1) @ v).numpy()

    return run


def decode_inputs(case=DECODE, seed=0):
    B, Hq, Hk, S, D = case.B, case.Hq, case.Hk, case.S, case.D
    dtype = cases.np_dtype(case.kv_dtype)
    rng = np.random.default_rng(seed)
    kc = rng.standard_normal((B, Hk, S, D), dtype=np.float32).astype(dtype)
    vc = rng.standard_normal((B, Hk, S, D), dtype=np.float32).astype(dtype)
    q = rng.standard_normal((B, Hq, 1, D), dtype=np.float32)
    kn = rng.standard_normal((B, Hk, 1, D), dtype=np.float32)
    vn = rng.standard_normal((B, Hk, 1, D), dtype=np.float32)
    cos, sin = fastattn.rotary_cos_sin(S, D)
    return kc, vc, q, kn, vn, cos, sin


# ------------------------------------------------------------------ timing


def _time(fn, n=1):
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n


def interleaved(fns: dict, rounds: int, calls: int = 1) -> dict:
    """Median seconds per call of each function, timed in alternating rounds."""
    for fn in fns.values():  # warm up (threads, page faults, caches)
        fn()
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(_time(fn, calls))
    return {name: statistics.median(t) for name, t in times.items()}


def bench_additive(threads, rounds):
    q, k, v, wq, wk, w, b = additive_inputs()
    fns = {"fastattn": lambda: fastattn.additive_attention(q, k, v, wq, wk, w, bias=b, num_threads=threads)}
    tr = torch_additive(threads)
    if tr is not None:
        ref = tr(q, k, v, wq, wk, w, b)
        err = float(np.abs(fns["fastattn"]() - ref).max())
        fns["torch"] = lambda: tr(q, k, v, wq, wk, w, b)
    res = interleaved(fns, rounds)
    line = f"additive L=S=1024 A=D=128 ({threads} threads): fastattn {res['fastattn'] * 1e3:.1f} ms"
    if "torch" in res:
        line += f", torch {res['torch'] * 1e3:.1f} ms, speedup {res['torch'] / res['fastattn']:.1f}x"
        line += f" (max |diff| {err:.1e})"
    return line


def bench_lsh(threads, rounds, L=65536, D=64, cpu=False):
    rng = np.random.default_rng(0)
    qk = rng.standard_normal((1, L, D), dtype=np.float32)
    val = rng.standard_normal((1, L, D), dtype=np.float32)
    kn = qk / np.linalg.norm(qk, axis=-1, keepdims=True)

    def lsh():
        return fastattn.lsh_attention(
            qk, val, n_buckets=256, n_hashes=2, chunk_size=64, seed=0, num_threads=threads
        )

    def full():  # fastattn's own full attention over the same keys
        return fastattn.scaled_dot_product_attention(
            qk[:, None], kn[:, None], val[:, None], num_threads=threads
        )

    def lsh1():
        return fastattn.lsh_attention(
            qk, val, n_buckets=256, n_hashes=2, chunk_size=64, seed=0, num_threads=1
        )

    def full1():
        return fastattn.scaled_dot_product_attention(qk[:, None], kn[:, None], val[:, None], num_threads=1)

    # Full attention takes tens of seconds per call: no warm-up for it, and it runs in the
    # first max(1, rounds // 2) rounds only; LSH runs in every round (after one warm-up call).
    lsh()
    t_lsh, t_full = [], []
    for r in range(max(1, rounds)):
        t_lsh.append(_time(lsh))
        if r < max(1, rounds // 2):
            t_full.append(_time(full))
    res = {"lsh": statistics.median(t_lsh), "full": statistics.median(t_full)}
    line = (
        f"lsh L={L} D={D} 2 rounds chunk 64 ({threads} threads): lsh {res['lsh'] * 1e3:.1f} ms, "
        f"full attention {res['full'] * 1e3:.0f} ms, speedup {res['full'] / res['lsh']:.0f}x"
    )
    if cpu:
        # One thread: every part runs on the calling thread, so its CPU time is the whole
        # cost, whatever else loads the machine.
        c_lsh = []
        for _ in range(max(1, rounds)):
            t = time.thread_time()
            lsh1()
            c_lsh.append(time.thread_time() - t)
        t = time.thread_time()
        full1()
        c_full = time.thread_time() - t
        line += (
            f"\nlsh, 1 thread, CPU time of the calling thread: lsh {statistics.median(c_lsh) * 1e3:.1f} ms, "
            f"full attention {c_full * 1e3:.0f} ms, ratio {c_full / statistics.median(c_lsh):.0f}x"
        )
    return line


def bench_rotary(threads, rounds):
    kc, vc, q, kn, vn, cos, sin = decode_inputs()
    seq = np.array([4096])

    def plain():
        return fastattn.attention_with_kvcache(q, kc, vc, seq, kn, vn, num_threads=threads)

    def fused():
        return fastattn.attention_with_kvcache(
            q, kc, vc, seq, kn, vn, rotary_cos=cos, rotary_sin=sin, num_threads=threads
        )

    res = interleaved({"plain": plain, "rotary": fused}, rounds * 10, calls=20)
    return (
        f"decode B1 H32/8 S=4097 of 8192 D128 f16 cache ({threads} threads): no rotary "
        f"{res['plain'] * 1e6:.0f} us, fused rotary {res['rotary'] * 1e6:.0f} us, "
        f"ratio {res['rotary'] / res['plain']:.3f}"
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=THREADS)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--only", default="additive,lsh,rotary")
    ap.add_argument(
        "--cpu", action="store_true", help="lsh: also 1 thread, CPU time of the calling thread (both sides)"
    )
    args = ap.parse_args(argv)
    print(f"fastattn {fastattn.__version__}, ISA {fastattn.get_isa()}, {os.cpu_count()} CPUs")
    for name in args.only.split(","):
        if name == "lsh":
            print(bench_lsh(args.threads, args.rounds, cpu=args.cpu), flush=True)
            continue
        fn = {"additive": bench_additive, "rotary": bench_rotary}[name]
        print(fn(args.threads, args.rounds), flush=True)


# --------------------------------------------------------------------- asv


class TimeAdditive:
    params = (["fastattn", "torch"],)
    param_names = ["impl"]

    def setup(self, impl):
        self.args = additive_inputs()
        if impl == "torch":
            tr = torch_additive(THREADS)
            if tr is None:
                raise NotImplementedError("torch is not installed")
            self.fn = lambda: tr(*self.args)
        else:
            q, k, v, wq, wk, w, b = self.args
            self.fn = lambda: fastattn.additive_attention(q, k, v, wq, wk, w, bias=b, num_threads=THREADS)

    def time_additive_L1024_A128(self, impl):
        self.fn()


class TimeLSH:
    params = (["lsh", "full"],)
    param_names = ["impl"]
    timeout = 300

    def setup(self, impl):
        rng = np.random.default_rng(0)
        L, D = 16384, 64  # reduced from 65536: asv repeats each case
        self.qk = rng.standard_normal((1, L, D), dtype=np.float32)
        self.val = rng.standard_normal((1, L, D), dtype=np.float32)
        self.kn = self.qk / np.linalg.norm(self.qk, axis=-1, keepdims=True)

    def time_lsh_L16384_D64_2rounds(self, impl):
        if impl == "lsh":
            fastattn.lsh_attention(
                self.qk, self.val, n_buckets=256, n_hashes=2, chunk_size=64, seed=0, num_threads=THREADS
            )
        else:
            fastattn.scaled_dot_product_attention(
                self.qk[:, None], self.kn[:, None], self.val[:, None], num_threads=THREADS
            )


class TimeRotaryDecode:
    params = (["plain", "rotary"],)
    param_names = ["impl"]

    def setup(self, impl):
        self.args = decode_inputs()
        self.seq = np.array([4096])

    def time_decode_B1_H32_8_S8192_D128_f16(self, impl):
        kc, vc, q, kn, vn, cos, sin = self.args
        if impl == "rotary":
            fastattn.attention_with_kvcache(
                q, kc, vc, self.seq, kn, vn, rotary_cos=cos, rotary_sin=sin, num_threads=THREADS
            )
        else:
            fastattn.attention_with_kvcache(q, kc, vc, self.seq, kn, vn, num_threads=THREADS)


if __name__ == "__main__":
    main()
