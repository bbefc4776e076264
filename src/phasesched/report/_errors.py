"""The report's one error: an optional dependency is missing."""

from __future__ import annotations

from phasesched.errors import PhaseschedError

__all__ = ["MissingExtraError"]


class MissingExtraError(PhaseschedError, ImportError):
    """A feature needs a package from an extra that is not installed; the message says how to install it."""
