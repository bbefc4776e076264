"""Length distributions: the strategies that draw prompt and output token counts.

:class:`LengthDist` is a ``Protocol``, so a caller can add its own; four are built in:
:class:`Fixed`, :class:`Uniform`, :class:`LogNormal` (parametrised by the median a trace table
reports) and :class:`Empirical` (resampling a trace's column). Each draws only from the
generator it is given, so a seeded generator makes every draw repeatable; the builders in
:mod:`~phasesched.sim.builders` give prompts and outputs a stream each.
"""

from __future__ import annotations

import math
from typing import Protocol, runtime_checkable

import attrs
import numpy as np
from numpy.typing import ArrayLike, NDArray

from phasesched.errors import InvalidArgumentError
from phasesched.sim._checks import (
    check_positive_finite,
    int_column,
    positive_float_field,
    positive_int_field,
    sample_count,
)
from phasesched.validators import to_float, to_int, typed

__all__ = ["Empirical", "Fixed", "LengthDist", "LogNormal", "Uniform"]

IntArray = NDArray[np.int64]

# LogNormal without an upper bound is clipped here so the cast to int64 stays defined.
_HUGE_LENGTH = 1e15


@runtime_checkable
class LengthDist(Protocol):
    """Draws token counts (prompt or output lengths)."""

    def sample(self, rng: np.random.Generator, n: int) -> IntArray:
        """Draw ``n`` lengths.

        Args:
            rng: The only source of randomness, so a seeded generator makes the draw repeatable.
            n: How many lengths, ``>= 0``.

        Returns:
            int64 ``[n]``: lengths, each ``>= 1``.

        """


@attrs.frozen
class Fixed:
    """Every length is ``value``.

    >>> Fixed(128).sample(np.random.default_rng(0), 3).tolist()
    [128, 128, 128]
    """

    value: int = attrs.field(converter=to_int, validator=positive_int_field)

    def sample(self, rng: np.random.Generator, n: int) -> IntArray:  # noqa: ARG002 -- part of the protocol
        """``n`` copies of ``value``, int64 ``[n]``."""
        return np.full(sample_count(n), self.value, dtype=np.int64)


@attrs.frozen
class Uniform:
    """Lengths drawn uniformly from the integers ``lo .. hi``, both included.

    >>> sorted(set(Uniform(1, 2).sample(np.random.default_rng(0), 50).tolist()))
    [1, 2]
    """

    lo: int = attrs.field(converter=to_int, validator=positive_int_field)
    hi: int = attrs.field(converter=to_int)

    @hi.validator
    def _check_hi(self, _: attrs.Attribute[int], value: int) -> None:
        if value < self.lo:
            msg = f"Uniform needs lo <= hi, got lo={self.lo}, hi={value}"
            raise InvalidArgumentError(msg)

    def sample(self, rng: np.random.Generator, n: int) -> IntArray:
        """``n`` uniform integers in ``[lo, hi]``, int64 ``[n]``."""
        return rng.integers(self.lo, self.hi, size=sample_count(n), dtype=np.int64, endpoint=True)


@attrs.frozen
class LogNormal:
    """Log-normal lengths, parametrised by their **median** (``exp(mu)``), rounded and clipped.

    The median is the natural knob: it is what a trace table's p50 reports, and rounding and
    clipping to ``[lo, hi]`` leave it unchanged (when ``lo <= median <= hi``), whereas they shift
    the mean. To match a mean instead, use :meth:`from_mean`.

    Attributes:
        median: Median length before rounding, ``> 0``.
        sigma: Standard deviation of ``log(length)``; 0 gives a constant. Chat traces fit about 1.
        lo: Smallest length returned, ``>= 1``.
        hi: Largest length returned, or ``None`` for no cap.

    >>> x = LogNormal(1000, 0.5, hi=4096).sample(np.random.default_rng(0), 10_001)
    >>> bool(900 < np.median(x) < 1100), int(x.max()) <= 4096
    (True, True)

    """

    median: float = attrs.field(converter=to_float, validator=positive_float_field)
    sigma: float = attrs.field(
        converter=to_float,
        validator=typed(attrs.validators.ge(0.0), attrs.validators.lt(math.inf)),
    )
    lo: int = attrs.field(default=1, converter=to_int, validator=positive_int_field)
    hi: int | None = attrs.field(default=None, converter=attrs.converters.optional(to_int))

    @hi.validator
    def _check_hi(self, _: attrs.Attribute[int | None], value: int | None) -> None:
        if value is not None and value < self.lo:
            msg = f"LogNormal needs lo <= hi, got lo={self.lo}, hi={value}"
            raise InvalidArgumentError(msg)

    @classmethod
    def from_mean(cls, mean: float, sigma: float, lo: int = 1, hi: int | None = None) -> LogNormal:
        """The log-normal whose mean (before rounding and clipping) is ``mean``.

        The mean of a log-normal is ``median * exp(sigma**2 / 2)``.
        """
        check_positive_finite("mean", mean)
        return cls(mean * math.exp(-(sigma**2) / 2), sigma, lo, hi)

    def sample(self, rng: np.random.Generator, n: int) -> IntArray:
        """``n`` draws, int64 ``[n]``, each in ``[lo, hi]``."""
        values = rng.lognormal(math.log(self.median), self.sigma, size=sample_count(n))
        upper = _HUGE_LENGTH if self.hi is None else self.hi
        return np.clip(np.rint(values), self.lo, upper).astype(np.int64)


def _length_values(values: ArrayLike) -> IntArray:
    array = np.asarray(values)
    if array.ndim != 1 or array.size == 0:
        msg = f"Empirical needs a non-empty 1-D array of lengths, got shape {array.shape}"
        raise InvalidArgumentError(msg)
    return int_column(array, "Empirical values", array.size, positive=True)


@attrs.frozen(eq=False)
class Empirical:
    """Lengths resampled (with replacement) from observed values, such as a trace's column.

    Attributes:
        values: int64 ``[M]``, read-only: the observed lengths, each ``>= 1``.

    >>> Empirical([5, 5, 5]).sample(np.random.default_rng(0), 2).tolist()
    [5, 5]

    """

    values: IntArray = attrs.field(converter=_length_values, repr=lambda v: f"<{v.size} values>")

    def sample(self, rng: np.random.Generator, n: int) -> IntArray:
        """``n`` values drawn uniformly from ``values``, int64 ``[n]``."""
        return self.values[rng.integers(0, self.values.size, size=sample_count(n))]
