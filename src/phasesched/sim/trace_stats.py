"""Trace statistics: a workload's size, arrival rate, burstiness and length distributions.

:func:`trace_stats` computes the figures the staged traces' README reports, so a loaded trace
(or a synthetic workload meant to resemble one) can be checked against them; it backs
``phasesched trace stats FILE``. It reads only a :class:`~phasesched.sim.workload.Workload`,
so it works the same on any trace format :mod:`~phasesched.sim.traces` reads.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import numpy as np
from numpy.typing import NDArray

from phasesched.errors import InvalidArgumentError
from phasesched.sim.workload import Workload

__all__ = ["LengthStats", "TraceStats", "trace_stats"]

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]


@attrs.frozen
class LengthStats:
    """Summary of one token-length column; percentiles interpolate linearly (numpy's default)."""

    min: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: int

    @classmethod
    def of(cls, lengths: IntArray) -> LengthStats:
        """The summary of int64 ``[N]`` lengths, ``N >= 1``."""
        p50, p90, p99 = np.percentile(lengths, [50, 90, 99]).tolist()
        return cls(int(lengths.min()), float(lengths.mean()), p50, p90, p99, int(lengths.max()))


@attrs.frozen
class TraceStats:
    """A trace's size, rate, burstiness and length distributions, computed as the staged traces' README does.

    Burstiness is a coefficient of variation (population standard deviation over mean): of the
    gaps between consecutive arrivals (Poisson gives about 1), and of the request counts in
    consecutive 1 s and 60 s buckets from the first arrival, the last partial bucket dropped
    (one long gap can dominate the inter-arrival CV; the bucket CVs show sustained bursts).
    A value that needs more rows (or more full buckets) than the trace has is ``nan``.

    Attributes:
        name: The workload's name.
        rows: Requests.
        span_s: Seconds from the first arrival to the last.
        distinct_arrivals: Distinct arrival times (far below ``rows`` on a tick grid, like Mooncake's).
        mean_rate: ``(rows - 1) / span_s``, requests/s.
        median_gap_s: Median inter-arrival gap.
        max_gap_s: Longest inter-arrival gap.
        interarrival_cv: CV of the inter-arrival gaps.
        per_second_cv: CV of per-second request counts.
        max_per_second: Most requests in one second (any bucket, the partial one included).
        per_minute_cv: CV of per-minute request counts.
        prompt: Prompt-length summary.
        output: Output-length summary.

    """

    name: str
    rows: int
    span_s: float
    distinct_arrivals: int
    mean_rate: float
    median_gap_s: float
    max_gap_s: float
    interarrival_cv: float
    per_second_cv: float
    max_per_second: int
    per_minute_cv: float
    prompt: LengthStats
    output: LengthStats

    def to_dict(self) -> dict[str, Any]:
        """The statistics as plain (JSON-serialisable) values; ``prompt`` and ``output`` nest."""
        return attrs.asdict(self)

    def format_table(self) -> str:
        """A plain-text report for a terminal (``phasesched trace stats FILE``)."""
        lines = [
            f"{self.name}: {self.rows:,} requests over {_num(self.span_s)} s ({self.span_s / 60:,.1f} min)",
            f"  mean rate          {self.mean_rate:,.3f} req/s ({self.distinct_arrivals:,} distinct arrival times)",
            (
                f"  inter-arrival gap  CV {self.interarrival_cv:.2f}"
                f" (median {self.median_gap_s:.3f} s, max {_num(self.max_gap_s)} s)"
            ),
            f"  per-second count   CV {self.per_second_cv:.2f} (at most {self.max_per_second:,})",
            f"  per-minute count   CV {self.per_minute_cv:.2f}",
            "",
        ]
        table = [
            ["tokens", "min", "mean", "p50", "p90", "p99", "max"],
            ["input", *(_num(value) for value in attrs.astuple(self.prompt))],
            ["output", *(_num(value) for value in attrs.astuple(self.output))],
        ]
        return "\n".join(lines + _aligned(table))


def _aligned(table: list[list[str]]) -> list[str]:
    """Rows with the first column left-aligned and the others right-aligned."""
    widths = [max(len(cell) for cell in column) for column in zip(*table, strict=True)]
    lines = []
    for first, *rest in table:
        cells = [cell.rjust(width) for cell, width in zip(rest, widths[1:], strict=True)]
        lines.append("  ".join(["", first.ljust(widths[0]), *cells]))
    return lines


def _num(value: float) -> str:
    """``1,469`` for a whole number, ``5,187.6`` otherwise (the README's style)."""
    if not math.isfinite(value):
        return str(value)
    return f"{int(value):,}" if float(value).is_integer() else f"{value:,.1f}"


def _cv(values: FloatArray) -> float:
    mean = float(values.mean()) if values.size else 0.0
    return float(values.std()) / mean if mean > 0 else math.nan


def _bucket_counts(offsets: FloatArray, width: float) -> tuple[float, int]:
    """CV over the full ``width``-second buckets, and the largest count over all of them.

    Only the occupied buckets are counted (memory O(rows), whatever the span): the empty ones
    among the full buckets enter the CV as zeros, arithmetically.
    """
    buckets, counts = np.unique((offsets // width).astype(np.int64), return_counts=True)
    num_full = int(offsets[-1] // width)
    if num_full < 2:  # a CV needs two buckets
        return math.nan, int(counts.max())
    full = counts[buckets < num_full].astype(np.float64)
    mean = float(full.sum()) / num_full
    if mean <= 0:
        return math.nan, int(counts.max())
    squares = float(((full - mean) ** 2).sum()) + (num_full - full.size) * mean**2
    return math.sqrt(squares / num_full) / mean, int(counts.max())


def trace_stats(workload: Workload) -> TraceStats:
    """Describe a workload's arrivals and lengths (see :class:`TraceStats` for the method).

    Raises:
        InvalidArgumentError: if the workload is empty.

    >>> from phasesched.sim import Workload
    >>> s = trace_stats(Workload("w", [0.0, 1.0, 3.0], [10, 20, 30], [1, 2, 3]))
    >>> s.mean_rate, s.prompt.p50, s.output.max
    (0.6666666666666666, 20.0, 3)

    """
    if len(workload) == 0:
        msg = f"workload {workload.name!r} is empty"
        raise InvalidArgumentError(msg)
    t = workload.arrival_s
    gaps = np.diff(t)
    offsets = t - t[0]
    per_second_cv, max_per_second = _bucket_counts(offsets, 1.0)
    per_minute_cv, _ = _bucket_counts(offsets, 60.0)
    return TraceStats(
        name=workload.name,
        rows=len(workload),
        span_s=workload.duration_s,
        distinct_arrivals=int(np.unique(t).size),
        mean_rate=workload.rate,
        median_gap_s=float(np.median(gaps)) if gaps.size else math.nan,
        max_gap_s=float(gaps.max()) if gaps.size else math.nan,
        interarrival_cv=_cv(gaps),
        per_second_cv=per_second_cv,
        max_per_second=max_per_second,
        per_minute_cv=per_minute_cv,
        prompt=LengthStats.of(workload.prompt_len),
        output=LengthStats.of(workload.output_len),
    )
