"""fastattn: fused, cache-tiled scaled dot-product attention for NumPy on the CPU."""
__version__ = "0.1.0"

from . import reference  # noqa: E402
from ._config import get_isa, get_num_threads, set_isa, set_num_threads, show_config  # noqa: E402
from .functional import scaled_dot_product_attention, varlen_attention  # noqa: E402
from .merge import merge_attention_states  # noqa: E402

__all__ = [
    "__version__",
    "scaled_dot_product_attention",
    "varlen_attention",
    "merge_attention_states",
    "reference",
    "get_num_threads",
    "set_num_threads",
    "get_isa",
    "set_isa",
    "show_config",
]
