"""Typed errors raised at phasesched's boundaries.

Every error a caller can provoke with bad input derives from :class:`PhaseschedError`, so an
engine can catch the whole family in one place. Each is raised *before* any state changes: a
rejected request, plan or result leaves the scheduler exactly as it was.
"""

from __future__ import annotations

__all__ = [
    "DuplicateNameError",
    "DuplicateRequestError",
    "InvalidArgumentError",
    "InvalidPlanError",
    "InvalidRequestError",
    "InvalidResultError",
    "InvalidTypeError",
    "OutOfPagesError",
    "PhaseschedError",
    "PlanInFlightError",
    "RequestRejectedError",
    "UnknownNameError",
    "UnknownRequestError",
    "UnknownTableError",
    "UnsupportedModelError",
]


class PhaseschedError(Exception):
    """Base class of every error phasesched raises on purpose."""


class InvalidArgumentError(PhaseschedError, ValueError):
    """An argument lies outside its documented range (a non-positive page size, say)."""


class InvalidTypeError(InvalidArgumentError, TypeError):
    """An argument has the wrong type (a string where a length goes, say); also a ``TypeError``."""


class InvalidRequestError(InvalidArgumentError):
    """A request is malformed on its own (a non-positive length, negative token ids, ...).

    Raised when the request is built, before any scheduler sees it; a well-formed request
    that a scheduler cannot serve raises :class:`RequestRejectedError` instead.
    """


class RequestRejectedError(PhaseschedError, ValueError):
    """A request can never be served as configured (too long, zero tokens, ...).

    Attributes:
        request_id: The rejected request's id.
        reason: A sentence saying which limit it breaks.

    """

    def __init__(self, request_id: str, reason: str) -> None:
        super().__init__(f"request {request_id!r} rejected: {reason}")
        self.request_id = request_id
        self.reason = reason


class DuplicateRequestError(PhaseschedError, ValueError):
    """A request id is already known to the scheduler."""


class UnknownRequestError(PhaseschedError, KeyError):
    """A request id the scheduler does not hold (never added, or already finished)."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable.
        return str(self.args[0]) if self.args else "unknown request"


class OutOfPagesError(PhaseschedError, RuntimeError):
    """The KV block manager cannot satisfy an allocation; nothing was allocated.

    Attributes:
        requested: Pages asked for.
        available: Pages that could be given (free pages, less any reserve).

    """

    def __init__(self, requested: int, available: int) -> None:
        super().__init__(f"asked for {requested} KV pages, {available} available")
        self.requested = requested
        self.available = available


class UnknownTableError(PhaseschedError, KeyError):
    """A KV page table that is not open (never opened, or already freed); nothing changed."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable.
        return str(self.args[0]) if self.args else "unknown KV table"


class InvalidPlanError(PhaseschedError, ValueError):
    """A policy proposed a batch that breaks an invariant; the scheduler is unchanged."""


class InvalidResultError(PhaseschedError, ValueError):
    """An executor result does not match the plan it claims to answer; nothing was applied."""


class PlanInFlightError(PhaseschedError, RuntimeError):
    """``schedule()`` was called while the previous plan still awaits ``update()``."""


class UnknownNameError(PhaseschedError, LookupError):
    """A plugin name that no registry entry provides; the message lists the known names."""


class DuplicateNameError(PhaseschedError, ValueError):
    """Two plugins claim the same name in one registry group."""


class UnsupportedModelError(PhaseschedError, ValueError):
    """An executor cannot run this model (its architecture, or a feature of its config); nothing was built."""
