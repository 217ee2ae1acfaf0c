"""fastattn: fused, cache-tiled scaled dot-product attention for NumPy on the CPU."""

__version__ = "0.1.0"

from . import reference, sparse  # noqa: E402
from ._config import get_isa, get_num_threads, set_isa, set_num_threads, show_config  # noqa: E402
from .additive import additive_attention  # noqa: E402
from .backward import scaled_dot_product_attention_backward  # noqa: E402
from .functional import scaled_dot_product_attention, varlen_attention  # noqa: E402
from .jax_compat import dot_product_attention  # noqa: E402
from .kvcache import KVCache, attention_with_kvcache  # noqa: E402
from .lsh import lsh_attention  # noqa: E402
from .merge import merge_attention_states  # noqa: E402
from .modules import MultiHeadAttention  # noqa: E402
from .positions import apply_rotary, rotary_cos_sin, sinusoidal_positions  # noqa: E402
from .weights import attention_weights, plot_attention_weights  # noqa: E402

__all__ = [
    "__version__",
    "scaled_dot_product_attention",
    "scaled_dot_product_attention_backward",
    "varlen_attention",
    "dot_product_attention",
    "merge_attention_states",
    "KVCache",
    "attention_with_kvcache",
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
]


def __getattr__(name):
    # fastattn.cuda is imported on first use only (it never fails without CUDA).
    if name == "cuda":
        import importlib

        return importlib.import_module(".cuda", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
