"""Exact attention over Dask arrays, sharded along batch, heads, queries and keys.

Import it explicitly (``import fastattn.dask``); ``import fastattn`` never
imports Dask.  Needs the ``dask`` extra (``pip install ".[dask]"`` from a clone).

Every (query chunk, key chunk) pair runs the in-memory
:func:`fastattn.scaled_dot_product_attention` with ``return_lse=True`` in one
task; the partial results of a query chunk are combined with
:func:`fastattn.merge_attention_states` in a binary tree (pairs, then pairs of
pairs), so no task holds more than one query chunk, one key/value chunk and
two partial outputs.  Under ``is_causal``, a ``window``, ``key_lengths``,
``query_lengths`` or a ``block_mask``, key chunks that no query of a query
chunk can see get no task at all.

Chunking rules (the rechunks are lazy and happen only where needed):

* batch dims: the common refinement of the chunk boundaries of query, key,
  value (every boundary of any of them is a boundary of all);
* query heads: the common refinement of the query's head boundaries and the
  key/value head boundaries times ``G = Hq // Hk``, after rounding the
  query's boundaries down to whole groups (multiples of ``G``); key/value head
  chunks are then the query head chunks divided by ``G``, so each query head
  chunk reads exactly one key/value head chunk;
* query length L: the query's chunks; key length S: the common refinement of
  key and value chunks; with ``block_mask``, both rounded down to whole blocks
  (multiples of ``block_size``), so a chunk's blocks are whole blocks of the
  global grid;
* the head dims D and Dv are made single chunks;
* ``attn_mask`` is rechunked to match; its broadcast (size-1) dims stay
  size 1, so a ``(L, S)`` mask is never expanded over batch or heads.

NumPy inputs are wrapped with ``dask.array.from_array`` as a single chunk
(then refined as above).

How a chunk pair reproduces the whole problem's positions.  The kernel aligns
``is_causal``, ``window`` and ALiBi to the bottom right of the call it is given:
query i sits at ``i' = i + S_b - L_b``.  A chunk call has its own, different
bottom right, so each task works with ``t = j - i'`` in global terms:

* the call is trimmed (views) to the rows and keys holding visible pairs under
  the causal / window bounds on t; those bounds are then always a window of the
  trimmed call (only with a block mask, whose grid fixes where a call may start,
  can an explicit boolean mask of the pair's rows x keys be needed);
* ALiBi, ``-slope * |t|``: when the trimmed call's own alignment equals the
  global one (diagonal chunks of an equal L/S chunking, and any pair under
  ``window=(0, 0)``) the kernel's ALiBi is used as is; otherwise the pair is
  split at ``t = 0`` into the part with keys at or before the diagonal and the
  part after it, where ``|t|`` is linear: a per-key bias (an additive
  ``(.., 1, S_chunk)`` mask, broadcast over the rows) plus a per-row constant,
  added to the part's LSE (it does not change the softmax weights), and the
  parts are merged by LSE.  The kernel stores each logit in float32, so the
  bias is kept small where the weight is: calls of at most 64 rows
  (``_alibi.ALIBI_ROWS``), each with its reference key next to the diagonal;
* ``key_lengths`` / ``query_lengths``: each batch element's valid keys and
  rows of the chunk are sliced (views), so the chunk call needs no lengths;
  rows past a query length stay zeros with LSE -inf;
* ``sinks`` join the denominator exactly once: merged into the root of each
  query chunk's tree as one more part with LSE ``sink`` and output 0;
* ``softcap`` acts on each score and is passed to every chunk call;
* ``block_mask``: each chunk call gets its slice of the block grid.
"""

from __future__ import annotations

from ._sdpa import scaled_dot_product_attention
from ._varlen import varlen_attention

__all__ = ["scaled_dot_product_attention", "varlen_attention"]

# The public functions are this module's (what help(), pickling and the API docs show).
scaled_dot_product_attention.__module__ = __name__
varlen_attention.__module__ = __name__
