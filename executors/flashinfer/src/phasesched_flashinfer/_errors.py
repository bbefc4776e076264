"""Typed errors of the FlashInfer executor, in phasesched's family.

Plans this executor cannot run raise :class:`phasesched_torch.PlanNotExecutableError` and
configurations it cannot represent raise :class:`phasesched_torch.UnsupportedConfigError`, as
the torch executor does; what is new here is a machine that cannot run FlashInfer at all.
"""

from __future__ import annotations

from phasesched.errors import PhaseschedError

__all__ = ["FlashInferUnavailableError"]


class FlashInferUnavailableError(PhaseschedError, RuntimeError):
    """FlashInfer cannot run here: not installed, no CUDA device, or a CPU-only torch build."""
