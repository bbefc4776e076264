"""The cost-model seam: how long one step takes, given its shape.

The simulator, the SLO-adaptive chunk sizer and the benchmarks all ask the same question, so
they share one Protocol. A step is described by two arrays, one entry per scheduled slice.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np
from numpy.typing import NDArray

__all__ = ["CostModel"]


@runtime_checkable
class CostModel(Protocol):
    """Predicts the duration of one model step.

    Implementations must be monotone: adding tokens to a slice never makes the step faster
    (the SLO-adaptive chunk sizer binary-searches on it).
    """

    def step_time(self, num_new: NDArray[np.integer], kv_len: NDArray[np.integer]) -> float:
        """Seconds for one step.

        Args:
            num_new: int ``[B]``: tokens each slice computes this step.
            kv_len: int ``[B]``: tokens in each slice's context after the step
                (``kv_len >= num_new``; attention is causal within a slice).

        """
        ...
