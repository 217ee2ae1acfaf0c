"""asv benchmarks: fastattn and the plain NumPy softmax(Q Kᵀ) V over the cases of
``fastattn bench`` (shapes reduced where a case is too big for asv's many
repetitions), and fastattn against torch's bfloat16 SDPA on the bfloat16 cases.
The cases and the baseline are ``fastattn/bench/cases.py`` of this checkout
(:mod:`benchmarks.common`); the fastattn timed is used through its public API only,
so older commits can be benchmarked too.

Run from the repository root (see asv.conf.json)::

    asv run --python=same --quick --show-stderr --set-commit-hash $(git rev-parse HEAD)
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

import fastattn

from .common import THREADS, cases

_WINDOW = cases.by_name("B1 H8 L16384 D64 window512")
PREFILL = {
    c.name: c
    for c in [
        cases.by_name("B1 H8 L1024 D64"),
        cases.by_name("B1 H8 L1024 D64 causal"),
        cases.by_name("B1 H8 L2048 D128"),
        cases.by_name("B4 H8 L512 D64 causal"),
        # reduced from L16384: the NumPy baseline materialises the L×L scores
        dataclasses.replace(_WINDOW, name="B1 H8 L4096 D64 window512", L=4096, S=4096),
        cases.by_name("B1 H8 L16 D64"),
    ]
}
DECODE = {c.name: c for c in cases.CASES if c.kind == "decode" and not c.kv8}
VARLEN = next(c for c in cases.CASES if c.kind == "varlen")
# (case, dtype of the run): a bfloat16 prefill (Q, K and V in bfloat16) and a bfloat16 KV
# cache (Q float32; torch gets Q in bfloat16 too: its SDPA takes one dtype)
BF16 = {
    "B1 H8 L1024 D64 bf16": (cases.by_name("B1 H8 L1024 D64"), "bfloat16"),
    "B1 H32 S8192 D128 decode bf16kv": (cases.by_name("B1 H32 S8192 D128 decode bf16kv"), "float32"),
}

# The 8-bit K/V decode shapes of ``fastattn bench`` (B1 H32 S32768 and B1 H32/8 S65536, D128) at a
# quarter of their keys, each with K/V in every dtype (KV8Decode).
KV8_DECODE = {
    n: dataclasses.replace(c, name=n, S=c.S // 4, kv_dtype=None)
    for c in cases.CASES
    if c.kv8 and c.kind == "decode" and c.kv_dtype == "int8"
    for n in [c.name.replace(f"S{c.S}", f"S{c.S // 4}").removesuffix(" int8kv")]
}
KV_DTYPES = ["float32", "bfloat16", "int8", "float8_e4m3fn", "float8_e5m2"]

# The masked benchmark's shape: B8 H12 L512 D64 of ``fastattn bench`` with 4 sequences, each
# mask as case_mask builds it (None: the same shape unmasked).
MASKED = dataclasses.replace(cases.by_name("B8 H12 L512 D64"), name="B4 H12 L512 D64", B=4)


def _inputs(case, dtype="float32"):
    return cases.random_inputs(case, dtype)


def _mask(L, S, causal, window):
    """Additive float32 (L, S) mask (bottom-right aligned), or None."""
    return cases.additive_mask(L, S, causal, window)


def _blas_limit(n):
    """Limit NumPy's BLAS to n threads for the NumPy baseline, through threadpoolctl when it
    is installed (asv's virtualenvs get it from asv.conf.json).  Without it (``pip install
    asv .`` and ``--python=same``) BLAS keeps its default, all cores, which is what n is
    unless FASTATTN_BENCH_THREADS asks for fewer: only then is threadpoolctl needed, and
    the row is skipped (NotImplementedError) rather than timed with the wrong thread count."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        if n < (os.cpu_count() or 1):
            raise NotImplementedError(
                f"FASTATTN_BENCH_THREADS={n} needs threadpoolctl to limit NumPy's BLAS "
                "(pip install threadpoolctl)"
            ) from None
        return None
    return threadpool_limits(limits=n, user_api="blas")


class _Cases:
    cases: dict = {}
    params = ([], ["fastattn", "numpy"])
    param_names = ["case", "impl"]

    def setup(self, case, impl):
        c = self.cases[case]
        q, k, v = _inputs(c)
        if impl == "fastattn":
            self.fn = lambda: fastattn.scaled_dot_product_attention(
                q, k, v, is_causal=c.causal, window=c.window, enable_gqa=c.gqa, num_threads=THREADS
            )
        else:
            add = _mask(c.L, c.S, c.causal, c.window)
            self.limits = _blas_limit(THREADS)
            self.fn = lambda: cases.numpy_attention(q, k, v, add)

    def teardown(self, case, impl):
        limits = getattr(self, "limits", None)
        if limits is not None:
            limits.restore_original_limits()


