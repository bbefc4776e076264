"""Validation shared by the cost models: a step as the ``CostModel`` Protocol describes it."""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from phasesched.errors import InvalidArgumentError

__all__ = ["check_batch", "check_decodes"]


def check_batch(num_new: NDArray[np.integer], kv_len: NDArray[np.integer]) -> tuple[NDArray[np.int64], ...]:
    """``num_new`` and ``kv_len`` as int64 ``[B]`` arrays, after checking they describe a step.

    Raises:
        InvalidArgumentError: Shapes differ or are not 1-D, a slice computes no token, or a context is
            shorter than the tokens computed into it.

    """
    new = np.asarray(num_new, dtype=np.int64)
    ctx = np.asarray(kv_len, dtype=np.int64)
    if new.ndim != 1 or new.shape != ctx.shape:
        msg = f"num_new and kv_len must be 1-D arrays of one length, got shapes {new.shape} and {ctx.shape}"
        raise InvalidArgumentError(msg)
    if len(new) and (new.min() < 1 or (ctx - new).min() < 0):
        msg = "every slice needs num_new >= 1 and kv_len >= num_new"
        raise InvalidArgumentError(msg)
    return new, ctx


def check_decodes(kv_len: NDArray[np.integer], num_steps: int) -> NDArray[np.int64]:
    """``kv_len`` as int64 ``[B]``, after checking a run of decode steps is well described.

    Raises:
        InvalidArgumentError: ``kv_len`` is not 1-D or holds a context below 1, or ``num_steps < 0``.

    """
    ctx = np.asarray(kv_len, dtype=np.int64)
    if ctx.ndim != 1 or (len(ctx) and ctx.min() < 1):
        msg = "kv_len must be a 1-D array of positive context lengths"
        raise InvalidArgumentError(msg)
    if num_steps < 0:
        msg = f"num_steps must be non-negative, got {num_steps}"
        raise InvalidArgumentError(msg)
    return ctx
