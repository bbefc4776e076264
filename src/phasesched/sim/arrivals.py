"""Arrival processes: the strategies that draw when the requests of an open-loop workload arrive.

:class:`ArrivalProcess` is a ``Protocol``, so a caller can add its own; four are built in:
:class:`Poisson` (memoryless), :class:`Gamma` (bursty, with a chosen inter-arrival CV),
:class:`Burst` (everything at time 0) and :class:`Periodic` (evenly spaced). Every process
starts at time 0 and draws only from the generator it is given; :func:`~phasesched.sim.builders.synthetic`
gives arrivals a stream of their own, so changing the process keeps every length.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import attrs
import numpy as np
from numpy.typing import NDArray

from phasesched.sim._checks import positive_float_field, sample_count
from phasesched.validators import to_float

__all__ = ["ArrivalProcess", "Burst", "Gamma", "Periodic", "Poisson"]

FloatArray = NDArray[np.float64]


@runtime_checkable
class ArrivalProcess(Protocol):
    """Draws arrival times for an open-loop workload."""

    def sample(self, rng: np.random.Generator, n: int) -> FloatArray:
        """Draw ``n`` arrival times.

        Args:
            rng: The only source of randomness.
            n: How many arrivals, ``>= 0``.

        Returns:
            float64 ``[n]``: non-decreasing times in seconds; the first is 0, so ``n`` arrivals
            span ``n - 1`` gaps and ``(n - 1) / span`` estimates the rate without bias.

        """


def _times_from_gaps(gaps: FloatArray) -> FloatArray:
    """Arrival times ``0, g0, g0 + g1, ...``: float64 ``[len(gaps) + 1]``."""
    times = np.zeros(gaps.size + 1)
    np.cumsum(gaps, out=times[1:])
    return times


@attrs.frozen
class Poisson:
    """Memoryless arrivals: exponential gaps with mean ``1 / rate`` (inter-arrival CV 1).

    >>> t = Poisson(2.0).sample(np.random.default_rng(0), 10_001)
    >>> float(t[0]), bool(1.9 < 10_000 / t[-1] < 2.1)
    (0.0, True)
    """

    rate: float = attrs.field(converter=to_float, validator=positive_float_field)

    def sample(self, rng: np.random.Generator, n: int) -> FloatArray:
        """``n`` arrival times, float64 ``[n]``, starting at 0."""
        n = sample_count(n)
        return _times_from_gaps(rng.exponential(1.0 / self.rate, size=max(n - 1, 0)))[:n]


@attrs.frozen
class Gamma:
    """Bursty arrivals: gamma-distributed gaps with mean ``1 / rate`` and coefficient of variation ``cv``.

    ``cv = 1`` is Poisson; ``cv > 1`` clusters requests into bursts separated by long quiet gaps
    (the Azure code trace has an inter-arrival CV of about 13); ``cv < 1`` is more regular.
    The gamma shape is ``1 / cv**2`` and the scale ``cv**2 / rate``.

    >>> Gamma(1.0, cv=4.0).sample(np.random.default_rng(0), 4).shape
    (4,)
    """

    rate: float = attrs.field(converter=to_float, validator=positive_float_field)
    cv: float = attrs.field(default=1.0, converter=to_float, validator=positive_float_field)

    def sample(self, rng: np.random.Generator, n: int) -> FloatArray:
        """``n`` arrival times, float64 ``[n]``, starting at 0."""
        n = sample_count(n)
        gaps = rng.gamma(1.0 / self.cv**2, self.cv**2 / self.rate, size=max(n - 1, 0))
        return _times_from_gaps(gaps)[:n]


@attrs.frozen
class Burst:
    """Every request arrives at time 0 (offline batch; the peak of queueing).

    >>> Burst().sample(np.random.default_rng(0), 2).tolist()
    [0.0, 0.0]
    """

    def sample(self, rng: np.random.Generator, n: int) -> FloatArray:  # noqa: ARG002 -- part of the protocol
        """``n`` zeros, float64 ``[n]``."""
        return np.zeros(sample_count(n))


@attrs.frozen
class Periodic:
    """Evenly spaced arrivals, one every ``1 / rate`` seconds (no randomness; inter-arrival CV 0).

    >>> Periodic(4.0).sample(np.random.default_rng(0), 3).tolist()
    [0.0, 0.25, 0.5]
    """

    rate: float = attrs.field(converter=to_float, validator=positive_float_field)

    def sample(self, rng: np.random.Generator, n: int) -> FloatArray:  # noqa: ARG002 -- part of the protocol
        """``n`` arrival times ``i / rate``, float64 ``[n]``."""
        return np.arange(sample_count(n)) / self.rate