class Prefill(_Cases):
    """Prefill (L query rows against S keys), float32."""

    cases = PREFILL
    params = (list(PREFILL), ["fastattn", "numpy"])
    timeout = 120

    def time_attention(self, case, impl):
        self.fn()


class Decode(_Cases):
    """Decode: one query row against a KV cache of S keys (16-bit caches for f16kv/bf16kv)."""

    cases = DECODE
    params = (list(DECODE), ["fastattn", "numpy"])
    timeout = 120

    def time_attention(self, case, impl):
        self.fn()


class Bfloat16:
    """fastattn against torch's SDPA in bfloat16 (when torch is installed): the bfloat16
    prefill B1 H8 L1024 D64 and the bfloat16-KV decode B1 H32 S8192 D128."""

    params = (list(BF16), ["fastattn", "torch"])
    param_names = ["case", "impl"]
    timeout = 120

    def setup(self, case, impl):
        c, dtype = BF16[case]
        q, k, v = _inputs(c, dtype)
        if impl == "fastattn":
            self.fn = lambda: fastattn.scaled_dot_product_attention(
                q, k, v, is_causal=c.causal, enable_gqa=c.gqa, num_threads=THREADS
            )
            try:
                self.fn()
            except (TypeError, ValueError) as e:  # a commit without bfloat16 inputs: not timed
                raise NotImplementedError(f"bfloat16 inputs: {e}") from None
            return
        try:
            import torch
        except ImportError:
            raise NotImplementedError("torch is not installed") from None
        torch.set_num_threads(THREADS)
        bf16 = cases.np_dtype("bfloat16")
        tq, tk, tv = (
            torch.from_numpy(np.ascontiguousarray(a.astype(bf16)).view(np.int16)).view(torch.bfloat16)
            for a in (q, k, v)
        )

        def run():
            with torch.inference_mode():
                torch.nn.functional.scaled_dot_product_attention(
                    tq, tk, tv, is_causal=c.causal, enable_gqa=c.gqa
                )

        self.fn = run

    def time_attention(self, case, impl):
        self.fn()


class Masked:
    """An explicit attn_mask (``fastattn bench``'s masked cases at B4 H12 L512 D64, float32):
    a bool key-padding mask (B, 1, 1, S), the same padding as Hugging Face's dense float
    (B, 1, L, S) mask, a dense random bool mask; None is the shape unmasked.  fastattn,
    torch's SDPA given the same mask (when torch is installed) and the NumPy baseline."""

    params = ([None, "padding", "hf_float", "random"], ["fastattn", "torch", "numpy"])
    param_names = ["mask", "impl"]
    timeout = 120

    def setup(self, mask, impl):
        c = dataclasses.replace(MASKED, name=f"{MASKED.name} {mask}", mask=mask)
        q, k, v = _inputs(c)
        m = cases.case_mask(c)  # bool: True = may attend; float: added to the scores
        if impl == "fastattn":
            self.fn = lambda: fastattn.scaled_dot_product_attention(q, k, v, attn_mask=m, num_threads=THREADS)
            try:
                self.fn()
            except (TypeError, ValueError) as e:  # a commit without this mask form: not timed
                raise NotImplementedError(f"attn_mask: {e}") from None
        elif impl == "torch":
            try:
                import torch
            except ImportError:
                raise NotImplementedError("torch is not installed") from None
            torch.set_num_threads(THREADS)
            tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
            tm = None if m is None else torch.from_numpy(m)

            def run():
                with torch.inference_mode():
                    torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=tm)

            self.fn = run
        else:
            # (B, 1, L or 1, S) -> (B, 1, 1, L or 1, S): the baseline's scores are (B, Hk, g, L, S)
            add = None if m is None else cases.mask_additive(m)[:, :, None]
            self.limits = _blas_limit(THREADS)
            self.fn = lambda: cases.numpy_attention(q, k, v, add)

    def teardown(self, mask, impl):
        limits = getattr(self, "limits", None)
        if limits is not None:
            limits.restore_original_limits()

    def time_attention(self, mask, impl):
        self.fn()


