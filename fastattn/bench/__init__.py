"""Benchmark fastattn against its peers: ``python -m fastattn.bench``.

For every case the command times fastattn, PyTorch's ``scaled_dot_product_attention``
(when torch is installed), ONNX Runtime's ``com.microsoft.MultiHeadAttention`` contrib
op and the standard ONNX ``Attention`` op of opset 23 (when onnx and onnxruntime are
installed) and the plain NumPy ``softmax(Q Kᵀ) V``.  Every implementation is first
checked against :mod:`fastattn.reference` (the float64 oracle) on a slice of the
case; one that fails the check is reported and not timed.  Repetitions are
interleaved (round robin over the implementations, with a pause between them so
that spinning BLAS/OpenMP workers of one library do not slow the next) and the
median per implementation is reported.

All libraries get the same thread count (``--threads``, default: all cores).  The
machine's fp32 GEMM rate (NumPy ``sgemm`` 2048³) and its read bandwidth are
measured before and after the cases.  Float32 prefill throughput is shown as a
percentage of the GEMM rate timed in the case's own interleaved rounds (``gemm``: the
same threads, 1024³ with ``--quick``; its median, like every time reported), and the
Markdown table adds the percentage of the best GEMM measured before and after;
16-bit runs compare with the machine's 16-bit GEMM measured before and after.
Decode throughput is shown as a percentage of a plain read of the case's own K and V
arrays (``kv-read``: the same threads read them with NumPy GEMVs), timed in the
same interleaved rounds, so that both meet the same pages and the same moment of a
shared machine's memory traffic, and of the machine's read bandwidth timed in those
same rounds (``bw``: the same threads read one 1 GiB array, 256 MiB with
``--quick``, as ``measure_bandwidth`` does).  Both yardsticks are medians, like every
time reported; the best-of-six bandwidth measured before and after the cases is
printed too, but on a shared machine it is an optimistic outlier, not a rate to
compare a median with.

FLOPs count the visible (query, key) pairs exactly: ``4 · D · pairs`` with
``pairs`` the number of key positions each query row may see, summed (causal is
aligned bottom-right; a window narrows it).  Decode GB/s is the case's K+V bytes
(Hk heads, the case's K/V dtype) divided by the time.

If ``OPENBLAS_CORETYPE`` / ``OPENBLAS_L2_SIZE`` are set in the environment they
slow NumPy's BLAS (and so the GEMM reference rate and the NumPy baseline); run
``env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python -m fastattn.bench`` to
measure the true limit.

``--precision high|medium`` runs fastattn's float32 calls at that matmul precision
(torch's levels, ``precision=``) and times fastattn at ``"highest"`` beside it as
``fastattn-highest``, so that the report shows the ratio; the header line names the level.

Masked cases (``Case.mask``: a bool key-padding mask, the same padding as Hugging
Face's dense float mask, a dense random bool mask; :func:`~fastattn.bench.cases.case_mask`)
give every implementation the same ``attn_mask`` (bool: True = may attend; float: added to
the scores), each converted to its library's form outside the timing; their FLOPs count
the pairs the mask leaves visible.  The report adds masked / unmasked time per
implementation and fastattn's speedup over torch with and without the mask.

8-bit K/V cases (``int8kv``, ``e4m3kv``, ``e5m2kv``: K and V in int8 or ml_dtypes' fp8
with one float32 scale per token and head, :func:`~fastattn.bench.cases.kv8_inputs`) time
fastattn's 8-bit call against fastattn on the same contents (the dequantised K/V) in
float32 and bfloat16, ``fastattn-f32kv`` and ``fastattn-bf16kv``, in the same interleaved
rounds; the peers skip them.  Their decode GB/s counts the scales' bytes, and a summary
gives each 8-bit call's speed relative to the two.  ``--quick`` runs them at S / 8
(decode) or L / 4 (prefill).

Paged cases (``page16``: K/V read through a shuffled block table of 16-token pages,
:func:`~fastattn.bench.cases.paged_pool`) time fastattn's paged call against the same call
on the contiguous cache (``fastattn-contig``, decode B4 H32/8 S8192 D128 with K/V in
bfloat16, float32 and int8, and B1 S512 int8, where the call's fixed cost weighs), and one
chunked-prefill ``varlen_attention`` call (decode rows
of 6 sequences beside a 512-query chunk of a seventh) against the separate calls it replaces
(``fastattn-separate``), in the same rounds; the peers skip them (none reads pages), and a
summary gives each paged call's speed relative to its counterpart (1.00: the pages cost
nothing).  ``--quick`` runs them with a quarter of the keys.

Where JAX is installed, ``jax.nn.dot_product_attention`` is timed too (float32; XLA
runs on its own thread pool, whatever ``--threads`` says).

``fastattn bench --backward`` times forward + backward instead (fastattn's fused
backward against torch's autograd, float32; :mod:`fastattn.bench.backward`).

The package: :mod:`~fastattn.bench.cases` (the case tables, FLOP and byte counts,
masks, the NumPy baseline: shared with ``python -m fastattn`` and the asv benchmarks),
:mod:`~fastattn.bench.inputs`, :mod:`~fastattn.bench.peers` and
:mod:`~fastattn.bench.ort` (the implementations, one interface),
:mod:`~fastattn.bench.yardsticks` (GEMM rates, bandwidth, the interleaved GEMM and decode readers),
:mod:`~fastattn.bench.runner` (the interleaved rounds), :mod:`~fastattn.bench.report`
(the text and Markdown output) and :mod:`~fastattn.bench.command` (the options and the
run).
"""

from __future__ import annotations

# The first paragraph of this docstring is the description of ``fastattn bench --help``.
DESCRIPTION = (__doc__ or "").split("\n\n")[0].replace("``python -m fastattn.bench``", "``fastattn bench``")

from fastattn.bench.cases import (  # noqa: E402 - DESCRIPTION first: nothing below needs it
    CASES,
    Case,
    bool_mask,
    case_flops,
    numpy_attention,
)
from fastattn.bench.command import EPILOG, IMPLS, add_arguments, finish_args, main, parse_args, run  # noqa: E402
from fastattn.bench.inputs import Inputs, make_inputs  # noqa: E402
from fastattn.bench.peers import Impl, Skip  # noqa: E402
from fastattn.bench.yardsticks import (  # noqa: E402
    gemm_reader,
    kv_reader,
    measure_bandwidth,
    measure_gemm,
    measure_gemm_bf16,
    mem_reader,
    read_parts,
)

__all__ = [
    "CASES",
    "DESCRIPTION",
    "EPILOG",
    "IMPLS",
    "Case",
    "Impl",
    "Inputs",
    "Skip",
    "add_arguments",
    "bool_mask",
    "case_flops",
    "finish_args",
    "gemm_reader",
    "kv_reader",
    "main",
    "make_inputs",
    "measure_bandwidth",
    "measure_gemm",
    "measure_gemm_bf16",
    "mem_reader",
    "numpy_attention",
    "parse_args",
    "read_parts",
    "run",
]
