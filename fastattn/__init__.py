"""fastattn: fused, cache-tiled scaled dot-product attention for NumPy on the CPU."""

# The one place the version is written: pyproject.toml reads it from here
# ([tool.setuptools.dynamic]) and everything else imports it.
__version__ = "0.1.0"

from types import ModuleType as _ModuleType


def _installed_copy() -> _ModuleType | None:
    """Hand ``import fastattn`` over to an installed copy when this is an unbuilt source tree.

    ``python -m fastattn`` (and ``python -c 'import fastattn'``) run in a clone's root put
    the clone first on ``sys.path``, so Python finds this source tree, which has no
    compiled ``_kernels`` extension, before the copy ``pip install .`` put in
    site-packages.  Then the first installed ``fastattn`` further down ``sys.path``
    (one whose directory holds a built ``_kernels``) is imported in this module's place:
    ``sys.modules["fastattn"]`` becomes that copy, so its submodules (``fastattn.__main__``
    included) come from it too.  Returns it, or None when this copy is built (an
    in-place build, or this is the installed copy).  With no built copy anywhere the
    ImportError says so and how to fix it.
    """
    import importlib.machinery
    import os
    import sys

    here = os.path.dirname(os.path.abspath(__file__))

    def built(d: str) -> bool:
        return any(
            os.path.isfile(os.path.join(d, "_kernels" + s)) for s in importlib.machinery.EXTENSION_SUFFIXES
        )

    if built(here):
        return None
    skip = {os.path.realpath(os.path.dirname(here))}
    spec = None
    for _ in range(len(sys.path)):
        others = [p for p in sys.path if os.path.realpath(p or os.getcwd()) not in skip]
        spec = importlib.machinery.PathFinder.find_spec(__name__, others)
        if spec is None or spec.origin is None or built(os.path.dirname(spec.origin)):
            break
        # Another unbuilt source tree further down sys.path: look past it too.
        skip.add(os.path.realpath(os.path.dirname(os.path.dirname(spec.origin))))
        spec = None
    if spec is None or spec.origin is None or spec.loader is None:
        raise ImportError(
            f"fastattn was imported from its source tree ({here}), which has no compiled "
            "extension (fastattn._kernels), and no installed fastattn was found on sys.path. "
            "Install it with `pip install .` (then `fastattn check` or `python -m fastattn` "
            "work from any directory, this one included), or build it in place for development "
            "with `python setup.py build_ext --inplace`."
        )
    import importlib.util

    module = importlib.util.module_from_spec(spec)
    sys.modules[__name__] = module  # the import system returns what sys.modules holds
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[__name__]
        raise
    return module


if _installed_copy() is None:  # else sys.modules["fastattn"] is the installed copy: nothing more here
    from . import reference, sparse
    from ._config import (
        get_float32_matmul_precision,
        get_isa,
        get_num_threads,
        get_tiles,
        set_float32_matmul_precision,
        set_isa,
        set_num_threads,
        set_tiles,
        show_config,
    )
    from ._quant import quantize_kv
    from .additive import additive_attention
    from .backward import scaled_dot_product_attention_backward
    from .functional import scaled_dot_product_attention, varlen_attention
    from .jax_compat import dot_product_attention
    from .kvcache import KVCache, attention_with_kvcache
    from .lsh import lsh_attention
    from .merge import merge_attention_states
    from .modules import MultiHeadAttention
    from .paged import PagedKVCache
    from .positions import apply_rotary, rotary_cos_sin, sinusoidal_positions
    from .weights import attention_weights, plot_attention_weights

__all__ = [
    "__version__",
    "scaled_dot_product_attention",
    "scaled_dot_product_attention_backward",
    "varlen_attention",
    "dot_product_attention",
    "merge_attention_states",
    "KVCache",
    "PagedKVCache",
    "attention_with_kvcache",
    "quantize_kv",
    "MultiHeadAttention",
    "additive_attention",
    "lsh_attention",
    "sinusoidal_positions",
    "rotary_cos_sin",
    "apply_rotary",
    "attention_weights",
    "plot_attention_weights",
    "sparse",
    "reference",
    "get_num_threads",
    "set_num_threads",
    "get_isa",
    "set_isa",
    "show_config",
    "get_float32_matmul_precision",
    "set_float32_matmul_precision",
    "get_tiles",
    "set_tiles",
]


def __getattr__(name: str) -> _ModuleType:
    # fastattn.cuda is imported on first use only (it never fails without CUDA).
    if name == "cuda":
        import importlib

        return importlib.import_module(".cuda", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
