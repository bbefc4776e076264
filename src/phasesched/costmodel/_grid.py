"""Multilinear interpolation on a rectilinear grid, extended linearly beyond its edges and kept monotone.

Private to :mod:`phasesched.costmodel.profiled`. The extension is done once, on the grid: along
each axis one node is added below the first (at 0) and one far above the last, with the values
the edge cells' slopes give. Interpolating that extended grid is then plain multilinear
interpolation, which is linear extrapolation along an axis that leaves the measured range.
Where the extrapolations disagree across axes (a slope that shrinks along another axis), the
virtual nodes are adjusted so the extended grid, hence the interpolant, stays monotone whenever
the measured values are, without moving any measured value.
"""

from __future__ import annotations

import itertools

import attrs
import numpy as np
from numpy.typing import NDArray

__all__ = ["GridInterpolator"]

Float64Array = NDArray[np.float64]

_FAR = 2.0**40
"""Where the upper virtual node sits: beyond any token count or context a step can have."""


def _extend(axis: Float64Array, values: Float64Array, dim: int) -> tuple[Float64Array, Float64Array]:
    """Add the virtual nodes along ``dim``: at 0 (if the axis starts above it) and far above."""
    first, last = np.take(values, [0], axis=dim), np.take(values, [-1], axis=dim)
    if len(axis) > 1:
        low_slope = (np.take(values, [1], axis=dim) - first) / (axis[1] - axis[0])
        high_slope = (last - np.take(values, [-2], axis=dim)) / (axis[-1] - axis[-2])
    else:  # a single measured value says nothing about the slope: hold it constant
        low_slope = high_slope = np.zeros_like(first)
    far = max(_FAR, 2.0 * float(axis[-1]))
    parts_axis = [axis, np.array([far])]
    parts_values = [values, last + high_slope * (far - axis[-1])]
    if axis[0] > 0:
        parts_axis.insert(0, np.zeros(1))
        parts_values.insert(0, first - low_slope * axis[0])
    return np.concatenate(parts_axis), np.concatenate(parts_values, axis=dim)


def _running_max(values: Float64Array) -> Float64Array:
    """Each entry replaced by the largest entry at or below it along every axis."""
    for dim in range(values.ndim):
        values = np.maximum.accumulate(values, axis=dim)
    return values


def _monotone_extension(values: Float64Array, measured: tuple[NDArray[np.intp], ...]) -> Float64Array:
    """Make an extended grid monotone without moving its (monotone) measured nodes.

    A virtual node is first clipped between the largest measured value below it and the
    smallest above it (a corner extrapolated along two axes at once can otherwise overshoot
    its measured neighbours), then the running maximum orders the virtual nodes among
    themselves; no measured node is raised, since everything below one is at most its value.
    """
    mask = np.zeros(values.shape, dtype=bool)
    mask[measured] = True
    below = _running_max(np.where(mask, values, -np.inf))
    flipped = tuple(slice(None, None, -1) for _ in range(values.ndim))
    above = -_running_max(-np.where(mask, values, np.inf)[flipped])[flipped]
    return _running_max(np.clip(values, below, above))


@attrs.frozen(eq=False)
class GridInterpolator:
    """Evaluates the extended grid at arbitrary points. Build it with :meth:`build`.

    Attributes:
        axes: ``D`` strictly increasing float64 axes of the *extended* grid (length >= 2 each).
        flat_values: float64 ``[prod(len(axis))]``: the extended grid's values, C order.

    """

    axes: tuple[Float64Array, ...]
    flat_values: Float64Array
    _strides: NDArray[np.int64] = attrs.field(init=False, repr=False)
    _padded: Float64Array = attrs.field(init=False, repr=False)
    _last_cell: NDArray[np.int64] = attrs.field(init=False, repr=False)
    _corner_bits: NDArray[np.bool_] = attrs.field(init=False, repr=False)
    _corner_offsets: NDArray[np.int64] = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        shape = [len(axis) for axis in self.axes]
        strides = np.array([int(np.prod(shape[d + 1 :])) for d in range(len(shape))], dtype=np.int64)
        # All axes in one array, padded with +inf, so every axis is searched in one operation.
        padded = np.full((len(shape), max(shape)), np.inf)
        for dim, axis in enumerate(self.axes):
            padded[dim, : len(axis)] = axis
        bits = np.array(list(itertools.product((0, 1), repeat=len(shape))), dtype=np.int64)
        object.__setattr__(self, "_strides", strides)
        object.__setattr__(self, "_padded", padded)
        object.__setattr__(self, "_last_cell", np.array(shape, dtype=np.int64) - 2)
        object.__setattr__(self, "_corner_bits", bits.astype(bool))
        object.__setattr__(self, "_corner_offsets", bits @ strides)

    @classmethod
    def build(cls, axes: tuple[Float64Array, ...], values: Float64Array, *, monotone: bool) -> GridInterpolator:
        """Extend ``values`` (shape ``[len(a) for a in axes]``) and, if asked, make it monotone.

        Args:
            axes: ``D`` strictly increasing non-negative float64 axes.
            values: float64 grid values, one axis per entry of ``axes``.
            monotone: Replace every measured value by the largest at or below it along every
                axis (a no-op on monotone data; on noisy data it restores monotonicity), and
                keep the virtual nodes between the measured ones around them.

        """
        if monotone:
            values = _running_max(values)
        extended_axes, measured = [], []
        for dim, axis in enumerate(axes):
            extended, values = _extend(axis, values, dim)
            extended_axes.append(extended)
            measured.append(np.isin(extended, axis))
        if monotone:
            values = _monotone_extension(values, np.ix_(*measured))
        return cls(tuple(extended_axes), np.ascontiguousarray(values, dtype=np.float64).ravel())

    def __call__(self, points: Float64Array) -> Float64Array:
        """Interpolated values at ``points`` (float64 ``[N, D]``), clamped at >= 0; float64 ``[N]``."""
        dims = np.arange(len(self.axes))
        x = np.minimum(np.maximum(points, self._padded[:, 0]), self._padded[dims, self._last_cell + 1])
        # The cell left of x on each axis: how many nodes are <= x, less one, kept in range.
        cell = np.minimum(np.maximum((x[:, :, None] >= self._padded[None]).sum(axis=2) - 1, 0), self._last_cell)
        left, right = self._padded[dims, cell], self._padded[dims, cell + 1]
        frac = (x - left) / (right - left)
        # Weight of each of the 2**D cell corners: a product of t or 1 - t per axis.
        weights = np.where(self._corner_bits[None, :, :], frac[:, None, :], 1.0 - frac[:, None, :]).prod(axis=2)
        corners = self.flat_values[(cell @ self._strides)[:, None] + self._corner_offsets[None, :]]
        return np.asarray(np.maximum((weights * corners).sum(axis=1), 0.0), dtype=np.float64)
