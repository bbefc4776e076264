"""A streaming distribution: exact while small, a fine log-bucket histogram past a size limit.

A long simulation produces one inter-token gap per generated token, tens of millions of values;
keeping them all would make memory grow with the run. Up to ``exact_limit`` samples are kept
exactly (percentiles as numpy computes them); beyond that they are folded into a histogram of
log-spaced buckets ``relative_resolution`` wide, so percentiles keep that relative accuracy and
memory stays flat. Counts, sums, minimum and maximum are always exact.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import ArrayLike, NDArray

__all__ = ["Distribution"]

FloatArray = NDArray[np.float64]
_FLUSH_AT = 8192


class Distribution:
    """Samples of one non-negative quantity (seconds, usually).

    Args:
        exact_limit: Samples kept exactly before switching to the histogram.
        relative_resolution: Histogram bucket width, relative (1e-3: percentiles within 0.1%).
        floor: Values below this share the first bucket (1 ns for durations).

    >>> d = Distribution()
    >>> d.add_many([0.01, 0.02, 0.03, 0.04])
    >>> d.count, round(d.mean, 3), round(d.percentile(50), 3)
    (4, 0.025, 0.025)
    """

    def __init__(self, exact_limit: int = 65_536, relative_resolution: float = 1e-3, floor: float = 1e-9) -> None:
        self.exact_limit = exact_limit
        self._log_base = math.log1p(relative_resolution)
        self._floor = floor
        self._exact: list[FloatArray] = []
        self._exact_count = 0
        self._buckets: NDArray[np.int64] | None = None
        self._count = 0
        self._total = 0.0
        self._m2 = 0.0  # sum of squared deviations from the mean (Chan et al.'s parallel update)
        self._min = math.inf
        self._max = -math.inf
        # Samples not yet folded in: adding is a list append, folding is vectorized in batches.
        self._pending_values: list[float] = []
        self._pending_arrays: list[tuple[FloatArray, NDArray[np.int64] | None]] = []
        self._pending_size = 0

    # ---------------------------------------------------------------- adding
    def add(self, value: float, count: int = 1) -> None:
        """Record ``value`` ``count`` times."""
        if count == 1:
            self._pending_values.append(value)
            self._pending_size += 1
            if self._pending_size >= _FLUSH_AT:
                self._flush()
        else:
            self.add_many(np.array([value]), np.array([count]))

    def add_many(self, values: ArrayLike, counts: ArrayLike | None = None) -> None:
        """Record each ``values[i]`` ``counts[i]`` times (once each when ``counts`` is omitted).

        Args:
            values: float ``[N]`` (any shape is flattened): the samples.
            counts: int ``[N]`` or ``None``: how many times each is recorded.
        """
        vals = np.asarray(values, dtype=np.float64).ravel()
        if len(vals):
            reps = None if counts is None else np.asarray(counts, dtype=np.int64).ravel()
            self._pending_arrays.append((vals, reps))
            self._pending_size += len(vals)
            if self._pending_size >= _FLUSH_AT:
                self._flush()

    def _flush(self) -> None:
        """Fold pending samples in, one vectorized pass."""
        pending = self._pending_arrays
        if self._pending_values:
            pending.append((np.array(self._pending_values), None))
            self._pending_values = []
        self._pending_arrays, self._pending_size = [], 0
        if not pending:
            return
        vals = np.concatenate([v for v, _ in pending])
        if all(r is None for _, r in pending):
            self._fold(vals, None)
        else:
            reps = np.concatenate([np.ones(len(v), np.int64) if r is None else r for v, r in pending])
            self._fold(vals, reps)

    def _fold(self, vals: FloatArray, reps: NDArray[np.int64] | None) -> None:
        n = len(vals) if reps is None else int(reps.sum())
        if n == 0:
            return
        weights = np.ones(len(vals)) if reps is None else reps.astype(np.float64)
        batch_total = float((weights * vals).sum())
        batch_mean = batch_total / n
        batch_m2 = float((weights * (vals - batch_mean) ** 2).sum())
        if self._count:
            delta = batch_mean - self._total / self._count
            self._m2 += batch_m2 + delta * delta * self._count * n / (self._count + n)
        else:
            self._m2 = batch_m2
        self._count += n
        self._total += batch_total
        self._min = min(self._min, float(vals.min()))
        self._max = max(self._max, float(vals.max()))
        if self._buckets is None and self._exact_count + n <= self.exact_limit:
            self._exact.append(vals if reps is None else np.repeat(vals, reps))
            self._exact_count += n
            return
        self._to_histogram()
        self._bucket(vals, reps)

    def merge(self, other: Distribution) -> None:
        """Add every sample of ``other`` (same resolution) to this distribution."""
        other._flush()
        self._flush()
        if other.count == 0:
            return
        if other._buckets is None:
            self.add_many(np.concatenate(other._exact))
            return
        self._to_histogram()
        assert self._buckets is not None
        if self._count:
            delta = other.mean - self.mean
            self._m2 += other._m2 + delta * delta * self._count * other.count / (self._count + other.count)
        else:
            self._m2 = other._m2
        self._count += other.count
        self._total += other.total
        self._min, self._max = min(self._min, other.min), max(self._max, other.max)
        self._grow(len(other._buckets))
        self._buckets[: len(other._buckets)] += other._buckets

    # ---------------------------------------------------------------- reading
    @property
    def count(self) -> int:
        """Samples recorded."""
        self._flush()
        return self._count

    @property
    def total(self) -> float:
        """Sum of the samples."""
        self._flush()
        return self._total

    @property
    def min(self) -> float:
        """Smallest sample (``inf`` when empty)."""
        self._flush()
        return self._min

    @property
    def max(self) -> float:
        """Largest sample (``-inf`` when empty)."""
        self._flush()
        return self._max

    @property
    def is_exact(self) -> bool:
        """Whether every sample is still kept exactly."""
        self._flush()
        return self._buckets is None

    @property
    def mean(self) -> float:
        """Arithmetic mean (``nan`` when empty)."""
        return self.total / self.count if self.count else math.nan

    @property
    def std(self) -> float:
        """Population standard deviation (``nan`` when empty)."""
        if not self.count:
            return math.nan
        return math.sqrt(max(self._m2 / self.count, 0.0))

    def percentile(self, q: float) -> float:
        """The ``q``-th percentile (0-100), numpy's linear method while exact; ``nan`` when empty."""
        return float(self.percentiles([q])[0])

    def percentiles(self, qs: ArrayLike) -> FloatArray:
        """Several percentiles at once, computed as :meth:`percentile` computes one.

        Args:
            qs: float ``[Q]`` (or any shape): percentiles, 0-100.

        Returns:
            float64, shaped like ``qs``: the percentiles (``nan`` when empty).
        """
        q = np.asarray(qs, dtype=np.float64)
        self._flush()
        if not self._count:
            return np.full(q.shape, math.nan)
        if self._buckets is None:
            return np.asarray(np.percentile(np.concatenate(self._exact), q), dtype=np.float64)
        cumulative = np.cumsum(self._buckets)
        ranks = np.clip(np.ceil(q / 100.0 * self.count), 1, self.count)
        index = np.searchsorted(cumulative, ranks)
        return np.clip(self._bucket_middle(index), self._min, self._max)

    def cdf(self, points: int = 200) -> tuple[FloatArray, FloatArray]:
        """The empirical CDF at ``points`` evenly spaced fractions, for plots.

        Returns:
            ``(values, fractions)``, both float64 ``[points]``: ``fractions`` runs evenly from 0 to 1
            and ``values[i]`` is the sample at fraction ``fractions[i]`` (all ``nan`` when empty).
        """
        fractions = np.linspace(0.0, 1.0, points)
        return self.percentiles(fractions * 100.0), fractions

    def summary(self, scale: float = 1.0, percentiles: tuple[float, ...] = (50, 90, 95, 99)) -> dict[str, float]:
        """``mean``, ``std``, ``p50``..., ``max`` of the samples times ``scale`` (1e3 for milliseconds)."""
        values = self.percentiles(percentiles) * scale
        out = {"mean": self.mean * scale, "std": self.std * scale}
        out.update({f"p{_label(q)}": float(v) for q, v in zip(percentiles, values, strict=True)})
        out["max"] = (self.max if self.count else math.nan) * scale
        return out

    # ---------------------------------------------------------------- internals
    def _to_histogram(self) -> None:
        if self._buckets is not None:
            return
        self._buckets = np.zeros(1024, dtype=np.int64)
        if self._exact:
            self._bucket(np.concatenate(self._exact), None)
        self._exact, self._exact_count = [], 0

    def _bucket(self, values: FloatArray, counts: NDArray[np.int64] | None) -> None:
        index = np.floor(np.log(np.maximum(values, self._floor) / self._floor) / self._log_base).astype(np.int64)
        self._grow(int(index.max()) + 1)
        assert self._buckets is not None
        np.add.at(self._buckets, index, 1 if counts is None else counts)

    def _grow(self, size: int) -> None:
        assert self._buckets is not None
        if size > len(self._buckets):
            grown = np.zeros(max(size, 2 * len(self._buckets)), dtype=np.int64)
            grown[: len(self._buckets)] = self._buckets
            self._buckets = grown

    def _bucket_middle(self, index: NDArray[np.int64]) -> FloatArray:
        middle: FloatArray = self._floor * np.exp((index + 0.5) * self._log_base)
        return middle


def _label(q: float) -> str:
    return str(int(q)) if float(q).is_integer() else str(q).replace(".", "_")