class KV8Decode:
    """Decode with K/V in float32, bfloat16 and the 8-bit formats (int8, fp8 e4m3fn and e5m2,
    one float32 scale per token and head: ``fastattn bench``'s 8-bit cases), a float32 query,
    on ``fastattn bench``'s 8-bit decode shapes at S / 4; fastattn only (no peer reads 8-bit
    K/V).  The rows of one shape compare the K/V formats: an 8-bit cache reads a quarter of
    float32's bytes (plus 4 / D for the scales)."""

    params = (list(KV8_DECODE), KV_DTYPES)
    param_names = ["case", "kv_dtype"]
    timeout = 120

    def setup(self, case, kv_dtype):
        c = dataclasses.replace(KV8_DECODE[case], kv_dtype=kv_dtype)
        if c.kv8:
            q, k, v, ks, vs = cases.kv8_inputs(c)
            kw = {"k_scale": ks, "v_scale": vs}
        else:
            q, k, v = _inputs(c)
            kw = {}
        self.fn = lambda: fastattn.scaled_dot_product_attention(
            q, k, v, enable_gqa=c.gqa, num_threads=THREADS, **kw
        )
        try:
            self.fn()
        except (TypeError, ValueError) as e:  # a commit without 8-bit K/V: not timed
            raise NotImplementedError(f"{kv_dtype} K/V: {e}") from None

    def time_decode(self, case, kv_dtype):
        self.fn()

    def track_kv_mib(self, case, kv_dtype):
        """The K/V bytes one call reads (scales included), in MiB."""
        c = dataclasses.replace(KV8_DECODE[case], kv_dtype=kv_dtype)
        return cases.kv_bytes(c, cases.np_dtype(kv_dtype)) / 2**20

    track_kv_mib.unit = "MiB"


# The paged cases of ``fastattn bench`` at the size of its --quick run (quick_case): decode of
# B4 H32/8 D128 sequences of 2048 tokens in 16-token pages, and the chunked-prefill call with a
# quarter of its keys.
PAGED_DECODE = cases.quick_case(cases.by_name("B4 H32/8 S8192 D128 decode page16"))
CHUNKED = cases.quick_case(next(c for c in cases.CASES if c.page and c.kind == "varlen"))


class PagedDecode:
    """Decode through a shuffled block table of 16-token pages against the same call on the
    contiguous cache (``fastattn bench``'s paged decode cases at S / 4), K/V in float32,
    bfloat16 and int8 (per-token scales paged with the tokens), float32 queries."""

    params = (["float32", "bfloat16", "int8"], ["paged", "contiguous"])
    param_names = ["kv_dtype", "cache"]
    timeout = 120

    def setup(self, kv_dtype, cache):
        c = dataclasses.replace(PAGED_DECODE, kv_dtype=kv_dtype)
        if c.kv8:
            q, k, v, ks, vs = cases.kv8_inputs(c)
        else:
            (q, k, v), ks, vs = _inputs(c), None, None
        lens = np.full(c.B, c.S, np.int64)
        kw = {}
        if cache == "paged":
            k, bt = cases.paged_pool(list(k), c.page)
            v = cases.paged_pool(list(v), c.page)[0]
            if c.kv8:
                ks, vs = (cases.paged_pool(list(s), c.page)[0] for s in (ks, vs))
            kw["block_table"] = bt
        if c.kv8:
            kw.update(k_scale=ks, v_scale=vs)
        self.fn = lambda: fastattn.attention_with_kvcache(q, k, v, lens, num_threads=THREADS, **kw)
        try:
            self.fn()
        except (TypeError, ValueError) as e:  # a commit without paged caches or 8-bit K/V: not timed
            raise NotImplementedError(f"{cache} {kv_dtype}: {e}") from None

    def time_decode(self, kv_dtype, cache):
        self.fn()


