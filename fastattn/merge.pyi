"""Type stubs for fastattn.merge."""

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

def merge_attention_states(
    outs: Sequence[npt.ArrayLike] | np.ndarray,
    lses: Sequence[npt.ArrayLike] | np.ndarray,
) -> tuple[np.ndarray, np.ndarray]: ...
