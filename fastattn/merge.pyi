"""Type stubs for fastattn.merge."""

from typing import Sequence, Union

import numpy as np
import numpy.typing as npt

def merge_attention_states(
    outs: Union[Sequence[npt.ArrayLike], np.ndarray],
    lses: Union[Sequence[npt.ArrayLike], np.ndarray],
) -> tuple[np.ndarray, np.ndarray]: ...