class ChunkedPrefill:
    """One ``varlen_attention`` call over pages (decode rows of 6 sequences beside a prefill
    chunk of a seventh, ``fastattn bench``'s chunked-prefill case with a quarter of its keys)
    against the separate calls it replaces: the decode rows in one batched
    ``attention_with_kvcache`` call, the chunk in another, over the same pages."""

    params = (["one call", "separate calls"],)
    param_names = ["impl"]
    timeout = 120

    def setup(self, impl):
        c = CHUNKED
        qs, ks, vs = _inputs(c)  # per sequence (1, H, n, D)
        q = np.concatenate([x[0].transpose(1, 0, 2) for x in qs])  # (T, Hq, D)
        kp, bt = cases.paged_pool([x[0] for x in ks], c.page)
        vp = cases.paged_pool([x[0] for x in vs], c.page)[0]
        kf, vf = (np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (kp, vp))  # flash-attn's pages
        kb, vb = kf.transpose(0, 2, 1, 3), vf.transpose(0, 2, 1, 3)
        cq, ck = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (c.query_lens, c.seqlens))
        lens = np.asarray(c.seqlens, np.int64)
        rows = [b for b, m in enumerate(c.query_lens) if m == 1]
        chunks = [b for b, m in enumerate(c.query_lens) if m > 1]
        if impl == "one call":
            self.fn = lambda: fastattn.varlen_attention(
                q, kf, vf, cq, ck, block_table=bt, is_causal=True, enable_gqa=True, num_threads=THREADS
            )
        else:
            q_rows = q[cq[rows]][:, :, None]
            q_chunks = [(b, q[cq[b] : cq[b + 1]].transpose(1, 0, 2)[None]) for b in chunks]

            def separate():
                fastattn.attention_with_kvcache(
                    q_rows, kb, vb, lens[rows], block_table=bt[rows], num_threads=THREADS
                )
                for b, qc in q_chunks:
                    fastattn.attention_with_kvcache(
                        qc, kb, vb, lens[b : b + 1], block_table=bt[b : b + 1], num_threads=THREADS
                    )

            self.fn = separate
        try:
            self.fn()
        except (TypeError, ValueError) as e:  # a commit without paged caches: not timed
            raise NotImplementedError(f"{impl}: {e}") from None

    def time_chunked_prefill(self, impl):
        self.fn()


class Varlen:
    """The varlen case of ``fastattn bench`` (8 packed causal sequences, H8 D64): one varlen
    call against a per-sequence loop."""

    params = (["fastattn varlen", "fastattn loop", "numpy loop"],)
    param_names = ["impl"]

    def setup(self, impl):
        qs, ks, vs = _inputs(VARLEN)  # per sequence (1, H, n, D)
        self.seqs = [(q[0], k[0], v[0]) for q, k, v in zip(qs, ks, vs)]
        self.q, self.k, self.v = (np.concatenate([a[0].transpose(1, 0, 2) for a in x]) for x in (qs, ks, vs))
        self.cu = np.concatenate([[0], np.cumsum(VARLEN.seqlens)]).astype(np.int64)
        self.masks = [_mask(n, n, True, None) for n in VARLEN.seqlens]

    def time_varlen(self, impl):
        if impl == "fastattn varlen":
            fastattn.varlen_attention(
                self.q, self.k, self.v, self.cu, self.cu, is_causal=True, num_threads=THREADS
            )
        elif impl == "fastattn loop":
            for q, k, v in self.seqs:
                fastattn.scaled_dot_product_attention(q, k, v, is_causal=True, num_threads=THREADS)
        else:
            for (q, k, v), m in zip(self.seqs, self.masks):
                cases.numpy_attention(q[None], k[None], v[None], m)


class Memory:
    """Peak memory of one call.  At L=32768 the NumPy baseline would need 4 GiB of
    scores and is skipped; fastattn's extra memory stays a few MiB above its
    inputs and output (see ``track_extra_mib``)."""

    params = ([8192, 32768], ["fastattn", "numpy"])
    param_names = ["L", "impl"]
    timeout = 300

    def setup(self, L, impl):
        if impl == "numpy" and L > 8192:
            raise NotImplementedError("the NumPy baseline would materialise 4 GiB of scores")
        self.q, self.k, self.v = _inputs(cases.Case(f"B1 H1 L{L} D64", 1, 1, 1, L, L, 64))
        self.out = np.zeros_like(self.q)

    def _call(self, impl):
        if impl == "fastattn":
            fastattn.scaled_dot_product_attention(self.q, self.k, self.v, out=self.out, num_threads=THREADS)
        else:
            self.out[...] = cases.numpy_attention(self.q, self.k, self.v)

    def peakmem_attention(self, L, impl):
        """Whole-process peak RSS (includes the interpreter and the inputs)."""
        self._call(impl)

    def track_extra_mib(self, L, impl):
        """Peak RSS during the call above the RSS before it (inputs and output
        already allocated and touched), in MiB; Linux only."""
        return extra_peak_mib(lambda: self._call(impl))

    track_extra_mib.unit = "MiB"


def extra_peak_mib(fn) -> float:
    """Run fn and return the peak resident memory it added, in MiB (resets the
    kernel's high-water mark through /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        raise NotImplementedError("needs Linux /proc/self/clear_refs") from None
    before = _status_kib("VmRSS")
    fn()
    return (_status_kib("VmHWM") - before) / 1024.0


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise NotImplementedError(f"no {field} in /proc/self/status")
