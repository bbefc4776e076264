"""attrs validators (and converters) that raise :class:`~phasesched.errors.InvalidArgumentError`.

attrs' own validators raise a bare ``ValueError`` or ``TypeError``, and accept ``True`` for an
int and ``nan`` for a float in range checks. Configs and policies validate their fields with
these instead, so every bad value a caller can pass is a typed error that names the field;
:func:`typed` wraps attrs' own validators (and :func:`to_int` / :func:`to_float` convert) so that
they raise :class:`~phasesched.errors.InvalidArgumentError` or
:class:`~phasesched.errors.InvalidTypeError` instead.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np

from phasesched.errors import InvalidArgumentError, InvalidTypeError

__all__ = ["INT32_MAX", "INT64_MAX", "is_int", "number", "optional", "to_float", "to_int", "typed", "whole"]

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


def _typed_error(error: Exception, where: str) -> InvalidArgumentError:
    """``error`` as the typed error of its kind, its message prefixed by ``where``."""
    message = f"{where}: {error.args[0] if error.args else error}"
    return InvalidTypeError(message) if isinstance(error, TypeError) else InvalidArgumentError(message)


def typed(*validators: Validator) -> Validator:
    """One attrs validator running ``validators`` in order; their errors become typed ones.

    >>> @attrs.frozen
    ... class Box:
    ...     size: int = attrs.field(validator=typed(attrs.validators.instance_of(int), attrs.validators.gt(0)))
    >>> Box(0)
    Traceback (most recent call last):
    ...
    phasesched.errors.InvalidArgumentError: Box.size: 'size' must be > 0: 0
    """

    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        try:
            for validator in validators:
                validator(instance, attribute, value)
        except InvalidArgumentError:
            raise
        except (TypeError, ValueError) as error:
            raise _typed_error(error, f"{type(instance).__name__}.{attribute.name}") from None

    return check


def to_int(value: Any) -> int:
    """An attrs converter: ``value`` as an ``int`` (``operator.index``: no fractions, no strings).

    >>> to_int(2.5)
    Traceback (most recent call last):
    ...
    phasesched.errors.InvalidTypeError: expected an integer, got 2.5 (float)
    """
    try:
        return operator.index(value)
    except TypeError:
        msg = f"expected an integer, got {value!r} ({type(value).__name__})"
        raise InvalidTypeError(msg) from None


def to_float(value: Any) -> float:
    """An attrs converter: ``value`` as a ``float``.

    >>> to_float("fast")
    Traceback (most recent call last):
    ...
    phasesched.errors.InvalidArgumentError: expected a number, got 'fast' (str)
    """
    try:
        return float(value)
    except TypeError:
        msg = f"expected a number, got {value!r} ({type(value).__name__})"
        raise InvalidTypeError(msg) from None
    except ValueError:
        msg = f"expected a number, got {value!r} ({type(value).__name__})"
        raise InvalidArgumentError(msg) from None
