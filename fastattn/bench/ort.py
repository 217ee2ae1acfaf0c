"""ONNX Runtime's two attention ops as peers: the ``com.microsoft.MultiHeadAttention``
contrib op and the standard ``Attention`` op of opset 23.  Both are one-node graphs built
by :func:`one_node_session`; they differ in layout, masks and what they support."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from fastattn.bench.cases import (
    MASK_LIMIT,
    SCORES_LIMIT,
    Array,
    Case,
    additive_mask,
    mask_additive,
    scores_bytes,
)
from fastattn.bench.inputs import Inputs
from fastattn.bench.peers import Impl, Runner, Skip, concat_varlen, missing, optional

# A graph input: (name, array fed to it, its declared shape with symbolic dims); None leaves
# an optional input of the op out.
GraphInput = tuple[str, Array, Sequence[int | str]] | None


def onnx_type(dt: np.dtype[Any]) -> int:
    """The ONNX element type of a NumPy dtype."""
    tp = optional("onnx").TensorProto
    types: dict[str, int] = {"float32": tp.FLOAT, "float16": tp.FLOAT16, "bfloat16": tp.BFLOAT16}
    return types[dt.name]


def one_node_session(
    op: str,
    inputs: Sequence[GraphInput],
    out_shape: Sequence[int | str],
    threads: int,
    domain: str = "",
    **attrs: Any,
) -> Runner:
    """A callable running the graph ``o = op(inputs...)`` in an ONNX Runtime session on
    ``threads`` intra-op threads (sequential execution, CPU provider).  Every input and
    the output have the first input's element type; the feeds are bound now."""
    helper = optional("onnx.helper")
    ort = optional("onnxruntime")
    given = [i for i in inputs if i is not None]
    t = onnx_type(given[0][1].dtype)
    node = helper.make_node(op, [i[0] if i else "" for i in inputs], ["o"], domain=domain or None, **attrs)
    graph = helper.make_graph(
        [node],
        op.lower(),
        [helper.make_tensor_value_info(name, t, list(shape)) for name, _, shape in given],
        [helper.make_tensor_value_info("o", t, list(out_shape))],
    )
    opsets = [helper.make_opsetid("", 23)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 10
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    feeds = {name: a for name, a, _ in given}

    def run() -> Array:
        out: Array = sess.run(None, feeds)[0]
        return out

    return run


class OrtBase(Impl):
    """What both ops share: the 16-bit K/V cases run on float32 copies (the ops need one
    dtype for Q and K), cases whose scores would be too large are skipped, varlen runs
    one graph per sequence, a masked case's mask is an additive bias in the inputs' dtype."""

    op = ""

    def available(self) -> str | None:
        return missing("onnx", "onnxruntime")

    def prepare(self, inp: Inputs, threads: int) -> Runner:
        case = inp.case
        if case.kv_dtype:
            inp = inp.as_float32()
            self.note = "run on float32 copies of the 16-bit K/V (the op needs one dtype for Q and K)"
        if scores_bytes(case) > SCORES_LIMIT:
            raise Skip(f"materialises {scores_bytes(case) / 2**30:.1f} GiB of scores")
        if case.kind == "varlen":
            runs = [
                self.prepare_one(
                    dataclasses.replace(case, B=1, L=q.shape[2], S=q.shape[2]), q, k, v, None, threads
                )
                for q, k, v in inp.seqs()
            ]
            return lambda: concat_varlen([r() for r in runs])
        return self.prepare_one(case, *inp.dense(), inp.mask, threads)

    def prepare_one(
        self, case: Case, q: Array, k: Array, v: Array, mask: Array | None, threads: int
    ) -> Runner:
        raise NotImplementedError

    @staticmethod
    def float_mask(
        case: Case, L: int, S: int, dtype: np.dtype[Any], mask: Array | None = None
    ) -> Array | None:
        """The case's own ``mask`` (B, 1, L or 1, S) as an additive (B, 1, L, S) bias, else the
        window, or causal with L != S, as an additive (L, S) mask; None where the op's own
        causal flag is the mask (it aligns causal top-left, the cases bottom-right)."""
        if mask is not None:
            B = mask.shape[0]
            if B * L * S * dtype.itemsize > MASK_LIMIT:
                raise Skip("the dense mask would be too large")
            with np.errstate(over="ignore"):  # float32's lowest value is -inf in float16: masked still
                return np.ascontiguousarray(np.broadcast_to(mask_additive(mask), (B, 1, L, S))).astype(dtype)
        if case.window is None and not (case.causal and L != S):
            return None
        if L * S * dtype.itemsize > MASK_LIMIT:
            raise Skip("the window mask would be too large")
        return additive_mask(L, S, case.causal, case.window, dtype)


class OrtMHA(OrtBase):
    name = "ort-mha"
    op = "com.microsoft.MultiHeadAttention"

    def prepare_one(
        self, case: Case, q: Array, k: Array, v: Array, user_mask: Array | None, threads: int
    ) -> Runner:
        B, Hq, L, D = q.shape
        Hk, S = k.shape[1], k.shape[2]
        dt = q.dtype
        if dt.name == "bfloat16":
            raise Skip("no bfloat16 input support")
        if Hq != Hk:  # the op has no GQA: repeat K/V heads (outside the timing)
            k = np.repeat(k, Hq // Hk, axis=1)
            v = np.repeat(v, Hq // Hk, axis=1)
            extra = "K/V heads repeated to Hq (the op has no GQA)"
            if extra not in self.note:
                self.note = "; ".join(filter(None, [self.note, extra]))
        if case.causal and L != S:
            raise Skip("causal with L != S")
        mask = self.float_mask(case, L, S, dt, user_mask)

        def packed(a: Array) -> Array:  # (B, H, n, D) -> (B, n, H*D)
            return np.ascontiguousarray(a.transpose(0, 2, 1, 3)).reshape(B, a.shape[2], Hq * D)

        # inputs: query, key, value, bias, key_padding_mask, attention_bias
        inputs: list[GraphInput] = [
            ("q", packed(q), ["B", "L", Hq * D]),
            ("k", packed(k), ["B", "S", Hq * D]),
            ("v", packed(v), ["B", "S", Hq * D]),
            None,
            None,
        ]
        if mask is not None and user_mask is not None:  # attention_bias: (B or 1, H or 1, L, S)
            inputs.append(("bias", mask, ["B", 1, "L", "S"]))
        elif mask is not None:
            inputs.append(("bias", mask[None, None], [1, 1, "L", "S"]))
        sess = one_node_session(
            "MultiHeadAttention",
            inputs,
            ["B", "L", Hq * D],
            threads,
            domain="com.microsoft",
            num_heads=Hq,
            unidirectional=int(case.causal and mask is None),
            scale=1.0 / math.sqrt(D),
        )

        def run() -> Array:
            out: Array = sess().reshape(B, L, Hq, D).transpose(0, 2, 1, 3)
            return out

        return run


class OrtAttention(OrtBase):
    name = "ort-attn23"
    op = "ONNX Attention (opset 23)"

    def prepare_one(
        self, case: Case, q: Array, k: Array, v: Array, user_mask: Array | None, threads: int
    ) -> Runner:
        B, Hq, L, D = q.shape
        Hk = k.shape[1]
        mask = self.float_mask(case, L, k.shape[2], q.dtype, user_mask)
        inputs: list[GraphInput] = [
            ("q", q, ["B", Hq, "L", D]),
            ("k", k, ["B", Hk, "S", D]),
            ("v", v, ["B", Hk, "S", D]),
        ]
        if mask is not None:  # attn_mask: broadcasts to (B, Hq, L, S)
            shape: list[int | str] = [*mask.shape[:-2], "L", "S"]
            inputs.append(("mask", mask, shape))
        return one_node_session(
            "Attention",
            inputs,
            ["B", Hq, "L", D],
            threads,
            is_causal=int(case.causal and mask is None),
            scale=1.0 / math.sqrt(D),
        )
