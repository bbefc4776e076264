"""attrs validators that raise :class:`~phasesched.errors.InvalidArgumentError`.

attrs' own validators raise a bare ``ValueError`` or ``TypeError``, and accept ``True`` for an
int and ``nan`` for a float in range checks. Configs and policies validate their fields with
these instead, so every bad value a caller can pass is a typed error that names the field.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

import numpy as np

from phasesched.errors import InvalidArgumentError

__all__ = ["INT32_MAX", "INT64_MAX", "is_int", "number", "optional", "whole"]

INT32_MAX = int(np.iinfo(np.int32).max)
"""The largest token id, token count or position the scheduler's int32 arrays hold."""
INT64_MAX = int(np.iinfo(np.int64).max)

Validator = Callable[[Any, "Any", Any], None]
_BOUNDS: dict[str, tuple[Callable[[Any, Any], bool], str]] = {
    "gt": (operator.gt, ">"),
    "ge": (operator.ge, ">="),
    "lt": (operator.lt, "<"),
    "le": (operator.le, "<="),
}


_REAL = (int, float, np.integer, np.floating)


def is_int(value: object) -> bool:
    """Whether ``value`` is an integer (a numpy integer counts; a bool does not)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _bounds(bounds: dict[str, float]) -> list[tuple[Callable[[Any, Any], bool], str, float]]:
    return [(*_BOUNDS[key], limit) for key, limit in bounds.items()]


def _check_bounds(
    name: str, value: float, bounds: list[tuple[Callable[[Any, Any], bool], str, float]], error: type[Exception]
) -> None:
    for compare, symbol, limit in bounds:
        if not compare(value, limit):
            msg = f"{name} must be {symbol} {limit}, got {value!r}"
            raise error(msg)


def whole(*, error: type[InvalidArgumentError] = InvalidArgumentError, **bounds: int) -> Validator:
    """An int (not a bool, not a float) within ``bounds`` (``gt``, ``ge``, ``lt``, ``le``); else ``error``."""
    checks = _bounds(dict(bounds))

    def check(_: object, attribute: Any, value: object) -> None:
        if type(value) is not int and not is_int(value):
            msg = f"{attribute.name} must be an int, got {value!r}"
            raise error(msg)
        _check_bounds(attribute.name, value, checks, error)  # type: ignore[arg-type]

    return check


def number(*, error: type[InvalidArgumentError] = InvalidArgumentError, **bounds: float) -> Validator:
    """A finite real number (not a bool) within ``bounds`` (``gt``, ``ge``, ``lt``, ``le``); else ``error``."""
    checks = _bounds(bounds)

    def check(_: object, attribute: Any, value: object) -> None:
        real = type(value) is float or (isinstance(value, _REAL) and not isinstance(value, (bool, np.bool_)))
        if not real or not math.isfinite(value):  # type: ignore[arg-type]
            msg = f"{attribute.name} must be a finite number, got {value!r}"
            raise error(msg)
        _check_bounds(attribute.name, value, checks, error)  # type: ignore[arg-type]

    return check


def optional(validator: Validator) -> Validator:
    """``None``, or a value ``validator`` accepts."""

    def check(instance: object, attribute: Any, value: object) -> None:
        if value is not None:
            validator(instance, attribute, value)

    return check
