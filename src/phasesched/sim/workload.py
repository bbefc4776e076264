"""Workloads: what arrives when, with how many prompt tokens, asking for how many output tokens.

A :class:`Workload` is a value: three aligned read-only arrays (arrival time, prompt length,
output length) plus a name. It is cheap to keep 100,000 rows in one (about 2.4 MB), and
:meth:`Workload.requests` turns rows into :class:`~phasesched.Request` objects one at a time, so a
simulator never holds more requests than it has admitted.

Synthetic workloads are built from two small strategy families, each a ``Protocol`` so a caller
can add its own:

* a :class:`LengthDist` draws token counts (:class:`Fixed`, :class:`Uniform`, :class:`LogNormal`,
  :class:`Empirical`);
* an :class:`ArrivalProcess` draws arrival times (:class:`Poisson`, :class:`Gamma`,
  :class:`Burst`, :class:`Periodic`).

Every random draw comes from a generator seeded explicitly. Arrivals, prompt lengths and output
lengths use three independent streams spawned from one :class:`numpy.random.SeedSequence`, so two
workloads that share a seed and length distributions get identical lengths whatever their arrival
processes (and so does a :class:`ClosedLoop` with the same seed): comparisons are paired.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Iterator, Sequence
from typing import Protocol, runtime_checkable

import attrs
import numpy as np
from numpy.typing import ArrayLike, NDArray

from phasesched.request import Request, SamplingParams

__all__ = [
    "ArrivalProcess",
    "Burst",
    "ClosedLoop",
    "Empirical",
    "Fixed",
    "Gamma",
    "GridPoint",
    "LengthDist",
    "LogNormal",
    "Periodic",
    "Poisson",
    "Uniform",
    "Workload",
    "fixed",
    "grid_points",
    "mixed_load",
    "synthetic",
]

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]

# Requests built by Workload.requests() share one (frozen) SamplingParams instead of one each.
_GREEDY = SamplingParams()
# Rows converted to Python scalars at a time by Workload.requests(): bounds its memory.
_CHUNK = 1024
# LogNormal without an upper bound is clipped here so the cast to int64 stays defined.
_HUGE_LENGTH = 1e15


def _readonly(array: NDArray[np.generic]) -> NDArray[np.generic]:
    array.flags.writeable = False
    return array


def _as_array(values: ArrayLike) -> NDArray[np.generic]:
    return np.asarray(values)


def _as_optional_array(values: ArrayLike | None) -> NDArray[np.generic] | None:
    return None if values is None else np.asarray(values)


def _int_column(values: NDArray[np.generic], name: str, n: int, *, positive: bool) -> IntArray:
    """A read-only int64 copy of ``values``; refuses fractions, wrong shapes and (optionally) values < 1."""
    if values.shape != (n,):
        msg = f"{name} must be a 1-D array of length {n} (like arrival_s), got shape {values.shape}"
        raise ValueError(msg)
    if values.dtype.kind == "f" and not np.all(np.isfinite(values) & (values == np.trunc(values))):
        msg = f"{name} must hold whole numbers"
        raise ValueError(msg)
    if values.dtype.kind not in "iuf" and n > 0:
        msg = f"{name} must hold integers, got dtype {values.dtype}"
        raise ValueError(msg)
    column = values.astype(np.int64)
    if positive and n > 0 and column.min() < 1:
        i = int(np.argmax(column < 1))
        msg = f"{name} must be positive, got {name}[{i}] = {column[i]}"
        raise ValueError(msg)
    return _readonly(column)  # type: ignore[return-value]


def _time_column(values: NDArray[np.generic]) -> FloatArray:
    """A read-only float64 copy of arrival times; refuses NaN, infinities, negatives and disorder."""
    if values.ndim != 1:
        msg = f"arrival_s must be 1-D, got shape {values.shape}"
        raise ValueError(msg)
    if values.dtype.kind not in "iuf" and values.size > 0:
        msg = f"arrival_s must hold numbers, got dtype {values.dtype}"
        raise ValueError(msg)
    times = values.astype(np.float64)
    if not np.all(np.isfinite(times)) or (times.size > 0 and times[0] < 0):
        msg = "arrival_s must be finite and start at or after 0"
        raise ValueError(msg)
    backwards = np.diff(times) < 0
    if backwards.any():
        i = int(np.argmax(backwards)) + 1
        msg = f"arrival_s must be non-decreasing, got arrival_s[{i}] = {times[i]} < arrival_s[{i - 1}] = {times[i - 1]}"
        raise ValueError(msg)
    return _readonly(times)  # type: ignore[return-value]


def _check_positive_finite(name: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        msg = f"{name} must be a positive finite number, got {value}"
        raise ValueError(msg)


@attrs.frozen(eq=False)
class Workload:
    """A list of requests to replay: when each arrives and how long its prompt and output are.

    Arrays are copied on construction and read-only, so a workload can be shared freely; every
    transformation returns a new one. Rows are ordered by arrival time.

    Attributes:
        name: A label for reports (a trace's file stem, or a description of how it was built).
        arrival_s: float64 ``[N]``: arrival times in seconds, non-decreasing, the first ``>= 0``.
        prompt_len: int64 ``[N]``: prompt tokens, each ``>= 1``.
        output_len: int64 ``[N]``: tokens to generate, each ``>= 1``.
        priority: int64 ``[N]`` or ``None``: request priorities (lower is served first).

    Raises:
        ValueError: if the arrays disagree in length, are out of order, or hold a length below 1.

    >>> w = Workload("tiny", arrival_s=[0.0, 0.5, 1.0], prompt_len=[8, 16, 4], output_len=[2, 2, 1])
    >>> len(w), w.duration_s, w.rate
    (3, 1.0, 2.0)
    >>> next(w.requests()).max_new_tokens
    2

    """

    name: str = attrs.field(validator=attrs.validators.instance_of(str))
    arrival_s: FloatArray = attrs.field(converter=_as_array)
    prompt_len: IntArray = attrs.field(converter=_as_array)
    output_len: IntArray = attrs.field(converter=_as_array)
    priority: IntArray | None = attrs.field(default=None, converter=_as_optional_array)

    def __attrs_post_init__(self) -> None:
        times = _time_column(self.arrival_s)
        n = times.shape[0]
        object.__setattr__(self, "arrival_s", times)
        object.__setattr__(self, "prompt_len", _int_column(self.prompt_len, "prompt_len", n, positive=True))
        object.__setattr__(self, "output_len", _int_column(self.output_len, "output_len", n, positive=True))
        if self.priority is not None:
            object.__setattr__(self, "priority", _int_column(self.priority, "priority", n, positive=False))

    def __len__(self) -> int:
        return int(self.arrival_s.shape[0])

    def __repr__(self) -> str:
        return f"Workload(name={self.name!r}, requests={len(self)}, duration_s={self.duration_s:g})"

    @property
    def duration_s(self) -> float:
        """Seconds from the first arrival to the last (0 for fewer than two requests)."""
        return float(self.arrival_s[-1] - self.arrival_s[0]) if len(self) else 0.0

    @property
    def rate(self) -> float:
        """Mean arrival rate in requests/s, ``(N - 1) / duration_s`` as for the staged traces.

        ``inf`` when two or more requests all arrive at once; ``nan`` for fewer than two.
        """
        if len(self) < 2:
            return math.nan
        return (len(self) - 1) / self.duration_s if self.duration_s > 0 else math.inf

    def time_scaled(self, factor: float) -> Workload:
        """The same requests with every arrival time multiplied by ``factor`` (2 = half the rate).

        Args:
            factor: Positive multiplier of all arrival times.

        Returns:
            A new workload; lengths and order are unchanged.

        """
        _check_positive_finite("factor", factor)
        return attrs.evolve(self, arrival_s=self.arrival_s * factor)

    def scaled_to_rate(self, requests_per_s: float) -> Workload:
        """The same requests replayed at a mean rate of ``requests_per_s`` (gaps rescaled uniformly).

        Burstiness (the inter-arrival CV) is scale-free, so it is kept; only the clock changes.

        Raises:
            ValueError: if the target is not positive, or the workload has no rate to rescale
                (fewer than two requests, or all of them at one instant).

        """
        _check_positive_finite("requests_per_s", requests_per_s)
        if not (math.isfinite(self.rate) and self.rate > 0):
            msg = f"workload {self.name!r} has rate {self.rate}; it cannot be rescaled to a rate"
            raise ValueError(msg)
        return self.time_scaled(self.rate / requests_per_s)

    def head(self, n: int) -> Workload:
        """The first ``n`` requests (all of them if there are fewer)."""
        if operator.index(n) < 0:
            msg = f"head() needs n >= 0, got {n}"
            raise ValueError(msg)
        return self._rows(slice(0, n))

    def window(self, t0: float, t1: float = math.inf) -> Workload:
        """The requests arriving in ``[t0, t1)``, with the clock moved so ``t0`` becomes 0.

        Args:
            t0: Start of the window, seconds on this workload's clock, ``>= 0``.
            t1: End of the window (exclusive), ``>= t0``.

        Returns:
            A new workload whose first arrival is ``arrival_s[i] - t0`` for its first row ``i``.

        """
        if not 0 <= t0 <= t1:
            msg = f"window() needs 0 <= t0 <= t1, got t0={t0}, t1={t1}"
            raise ValueError(msg)
        lo, hi = np.searchsorted(self.arrival_s, [t0, t1], side="left")
        part = self._rows(slice(int(lo), int(hi)))
        return attrs.evolve(part, arrival_s=part.arrival_s - t0)  # >= 0: a >= t0 implies fl(a - t0) >= 0

    def clip_lengths(self, max_prompt: int | None = None, max_output: int | None = None) -> Workload:
        """Lengths capped at ``max_prompt`` / ``max_output`` (for a model's context limit); no row is dropped."""
        prompt, output = self.prompt_len, self.output_len
        if max_prompt is not None:
            prompt = np.minimum(prompt, _positive_int("max_prompt", max_prompt))
        if max_output is not None:
            output = np.minimum(output, _positive_int("max_output", max_output))
        return attrs.evolve(self, prompt_len=prompt, output_len=output)

    def requests(self, prefix: str = "r") -> Iterator[Request]:
        """Yield one length-only :class:`~phasesched.Request` per row, in arrival order, lazily.

        Row ``i`` becomes ``Request(f"{prefix}{i}", prompt_len=..., max_new_tokens=output_len[i],
        ignore_eos=True, arrival_time=arrival_s[i])``: output lengths are exact, as a benchmark
        that replays a trace needs. Only about a thousand rows are converted at a time, so a
        simulator that consumes the iterator as requests arrive keeps its memory flat.

        Args:
            prefix: Prepended to the row index to make each request id.

        """
        for start in range(0, len(self), _CHUNK):
            rows = slice(start, start + _CHUNK)
            arrivals = self.arrival_s[rows].tolist()
            priorities = self.priority[rows].tolist() if self.priority is not None else [0] * len(arrivals)
            columns = zip(
                arrivals, self.prompt_len[rows].tolist(), self.output_len[rows].tolist(), priorities, strict=True
            )
            for i, (arrival, prompt, output, priority) in enumerate(columns, start):
                yield Request(
                    f"{prefix}{i}",
                    prompt_len=prompt,
                    max_new_tokens=output,
                    ignore_eos=True,
                    arrival_time=arrival,
                    priority=priority,
                    sampling=_GREEDY,
                )

    def _rows(self, rows: slice) -> Workload:
        priority = None if self.priority is None else self.priority[rows]
        return Workload(self.name, self.arrival_s[rows], self.prompt_len[rows], self.output_len[rows], priority)


def _positive_int(name: str, value: int) -> int:
    value = operator.index(value)
    if value < 1:
        msg = f"{name} must be a positive integer, got {value}"
        raise ValueError(msg)
    return value


def _count(n: int) -> int:
    n = operator.index(n)
    if n < 0:
        msg = f"cannot sample a negative number of values ({n})"
        raise ValueError(msg)
    return n


def _positive_int_field(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    _positive_int(attribute.name, value)


def _positive_float_field(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    _check_positive_finite(attribute.name, value)


# --------------------------------------------------------------------------------------------
# Length distributions
# --------------------------------------------------------------------------------------------


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

    value: int = attrs.field(converter=operator.index, validator=_positive_int_field)

    def sample(self, rng: np.random.Generator, n: int) -> IntArray:  # noqa: ARG002 -- part of the protocol
        """``n`` copies of ``value``, int64 ``[n]``."""
        return np.full(_count(n), self.value, dtype=np.int64)


@attrs.frozen
class Uniform:
    """Lengths drawn uniformly from the integers ``lo .. hi``, both included.

    >>> sorted(set(Uniform(1, 2).sample(np.random.default_rng(0), 50).tolist()))
    [1, 2]
    """

    lo: int = attrs.field(converter=operator.index, validator=_positive_int_field)
    hi: int = attrs.field(converter=operator.index)

    @hi.validator
    def _check_hi(self, _: attrs.Attribute[int], value: int) -> None:
        if value < self.lo:
            msg = f"Uniform needs lo <= hi, got lo={self.lo}, hi={value}"
            raise ValueError(msg)

    def sample(self, rng: np.random.Generator, n: int) -> IntArray:
        """``n`` uniform integers in ``[lo, hi]``, int64 ``[n]``."""
        return rng.integers(self.lo, self.hi, size=_count(n), dtype=np.int64, endpoint=True)


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

    median: float = attrs.field(converter=float, validator=_positive_float_field)
    sigma: float = attrs.field(converter=float, validator=[attrs.validators.ge(0.0), attrs.validators.lt(math.inf)])
    lo: int = attrs.field(default=1, converter=operator.index, validator=_positive_int_field)
    hi: int | None = attrs.field(default=None, converter=attrs.converters.optional(operator.index))

    @hi.validator
    def _check_hi(self, _: attrs.Attribute[int | None], value: int | None) -> None:
        if value is not None and value < self.lo:
            msg = f"LogNormal needs lo <= hi, got lo={self.lo}, hi={value}"
            raise ValueError(msg)

    @classmethod
    def from_mean(cls, mean: float, sigma: float, lo: int = 1, hi: int | None = None) -> LogNormal:
        """The log-normal whose mean (before rounding and clipping) is ``mean``.

        The mean of a log-normal is ``median * exp(sigma**2 / 2)``.
        """
        _check_positive_finite("mean", mean)
        return cls(mean * math.exp(-(sigma**2) / 2), sigma, lo, hi)

    def sample(self, rng: np.random.Generator, n: int) -> IntArray:
        """``n`` draws, int64 ``[n]``, each in ``[lo, hi]``."""
        values = rng.lognormal(math.log(self.median), self.sigma, size=_count(n))
        upper = _HUGE_LENGTH if self.hi is None else self.hi
        return np.clip(np.rint(values), self.lo, upper).astype(np.int64)


def _length_values(values: ArrayLike) -> IntArray:
    array = np.asarray(values)
    if array.ndim != 1 or array.size == 0:
        msg = f"Empirical needs a non-empty 1-D array of lengths, got shape {array.shape}"
        raise ValueError(msg)
    return _int_column(array, "Empirical values", array.size, positive=True)


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
        return self.values[rng.integers(0, self.values.size, size=_count(n))]


def _as_dist(value: int | LengthDist) -> LengthDist:
    """``Fixed(value)`` for an integer; a length distribution as it is."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return Fixed(int(value))
    if not isinstance(value, LengthDist):
        msg = f"expected a length (int) or a LengthDist, got {type(value).__name__}"
        raise TypeError(msg)
    return value


# --------------------------------------------------------------------------------------------
# Arrival processes
# --------------------------------------------------------------------------------------------


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

    rate: float = attrs.field(converter=float, validator=_positive_float_field)

    def sample(self, rng: np.random.Generator, n: int) -> FloatArray:
        """``n`` arrival times, float64 ``[n]``, starting at 0."""
        n = _count(n)
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

    rate: float = attrs.field(converter=float, validator=_positive_float_field)
    cv: float = attrs.field(default=1.0, converter=float, validator=_positive_float_field)

    def sample(self, rng: np.random.Generator, n: int) -> FloatArray:
        """``n`` arrival times, float64 ``[n]``, starting at 0."""
        n = _count(n)
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
        return np.zeros(_count(n))


@attrs.frozen
class Periodic:
    """Evenly spaced arrivals, one every ``1 / rate`` seconds (no randomness; inter-arrival CV 0).

    >>> Periodic(4.0).sample(np.random.default_rng(0), 3).tolist()
    [0.0, 0.25, 0.5]
    """

    rate: float = attrs.field(converter=float, validator=_positive_float_field)

    def sample(self, rng: np.random.Generator, n: int) -> FloatArray:  # noqa: ARG002 -- part of the protocol
        """``n`` arrival times ``i / rate``, float64 ``[n]``."""
        return np.arange(_count(n)) / self.rate


# --------------------------------------------------------------------------------------------
# Builders
# --------------------------------------------------------------------------------------------


def _streams(seed: int) -> tuple[np.random.Generator, np.random.Generator, np.random.Generator]:
    """Independent generators for arrivals, prompt lengths and output lengths."""
    if operator.index(seed) < 0:
        msg = f"seed must be a non-negative integer, got {seed}"
        raise ValueError(msg)
    arrivals, prompts, outputs = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(3))
    return arrivals, prompts, outputs


def _lengths(prompt: int | LengthDist, output: int | LengthDist, n: int, seed: int) -> tuple[IntArray, IntArray]:
    _, prompt_rng, output_rng = _streams(seed)
    return _as_dist(prompt).sample(prompt_rng, n), _as_dist(output).sample(output_rng, n)


def synthetic(  # noqa: PLR0913 -- the workload's four ingredients plus seed and label
    n: int,
    arrivals: ArrivalProcess,
    prompt: int | LengthDist,
    output: int | LengthDist,
    *,
    seed: int = 0,
    name: str | None = None,
) -> Workload:
    """An open-loop workload of ``n`` requests, the same for the same arguments and seed.

    Args:
        n: Number of requests.
        arrivals: When they arrive; the first arrives at 0.
        prompt: Prompt lengths (an ``int`` means :class:`Fixed`).
        output: Output lengths (an ``int`` means :class:`Fixed`).
        seed: Seeds three independent streams (arrivals, prompts, outputs), so changing only the
            arrival process keeps every length.
        name: Label; by default built from ``n`` and ``seed``.

    Returns:
        The workload.

    >>> w = synthetic(100, Poisson(10.0), LogNormal(512, 1.0), Uniform(16, 64), seed=1)
    >>> len(w), float(w.arrival_s[0]), bool(w.output_len.max() <= 64)
    (100, 0.0, True)

    """
    n = _count(n)
    arrival_rng, _, _ = _streams(seed)
    prompt_len, output_len = _lengths(prompt, output, n, seed)
    times = arrivals.sample(arrival_rng, n)
    return Workload(name or f"synthetic-n{n}-seed{seed}", times, prompt_len, output_len)


def fixed(n: int, prompt_len: int, output_len: int, rate: float | None = None, *, name: str | None = None) -> Workload:
    """``n`` identical requests: all at time 0, or evenly spaced at ``rate`` requests/s (no randomness).

    >>> fixed(3, 128, 32, rate=2.0).arrival_s.tolist()
    [0.0, 0.5, 1.0]
    """
    arrivals: ArrivalProcess = Burst() if rate is None else Periodic(rate)
    label = name or f"fixed-p{prompt_len}-o{output_len}" + ("" if rate is None else f"-{rate:g}rps")
    return synthetic(n, arrivals, Fixed(prompt_len), Fixed(output_len), name=label)


def mixed_load(  # noqa: PLR0913 -- one knob per part of the experiment
    num_short: int,
    short_prompt: int | LengthDist,
    short_output: int | LengthDist,
    long_prompt: int,
    long_arrival_s: float,
    *,
    long_output: int = 1,
    seed: int = 0,
    name: str = "mixed-load",
) -> Workload:
    """``num_short`` short requests at time 0, then one long prompt at ``long_arrival_s``.

    The interference experiment: the short requests are decoding when the long prompt arrives, so
    a scheduler's choice (stall the decodes for the prefill, chunk it, ...) shows in both the long
    request's TTFT and the short requests' inter-token gaps. Pick ``short_output`` large enough
    that they are still decoding at ``long_arrival_s`` under the cost model in use.

    **The long request is always the last row**: index ``num_short``, so its id from
    :meth:`Workload.requests` is ``f"{prefix}{num_short}"``. (Rows are ordered by time, and the
    long one comes after any short one that arrives at the same instant.)

    Args:
        num_short: Short requests (0 measures the long prompt alone, the baseline).
        short_prompt: Their prompt lengths (an ``int`` means :class:`Fixed`).
        short_output: Their output lengths.
        long_prompt: The long request's prompt length.
        long_arrival_s: When it arrives, ``>= 0``.
        long_output: Tokens it generates (1 by default: only its TTFT is of interest).
        seed: Seeds the short requests' lengths, as in :func:`synthetic`.
        name: Label.

    Returns:
        ``num_short + 1`` requests.

    >>> w = mixed_load(4, 64, 512, long_prompt=8192, long_arrival_s=0.5)
    >>> w.arrival_s.tolist(), int(w.prompt_len[4])
    ([0.0, 0.0, 0.0, 0.0, 0.5], 8192)

    """
    if not (math.isfinite(long_arrival_s) and long_arrival_s >= 0):
        msg = f"long_arrival_s must be finite and >= 0, got {long_arrival_s}"
        raise ValueError(msg)
    num_short = _count(num_short)
    prompts, outputs = _lengths(short_prompt, short_output, num_short, seed)
    return Workload(
        name,
        arrival_s=np.append(np.zeros(num_short), long_arrival_s),
        prompt_len=np.append(prompts, _positive_int("long_prompt", long_prompt)),
        output_len=np.append(outputs, _positive_int("long_output", long_output)),
    )


@attrs.frozen
class ClosedLoop:
    """A closed-loop benchmark: ``concurrency`` clients, each sending its next request when one finishes.

    The simulator owns the clock: it issues the first ``concurrency`` requests at time 0 and
    then one more each time a request finishes (after ``think_time_s``), until
    ``num_requests`` have been issued. This spec only fixes *what* is sent, in order.

    Attributes:
        concurrency: Requests in flight at once, ``>= 1``.
        num_requests: Requests in total, ``>= 1``.
        prompt: Prompt lengths (an ``int`` means :class:`Fixed`).
        output: Output lengths.
        seed: Seeds the lengths exactly as :func:`synthetic` does.
        think_time_s: Pause between a request finishing and its client's next one.

    >>> p, o = ClosedLoop(8, 3, prompt=Uniform(10, 20), output=32).lengths()
    >>> p.shape, o.tolist()
    ((3,), [32, 32, 32])

    """

    concurrency: int = attrs.field(converter=operator.index, validator=_positive_int_field)
    num_requests: int = attrs.field(converter=operator.index, validator=_positive_int_field)
    prompt: LengthDist = attrs.field(converter=_as_dist)
    output: LengthDist = attrs.field(converter=_as_dist)
    seed: int = attrs.field(default=0, converter=operator.index, validator=attrs.validators.ge(0))
    think_time_s: float = attrs.field(
        default=0.0, converter=float, validator=[attrs.validators.ge(0.0), attrs.validators.lt(math.inf)]
    )

    def lengths(self) -> tuple[IntArray, IntArray]:
        """The lengths of requests ``0 .. num_requests - 1`` in issue order.

        Returns:
            ``(prompt_len, output_len)``, each int64 ``[num_requests]``; the same for the same seed.

        """
        return _lengths(self.prompt, self.output, self.num_requests, self.seed)

    def as_workload(self, name: str = "closed-loop") -> Workload:
        """The requests as a workload whose arrival times are placeholders (all 0).

        Lets a simulator reuse :meth:`Workload.requests`; it sets each request's real arrival time
        (for example with ``attrs.evolve(request, arrival_time=now)``) when it issues it.
        """
        prompt_len, output_len = self.lengths()
        return Workload(name, np.zeros(self.num_requests), prompt_len, output_len)


@attrs.frozen
class GridPoint:
    """One cell of the benchmark grid: fixed prompt and output lengths at a fixed concurrency."""

    prompt_len: int = attrs.field(converter=operator.index, validator=_positive_int_field)
    output_len: int = attrs.field(converter=operator.index, validator=_positive_int_field)
    concurrency: int = attrs.field(converter=operator.index, validator=_positive_int_field)

    @property
    def name(self) -> str:
        """A label such as ``"p1024-o256-c32"``."""
        return f"p{self.prompt_len}-o{self.output_len}-c{self.concurrency}"

    def closed_loop(self, num_requests: int, *, think_time_s: float = 0.0) -> ClosedLoop:
        """The cell as a closed-loop benchmark of ``num_requests`` requests."""
        return ClosedLoop(
            self.concurrency, num_requests, Fixed(self.prompt_len), Fixed(self.output_len), think_time_s=think_time_s
        )


def grid_points(
    prompts: Sequence[int] = (128, 1024, 4096, 16384),
    outputs: Sequence[int] = (32, 256, 1024),
    concurrency: Sequence[int] = (1, 8, 32, 128),
) -> Iterator[GridPoint]:
    """The seed benchmark grid: every combination, prompt length outermost, concurrency innermost.

    The defaults (48 points) span prefill-dominated (16384 in, 32 out) to decode-dominated
    (128 in, 1024 out) work, from a single stream to a saturated batch.

    >>> [p.name for p in grid_points((128,), (32,), (1, 8))]
    ['p128-o32-c1', 'p128-o32-c8']
    """
    for prompt_len, output_len, clients in itertools.product(prompts, outputs, concurrency):
        yield GridPoint(prompt_len, output_len, clients)
