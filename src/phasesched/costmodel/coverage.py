"""Counting the predictions a profiled cost model makes outside the grid it was measured on.

A :class:`~phasesched.costmodel.profiled.ProfiledCostModel` extrapolates linearly beyond its
grid, which is sensible a little past the edge and nonsense far past it (a tiny CPU model's
table asked for 32K-token prefills). :class:`GridCoverage` wraps one, answers exactly as it
does, and counts every step whose features lie outside the measured range, so a run can say
how much of it was extrapolated and what range the table covers.
"""

from __future__ import annotations

import attrs
import numpy as np
from numpy.typing import NDArray

from phasesched.costmodel.batching import DecodeBatching
from phasesched.costmodel.profiled import FEATURES, ProfiledCostModel

__all__ = ["GridCoverage"]

Float64Array = NDArray[np.float64]


@attrs.define(eq=False)
class GridCoverage:
    """A profiled cost model that counts its out-of-grid predictions (same answers; see the module docstring).

    Attributes:
        model: The profiled table.
        predictions: Steps priced.
        outside: Steps with at least one feature outside the measured range.
        seen_max: Per feature, the largest value asked for.

    >>> from phasesched.costmodel import ProfilePoint
    >>> grid = [ProfilePoint(p, 0, d, 64, 1e-3 + 1e-6 * p) for p in (0, 512) for d in (0, 8)]
    >>> coverage = GridCoverage(ProfiledCostModel(grid))
    >>> _ = coverage.step_time(np.array([4096]), np.array([4096]))
    >>> coverage.outside, coverage.predictions
    (1, 1)
    """

    model: ProfiledCostModel
    predictions: int = 0
    outside: int = 0
    seen_max: Float64Array = attrs.field(factory=lambda: np.zeros(len(FEATURES)))
    _low: Float64Array = attrs.field(init=False)
    _high: Float64Array = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        features = np.array([p.features for p in self.model.points], dtype=np.float64)
        self._low, self._high = features.min(axis=0), features.max(axis=0)

    def _count(self, features: Float64Array) -> None:
        """Count rows of ``features`` ([N, 4]) outside the grid; a prefix or context only counts with its slices."""
        used = features.copy()
        used[:, 1] = np.where(features[:, 0] > 0, features[:, 1], self._low[1])
        used[:, 3] = np.where(features[:, 2] > 0, features[:, 3], self._low[3])
        out = np.any((used > self._high) | (used < self._low), axis=1)
        self.predictions += len(features)
        self.outside += int(np.count_nonzero(out))
        self.seen_max = np.maximum(self.seen_max, features.max(axis=0))

    def step_time(self, num_new: NDArray[np.integer], kv_len: NDArray[np.integer]) -> float:
        """The table's step time (see :meth:`ProfiledCostModel.step_time`), counted."""
        self._count(self.model.step_features(num_new, kv_len)[None, :])
        return self.model.step_time(num_new, kv_len)

    def decode_step_times(self, kv_len: NDArray[np.integer], num_steps: int) -> Float64Array:
        """The table's decode steps (see :meth:`ProfiledCostModel.decode_step_times`), counted."""
        times = self.model.decode_step_times(kv_len, num_steps)  # checks the arguments first
        if len(kv_len) and num_steps:
            self._count(self.model.decode_features(kv_len, num_steps))
        return times

    @property
    def decode_batching(self) -> DecodeBatching:
        """The wrapped model's decode batching (a simulated executor pricing with it declares it)."""
        return self.model.decode_batching

    def warning(self) -> str | None:
        """A one-line warning when any prediction was extrapolated, naming the covered range; else ``None``."""
        if not self.outside:
            return None
        beyond = [
            f"{name} up to {seen:,.0f} (profiled {low:,.0f}..{high:,.0f})"
            for name, seen, low, high in zip(FEATURES, self.seen_max, self._low, self._high, strict=True)
            if seen > high
        ]
        share = self.outside / self.predictions
        return (
            f"{self.outside:,} of {self.predictions:,} step-time predictions ({share:.1%}) fell outside the "
            f"profiled grid and were extrapolated: {'; '.join(beyond) or 'below its smallest values'}"
        )
