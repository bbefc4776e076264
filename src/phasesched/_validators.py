"""attrs validators and converters that raise phasesched's typed errors.

``attrs.validators.gt(0)`` and friends raise a plain ``ValueError`` (or ``TypeError``), and a
converter such as ``float`` raises whatever it raises; wrapped with :func:`typed` and
:func:`to_int` and :func:`to_float`, the same checks raise :class:`~phasesched.errors.InvalidArgumentError`
(a ``ValueError``) or :class:`~phasesched.errors.InvalidTypeError` (also a ``TypeError``), so a
caller can catch every bad argument as a :class:`~phasesched.errors.PhaseschedError`.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import attrs

from phasesched.errors import InvalidArgumentError, InvalidTypeError

__all__ = ["to_float", "to_int", "typed"]

Validator = Callable[[Any, "attrs.Attribute[Any]", Any], Any]


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
