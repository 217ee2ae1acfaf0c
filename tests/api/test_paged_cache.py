"""fastattn.PagedKVCache: a model-based random test against a dict of NumPy arrays.

Random new / append / fork / free / attend sequences, appends to parents and children
after forks, and running out of pages (MemoryError with nothing changed).  After
every step each live sequence's keys and values must equal the model's, and attend
must match the float64 reference on the model's arrays; when every sequence is freed
every page is free again.  8-bit pools: the stored tokens within half a quantisation
step, attend against the reference on the dequantised tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_close

import fastattn
from fastattn import reference as ref

Hk, Hq, D = 2, 4, 8


def reference_attend(q, K, V):
    """q (Lq, Hq, D) at the last positions of K, V (T, Hk, D): bottom-right causal."""
    o = ref.scaled_dot_product_attention(
        q.swapaxes(0, 1)[None].astype(np.float64),
        K.swapaxes(0, 1)[None].astype(np.float64),
        V.swapaxes(0, 1)[None].astype(np.float64),
        is_causal=True,
        enable_gqa=True,
    )
    return o[0].swapaxes(0, 1)


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_model_based(block_size):
    rng = np.random.default_rng(block_size)
    nb = {1: 60, 3: 20, 16: 6}[block_size]  # small pools: appends and forks run out of pages
    pool = fastattn.PagedKVCache(nb, block_size, Hk, D)
    model: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    ooms = 0
    for _ in range(200):
        op = rng.choice(["new", "append", "append", "append", "fork", "free", "attend"])
        ids = sorted(model)
        if op == "new" or not ids:
            sid = pool.new_sequence()
            model[sid] = (np.zeros((0, Hk, D), np.float32), np.zeros((0, Hk, D), np.float32))
            continue
        sid = int(rng.choice(ids))
        n = pool.length(sid)
        assert n == model[sid][0].shape[0]
        free_before = pool.num_free_blocks
        if op == "append":
            T = int(rng.integers(1, 3 * block_size + 2))
            k = rng.standard_normal((T, Hk, D)).astype(np.float32)
            v = rng.standard_normal((T, Hk, D)).astype(np.float32)
            need = -(-(n + T) // block_size) - -(-n // block_size)
            if need > free_before:
                ooms += 1
                with pytest.raises(MemoryError):
                    pool.append(sid, k, v)
                assert pool.num_free_blocks == free_before
            else:
                pool.append(sid, k, v)
                model[sid] = (np.concatenate([model[sid][0], k]), np.concatenate([model[sid][1], v]))
                assert pool.num_free_blocks == free_before - need
        elif op == "fork":
            need = 1 if n % block_size else 0
            if need > free_before:
                ooms += 1
                with pytest.raises(MemoryError):
                    pool.fork(sid)
                assert pool.num_free_blocks == free_before
            else:
                child = pool.fork(sid)
                model[child] = (model[sid][0].copy(), model[sid][1].copy())
                assert pool.num_free_blocks == free_before - need
        elif op == "free":
            pool.free(sid)
            del model[sid]
            with pytest.raises(KeyError):
                pool.length(sid)
        elif op == "attend" and n:
            Lq = int(rng.integers(1, min(n, 5) + 1))
            q = rng.standard_normal((Lq, Hq, D)).astype(np.float32)
            out, lse = pool.attend(q, sid, return_lse=True)
            assert out.shape == (Lq, Hq, D) and lse.shape == (Hq, Lq)
            assert_close(out, reference_attend(q, *model[sid]), tol=1e-4)
        for s, (K, V) in model.items():  # every live sequence: exactly its own tokens
            np.testing.assert_array_equal(pool.keys(s), K)
            np.testing.assert_array_equal(pool.values(s), V)
    for s in list(model):
        pool.free(s)
    assert pool.num_free_blocks == nb
    assert ooms > 0  # the MemoryError path was taken


def test_fork_then_both_append_independently():
    rng = np.random.default_rng(1)
    pool = fastattn.PagedKVCache(8, 4, Hk, D)
    a = pool.new_sequence()
    k = rng.standard_normal((6, Hk, D)).astype(np.float32)
    pool.append(a, k, k)
    b = pool.fork(a)
    ka, kb = rng.standard_normal((2, 3, Hk, D)).astype(np.float32)
    pool.append(a, ka, ka)
    pool.append(b, kb, kb)
    np.testing.assert_array_equal(pool.keys(a), np.concatenate([k, ka]))
    np.testing.assert_array_equal(pool.keys(b), np.concatenate([k, kb]))
    table, lens = pool.block_table([a, b])
    assert table[0, 0] == table[1, 0] and table[0, 1] != table[1, 1]  # the full page shared
    assert list(lens) == [9, 9]


def test_batched_attend_matches_single():
    rng = np.random.default_rng(2)
    pool = fastattn.PagedKVCache(32, 16, Hk, D, dtype="bfloat16")
    ids = [pool.new_sequence() for _ in range(3)]
    for i, n in zip(ids, (5, 40, 17)):
        kv = rng.standard_normal((2, n, Hk, D)).astype(np.float32)
        pool.append(i, kv[0], kv[1])
    q = rng.standard_normal((3, 1, Hq, D)).astype(np.float32)
    both = pool.attend_batch(q, ids)
    for r, i in enumerate(ids):
        np.testing.assert_array_equal(both[r], pool.attend(q[r], i))
        assert_close(both[r], reference_attend(q[r], pool.keys(i), pool.values(i)), tol=1e-4)


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn"])
def test_kv8_pool(dtype):
    rng = np.random.default_rng(3)
    pool = fastattn.PagedKVCache(16, 16, Hk, D, dtype=dtype)
    a = pool.new_sequence()
    k = rng.standard_normal((30, Hk, D)).astype(np.float32)
    v = rng.standard_normal((30, Hk, D)).astype(np.float32)
    pool.append(a, k[:20], v[:20])
    pool.append(a, k[20:], v[20:])
    step = np.abs(k).max(-1, keepdims=True) / (127.0 if dtype == "int8" else 448.0)
    half = 0.5 if dtype == "int8" else 2.0**-4 * 448.0  # in units of the scale
    assert np.all(np.abs(pool.keys(a) - k) <= half * step + 1e-6)
    q = rng.standard_normal((2, Hq, D)).astype(np.float32)
    assert_close(pool.attend(q, a), reference_attend(q, pool.keys(a), pool.values(a)), tol=1e-4)


def test_errors():
    pool = fastattn.PagedKVCache(2, 4, Hk, D)
    a = pool.new_sequence()
    with pytest.raises(ValueError, match=r"\(T, 2, D\)"):
        pool.append(a, np.zeros((3, D), np.float32), np.zeros((3, D), np.float32))
    with pytest.raises(MemoryError, match="nothing written"):
        pool.append(a, np.zeros((9, Hk, D), np.float32), np.zeros((9, Hk, D), np.float32))
    assert pool.length(a) == 0 and pool.num_free_blocks == 2
    with pytest.raises(KeyError):
        pool.attend(np.zeros((1, Hq, D), np.float32), 99)
    with pytest.raises(TypeError, match="block_size"):
        fastattn.PagedKVCache(2, 4.0, Hk, D)
    with pytest.raises(TypeError, match="unexpected keyword"):
        pool.append(a, np.ones((1, Hk, D), np.float32), np.ones((1, Hk, D), np.float32))
        pool.attend(np.zeros((1, Hq, D), np.float32), a, causal=True)
