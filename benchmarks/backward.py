"""asv benchmarks: forward + backward (fastattn's fused backward, and torch's
SDPA forward + backward when torch is installed), the cases of
``fastattn bench --backward`` (``fastattn/bench/cases.py``, :mod:`benchmarks.common`)."""

from __future__ import annotations

import numpy as np

import fastattn

from .common import THREADS, cases

CASES = {c.name: c for c in cases.BACKWARD_CASES}


class ForwardBackward:
    """Forward (with the LSE) + backward, float32."""

    params = (list(CASES), ["fastattn", "torch"])
    param_names = ["case", "impl"]
    timeout = 300

    def setup(self, case, impl):
        if not hasattr(fastattn, "scaled_dot_product_attention_backward"):
            raise NotImplementedError("this commit has no backward pass")
        c = CASES[case]
        causal = c.causal
        drop = getattr(c, "dropout", 0.0)  # (older commits' cases have none)
        kw = {"dropout_p": drop, "dropout_seed": 1234} if drop else {}
        rng = np.random.default_rng(0)
        q, k, v, go = (rng.standard_normal((c.B, c.H, c.L, c.D), dtype=np.float32) for _ in range(4))
        if impl == "fastattn":

            def run():
                o, lse = fastattn.scaled_dot_product_attention(
                    q, k, v, is_causal=causal, return_lse=True, num_threads=THREADS, **kw
                )
                fastattn.scaled_dot_product_attention_backward(
                    go, q, k, v, o, lse, is_causal=causal, num_threads=THREADS, **kw
                )

        else:
            try:
                import torch
            except ImportError:
                raise NotImplementedError("torch is not installed") from None
            torch.set_num_threads(THREADS)
            tq, tk, tv = (torch.from_numpy(a).requires_grad_() for a in (q, k, v))
            tgo = torch.from_numpy(go)

            def run():
                for t in (tq, tk, tv):
                    t.grad = None
                sdpa = torch.nn.functional.scaled_dot_product_attention
                sdpa(tq, tk, tv, is_causal=causal, dropout_p=drop).backward(tgo)

        self.run = run
        run()

    def time_forward_backward(self, case, impl):
        self.run()
