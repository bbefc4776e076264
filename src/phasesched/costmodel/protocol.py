"""The cost-model seam: how long one step takes, given its shape.

The simulator, the SLO-adaptive chunk sizer and the benchmarks all ask the same question, so
they share one Protocol. A step is described by two arrays, one entry per scheduled slice.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np
from numpy.typing import NDArray

from phasesched.errors import InvalidArgumentError

__all__ = ["CostModel", "DecodeFastForward", "decode_step_times"]


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


@runtime_checkable
class DecodeFastForward(Protocol):
    """A cost model that prices a run of pure-decode steps in one call.

    Between two events a batch of decodes keeps its composition and only its contexts grow,
    so a simulator can advance ``k`` steps at once. The answer must equal pricing the steps
    one by one (to float precision): :func:`decode_step_times` falls back to that loop.
    """

    def decode_step_times(self, kv_len: NDArray[np.integer], num_steps: int) -> NDArray[np.float64]:
        """Durations of ``num_steps`` consecutive decode steps of the same ``B`` sequences.

        Args:
            kv_len: int ``[B]``: each sequence's context after the *first* of the steps.
            num_steps: Steps to price; step ``j`` has contexts ``kv_len + j``.

        Returns:
            float64 ``[num_steps]``: seconds per step, ``step_time(ones(B), kv_len + j)``.

        """
        ...


def decode_step_times(model: CostModel, kv_len: NDArray[np.integer], num_steps: int) -> NDArray[np.float64]:
    """Price ``num_steps`` pure-decode steps, in one call where ``model`` offers the fast path.

    Args:
        model: Any cost model; one that is also a :class:`DecodeFastForward` is asked directly.
        kv_len: int ``[B]``: contexts after the first step.
        num_steps: Steps to price (``>= 0``).

    Returns:
        float64 ``[num_steps]``: the duration of step ``j``, whose contexts are ``kv_len + j``.

    """
    if num_steps < 0:
        msg = f"num_steps must be non-negative, got {num_steps}"
        raise InvalidArgumentError(msg)
    fast = getattr(model, "decode_step_times", None)  # the Protocol's method; isinstance() is slow here
    if fast is not None:
        return np.asarray(fast(kv_len, num_steps), dtype=np.float64)
    contexts = np.asarray(kv_len, dtype=np.int64)
    ones = np.ones_like(contexts)
    return np.array([model.step_time(ones, contexts + j) for j in range(num_steps)], dtype=np.float64)
