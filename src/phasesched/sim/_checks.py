"""Argument checks shared by workloads, length distributions, arrival processes and builders.

Each raises :class:`~phasesched.errors.InvalidArgumentError` (a ``ValueError``; a wrong type
raises its subclass :class:`~phasesched.errors.InvalidTypeError`, also a ``TypeError``) with a
message naming the argument, so every constructor in :mod:`phasesched.sim` rejects bad input
the same way. The column converters return read-only
copies: a :class:`~phasesched.sim.workload.Workload` (or an
:class:`~phasesched.sim.lengths.Empirical`) can then be shared without defensive copies.
"""

from __future__ import annotations

import math
import operator

import attrs
import numpy as np
from numpy.typing import NDArray

from phasesched.errors import InvalidArgumentError, InvalidTypeError

__all__ = [
    "check_positive_finite",
    "int_column",
    "positive_float_field",
    "positive_int",
    "positive_int_field",
    "readonly",
    "sample_count",
    "time_column",
]

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]


def readonly(array: NDArray[np.generic]) -> NDArray[np.generic]:
    """``array`` itself, marked read-only."""
    array.flags.writeable = False
    return array


def int_column(values: NDArray[np.generic], name: str, n: int, *, positive: bool) -> IntArray:
    """A read-only int64 copy of ``values``; refuses fractions, wrong shapes and (optionally) values < 1."""
    if values.shape != (n,):
        msg = f"{name} must be a 1-D array of length {n} (like arrival_s), got shape {values.shape}"
        raise InvalidArgumentError(msg)
    if values.dtype.kind == "f" and not np.all(np.isfinite(values) & (values == np.trunc(values))):
        msg = f"{name} must hold whole numbers"
        raise InvalidArgumentError(msg)
    if values.dtype.kind not in "iuf" and n > 0:
        msg = f"{name} must hold integers, got dtype {values.dtype}"
        raise InvalidArgumentError(msg)
    column = values.astype(np.int64)
    if positive and n > 0 and column.min() < 1:
        i = int(np.argmax(column < 1))
        msg = f"{name} must be positive, got {name}[{i}] = {column[i]}"
        raise InvalidArgumentError(msg)
    return readonly(column)  # type: ignore[return-value]


def time_column(values: NDArray[np.generic]) -> FloatArray:
    """A read-only float64 copy of arrival times; refuses NaN, infinities, negatives and disorder."""
    if values.ndim != 1:
        msg = f"arrival_s must be 1-D, got shape {values.shape}"
        raise InvalidArgumentError(msg)
    if values.dtype.kind not in "iuf" and values.size > 0:
        msg = f"arrival_s must hold numbers, got dtype {values.dtype}"
        raise InvalidArgumentError(msg)
    times = values.astype(np.float64)
    if not np.all(np.isfinite(times)) or (times.size > 0 and times[0] < 0):
        msg = "arrival_s must be finite and start at or after 0"
        raise InvalidArgumentError(msg)
    backwards = np.diff(times) < 0
    if backwards.any():
        i = int(np.argmax(backwards)) + 1
        msg = f"arrival_s must be non-decreasing, got arrival_s[{i}] = {times[i]} < arrival_s[{i - 1}] = {times[i - 1]}"
        raise InvalidArgumentError(msg)
    return readonly(times)  # type: ignore[return-value]


def check_positive_finite(name: str, value: float) -> None:
    """Raise unless ``value`` is a positive finite number."""
    if not (math.isfinite(value) and value > 0):
        msg = f"{name} must be a positive finite number, got {value}"
        raise InvalidArgumentError(msg)


def positive_int(name: str, value: int) -> int:
    """``value`` as an ``int``, after checking it is an integer ``>= 1``."""
    return _int_at_least(name, value, 1, "a positive integer")


def non_negative_int(name: str, value: int) -> int:
    """``value`` as an ``int``, after checking it is an integer ``>= 0``."""
    return _int_at_least(name, value, 0, "a non-negative integer")


def _int_at_least(name: str, value: int, low: int, what: str) -> int:
    value = _index(name, value)
    if value < low:
        msg = f"{name} must be {what}, got {value}"
        raise InvalidArgumentError(msg)
    return value


def _index(name: str, value: int) -> int:
    """``operator.index(value)``; a non-integer is an :class:`~phasesched.errors.InvalidTypeError` naming ``name``."""
    try:
        return operator.index(value)
    except TypeError:
        msg = f"{name} must be an integer, got {value!r} ({type(value).__name__})"
        raise InvalidTypeError(msg) from None


def sample_count(n: int) -> int:
    """``n`` as an ``int``, after checking it is a non-negative integer (how many values to draw)."""
    n = _index("n", n)
    if n < 0:
        msg = f"cannot sample a negative number of values ({n})"
        raise InvalidArgumentError(msg)
    return n


def positive_int_field(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    """An attrs validator: the field is an integer ``>= 1``."""
    positive_int(attribute.name, value)


def positive_float_field(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    """An attrs validator: the field is a positive finite number."""
    check_positive_finite(attribute.name, value)
