"""A cost model read from measurements: step times on a grid, interpolated.

``phasesched profile`` runs a real executor on synthetic steps and writes one CSV row per grid
point; :class:`ProfiledCostModel` reads it back and answers any step shape by multilinear
interpolation over four features of the step.

CSV schema (UTF-8, comma-separated, one header line, one row per grid point):

* optional ``# key: value`` metadata lines at the top, before the header (model, executor,
  device, date, ...); they come back from :func:`read_profile_csv` as a dict (other ``#``
  lines there are comments);
* the header names the columns; order is free and extra columns are ignored;
* ``prefill_tokens`` (int): query tokens of the step's prefill slices (0: decode-only);
* ``prefill_prefix`` (number): tokens already in the prefill slice's cache before the step
  (with several prefill slices, their token-weighted mean);
* ``decode_seqs`` (int): decode slices, i.e. slices with ``num_new == 1``;
* ``decode_context`` (number): KV length of the decode slices after the step (a profiled
  step's decodes all have this context; a real step is read at the context its decodes cost
  like, see below);
* ``step_time_s`` (number): the median measured duration, seconds.

The rows must form the full product of the values each feature takes (a grid).

How a real step's decodes, whose contexts differ, map onto the uniform profiled steps depends
on the executor that was profiled: the metadata line ``# decode_batching: ...`` records its
:class:`~phasesched.costmodel.batching.DecodeBatching` (ragged: the mean context; padded: the
longest; bucketed: the mean padded context; batch padding for CUDA graphs). A profile without
that line (written before executors declared it) is read at the mean context, as it always was.
"""

from __future__ import annotations

import csv
import io
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import attrs
import numpy as np
from numpy.typing import ArrayLike, NDArray

from phasesched.costmodel._batch import check_batch, check_decodes
from phasesched.costmodel._grid import GridInterpolator
from phasesched.costmodel.batching import RAGGED, DecodeBatching, decode_batching_from_metadata
from phasesched.errors import InvalidArgumentError, PhaseschedError
from phasesched.validators import to_float, typed

__all__ = [
    "FEATURES",
    "ProfileFormatError",
    "ProfilePoint",
    "ProfiledCostModel",
    "read_profile_csv",
    "step_features",
    "write_profile_csv",
]

Float64Array = NDArray[np.float64]

FEATURES = ("prefill_tokens", "prefill_prefix", "decode_seqs", "decode_context")
"""The grid's four axes, in the order :func:`step_features` returns them."""
_COLUMNS = (*FEATURES, "step_time_s")
_INTEGER_COLUMNS = frozenset({"prefill_tokens", "decode_seqs"})


class ProfileFormatError(PhaseschedError, ValueError):
    """A profile table that cannot be read or does not form a grid.

    Attributes:
        line: The 1-based line of the CSV file at fault, or ``None`` when the table as a whole is.

    """

    def __init__(self, message: str, line: int | None = None) -> None:
        super().__init__(message if line is None else f"line {line}: {message}")
        self.line = line


def _finite_non_negative(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        msg = f"{attribute.name} must be a finite non-negative number, got {value}"
        raise InvalidArgumentError(msg)


@attrs.frozen
class ProfilePoint:
    """One grid point: a step's four features and its measured duration (see the module docstring).

    >>> ProfilePoint(prefill_tokens=512, prefill_prefix=0, decode_seqs=8, decode_context=1024, step_time_s=0.02)
    ProfilePoint(prefill_tokens=512, prefill_prefix=0.0, decode_seqs=8, decode_context=1024.0, step_time_s=0.02)

    """

    prefill_tokens: int = attrs.field(validator=typed(attrs.validators.ge(0)))
    prefill_prefix: float = attrs.field(converter=to_float, validator=_finite_non_negative)
    decode_seqs: int = attrs.field(validator=typed(attrs.validators.ge(0)))
    decode_context: float = attrs.field(converter=to_float, validator=_finite_non_negative)
    step_time_s: float = attrs.field(converter=to_float, validator=_finite_non_negative)

    @property
    def features(self) -> tuple[float, float, float, float]:
        """The four features, in :data:`FEATURES` order."""
        return (float(self.prefill_tokens), self.prefill_prefix, float(self.decode_seqs), self.decode_context)


def _text(path: Path) -> str:
    """The file's text; a file that is not UTF-8 (a binary, a spreadsheet) is a :class:`ProfileFormatError`."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        byte = error.object[error.start]
        msg = f"{path}: not a text profile CSV: byte {byte:#04x} at offset {error.start} is not UTF-8"
        raise ProfileFormatError(msg) from None


def _format(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def write_profile_csv(
    path: str | os.PathLike[str], points: Sequence[ProfilePoint], metadata: Mapping[str, str] | None = None
) -> None:
    """Write ``points`` (and ``# key: value`` metadata lines) in the documented schema.

    Raises:
        InvalidArgumentError: A metadata key or value would not read back (a newline, or a ``:`` in a key).

    """
    lines = []
    for key, value in (metadata or {}).items():
        if ":" in key or "\n" in key or "\n" in str(value) or key != key.strip() or not key:
            msg = f"metadata {key!r}: {value!r} cannot be written as a '# key: value' line"
            raise InvalidArgumentError(msg)
        lines.append(f"# {key}: {value}\n")
    lines.append(",".join(_COLUMNS) + "\n")
    lines.extend(",".join(_format(v) for v in (*p.features, p.step_time_s)) + "\n" for p in points)
    Path(path).write_text("".join(lines), encoding="utf-8")


def read_profile_csv(path: str | os.PathLike[str]) -> tuple[list[ProfilePoint], dict[str, str]]:
    """Read a profile written in the documented schema.

    Returns:
        The points, in file order, and the metadata.

    Raises:
        ProfileFormatError: A file that is not UTF-8 text, a missing header or column, a
            malformed row (its line is named), or a metadata line below the header.

    """
    metadata: dict[str, str] = {}
    columns: dict[str, int] | None = None
    points: list[ProfilePoint] = []
    for number, line in enumerate(_text(Path(path)).splitlines(), start=1):
        if not line.strip():
            continue
        if line.startswith("#"):
            if columns is not None:
                raise ProfileFormatError("'#' lines are only allowed above the header", number)
            key, sep, value = line[1:].partition(":")
            if sep:
                metadata[key.strip()] = value.strip()
            continue
        fields = [field.strip() for field in next(csv.reader(io.StringIO(line)))]
        if columns is None:
            columns = _header(fields, number)
        else:
            points.append(_row(fields, columns, number))
    if columns is None:
        raise ProfileFormatError("no header line: expected columns " + ", ".join(_COLUMNS))
    return points, metadata


def _header(fields: list[str], number: int) -> dict[str, int]:
    missing = [name for name in _COLUMNS if name not in fields]
    if missing:
        msg = f"header lacks column(s) {', '.join(missing)}"
        raise ProfileFormatError(msg, number)
    return {name: fields.index(name) for name in _COLUMNS}


def _row(fields: list[str], columns: Mapping[str, int], number: int) -> ProfilePoint:
    if len(fields) <= max(columns.values()):
        msg = f"expected at least {max(columns.values()) + 1} fields, got {len(fields)}"
        raise ProfileFormatError(msg, number)

    def number_in(name: str) -> float:
        text = fields[columns[name]]
        try:
            return float(int(text)) if name in _INTEGER_COLUMNS else float(text)
        except ValueError:
            kind = "an integer" if name in _INTEGER_COLUMNS else "a number"
            msg = f"{name} must be {kind}, got {text!r}"
            raise ProfileFormatError(msg, number) from None

    values = {name: number_in(name) for name in _COLUMNS}
    try:
        return ProfilePoint(
            prefill_tokens=int(values["prefill_tokens"]),
            prefill_prefix=values["prefill_prefix"],
            decode_seqs=int(values["decode_seqs"]),
            decode_context=values["decode_context"],
            step_time_s=values["step_time_s"],
        )
    except ValueError as error:
        raise ProfileFormatError(str(error), number) from None


def step_features(
    num_new: NDArray[np.integer], kv_len: NDArray[np.integer], decode_batching: DecodeBatching = RAGGED
) -> Float64Array:
    """A step's four features, as the profiler would have built that step.

    Slices with ``num_new == 1`` are decodes; the rest are prefill slices.

    Args:
        num_new: int ``[B]``: tokens each slice computes (``>= 1``).
        kv_len: int ``[B]``: each slice's context after the step (``>= num_new``).
        decode_batching: How the profiled executor batches decodes; the default (ragged) reads
            them at their mean context.

    Returns:
        float64 ``[4]``: ``prefill_tokens``, ``prefill_prefix`` (token-weighted mean of the
        prefill slices' cached tokens), ``decode_seqs`` and ``decode_context`` as
        :meth:`DecodeBatching.decode_features` gives them (ragged: the count and the mean KV length).

    Raises:
        InvalidArgumentError: The arrays do not describe a step (see the ``CostModel`` Protocol).

    >>> step_features(np.array([1, 1, 100, 300]), np.array([10, 20, 100, 700])).tolist()
    [400.0, 300.0, 2.0, 15.0]
    >>> step_features(np.array([1, 1, 100, 300]), np.array([10, 20, 100, 700]), DecodeBatching.longest()).tolist()
    [400.0, 300.0, 2.0, 20.0]

    """
    new, ctx = check_batch(num_new, kv_len)
    tokens = int(new.sum())
    decode = new == 1
    decodes = int(np.count_nonzero(decode))
    decode_context = int(ctx @ decode)
    prefill_tokens = tokens - decodes
    # sum over prefill slices of n * (L - n): over all slices, less the decodes' 1 * (L - 1).
    weighted_prefix = int(new @ (ctx - new)) - (decode_context - decodes)
    if decode_batching.is_ragged:
        # Integer sums divided once, as decode_step_times does, so both round identically.
        seqs, context = decodes, float(decode_context) / decodes if decodes else 0.0
    else:
        seqs, context = decode_batching.decode_features(ctx[decode], decode_only=prefill_tokens == 0)
    return np.array(
        [prefill_tokens, weighted_prefix / prefill_tokens if prefill_tokens else 0.0, seqs, context],
        dtype=np.float64,
    )


def _point_tuple(points: Iterable[ProfilePoint]) -> tuple[ProfilePoint, ...]:
    return tuple(points)


def _grid_values(points: Sequence[ProfilePoint]) -> tuple[tuple[Float64Array, ...], Float64Array]:
    """The axes and the value array of ``points``, which must be a full grid."""
    if not points:
        raise ProfileFormatError("a profile needs at least one point")
    features = np.array([p.features for p in points], dtype=np.float64)
    axes = tuple(np.unique(features[:, dim]) for dim in range(len(FEATURES)))
    shape = tuple(len(axis) for axis in axes)
    index = tuple(np.searchsorted(axis, features[:, dim]) for dim, axis in enumerate(axes))
    flat = np.ravel_multi_index(index, shape)
    counts = np.bincount(flat, minlength=int(np.prod(shape)))
    if np.any(counts > 1):
        twice = points[int(np.flatnonzero(counts[flat] > 1)[0])]
        msg = f"two points share the features {dict(zip(FEATURES, twice.features, strict=True))}"
        raise ProfileFormatError(msg)
    if np.any(counts == 0):
        hole = np.unravel_index(int(np.flatnonzero(counts == 0)[0]), shape)
        missing = {name: float(axis[i]) for name, axis, i in zip(FEATURES, axes, hole, strict=True)}
        msg = (
            f"the points do not form a full grid ({int(np.count_nonzero(counts == 0))} of "
            f"{counts.size} combinations missing), e.g. {missing}"
        )
        raise ProfileFormatError(msg)
    values = np.empty(counts.size, dtype=np.float64)
    values[flat] = [p.step_time_s for p in points]
    return axes, values.reshape(shape)


@attrs.frozen(eq=False)
class ProfiledCostModel:
    """Step time interpolated from a measured grid (see the module docstring for the schema).

    Between grid points the time is multilinear in the four features; beyond the grid it
    continues linearly along each axis with the edge cell's slope (clamped at >= 0), so a
    step longer than any profiled one is still priced sensibly. With ``monotone`` (the
    default) every value is first raised to the largest measured at or below it along each
    axis: measurement noise can make a bigger step look faster, and the chunk sizer's binary
    search needs the :class:`~phasesched.costmodel.protocol.CostModel` contract. On data that
    are already monotone no measured value changes; only where the extrapolations along two
    axes disagree (beyond a corner of the grid) are the extrapolated values adjusted.

    Monotone in each feature means: adding context to any slice, or tokens to a step's only
    prefill slice, never shortens the step. Changes that lower a *mean* feature (adding a
    decode whose context is below the others') follow the table and may.

    A step's decodes are read as the profiled executor batches them (``decode_batching``): at
    their mean context for a ragged kernel, at the longest for one that pads, at the mean
    padded context for one that pads buckets of similar contexts.

    Attributes:
        points: The grid points.
        monotone: Enforce monotonicity as described above.
        step_overhead_s: Seconds added to every non-empty step for what the profile did not
            time: the engine's own work between executor calls (scheduling, result handling).
        decode_batching: How the profiled executor batches decodes (see
            :mod:`phasesched.costmodel.batching`); the default reads decodes at their mean context.

    >>> grid = [ProfilePoint(p, 0, d, 100, 0.001 + 1e-5 * p + 1e-4 * d) for p in (0, 100) for d in (0, 10)]
    >>> model = ProfiledCostModel(grid)
    >>> round(model.step_time(np.array([50] + [1] * 5), np.array([50] + [100] * 5)), 6)
    0.002

    """

    points: tuple[ProfilePoint, ...] = attrs.field(converter=_point_tuple)
    monotone: bool = attrs.field(default=True, kw_only=True)
    step_overhead_s: float = attrs.field(default=0.0, kw_only=True, validator=typed(attrs.validators.ge(0.0)))
    decode_batching: DecodeBatching = attrs.field(
        default=RAGGED, kw_only=True, validator=typed(attrs.validators.instance_of(DecodeBatching))
    )
    _interpolate: GridInterpolator = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        axes, values = _grid_values(self.points)
        object.__setattr__(self, "_interpolate", GridInterpolator.build(axes, values, monotone=self.monotone))

    @classmethod
    def from_csv(
        cls, path: str | os.PathLike[str], *, monotone: bool = True, step_overhead_s: float = 0.0
    ) -> ProfiledCostModel:
        """Read a profile CSV (see :func:`read_profile_csv`) and build the model.

        The decode batching is the one the file's ``# decode_batching:`` line records; a file
        without one (written before executors declared it) is read at the mean decode context.

        Raises:
            ProfileFormatError: The file is malformed, its points are not a full grid, or its
                ``decode_batching`` line does not parse.

        """
        points, metadata = read_profile_csv(path)
        try:
            batching = decode_batching_from_metadata(metadata)
        except InvalidArgumentError as error:
            msg = f"{path}: {error}"
            raise ProfileFormatError(msg) from None
        return cls(points, monotone=monotone, step_overhead_s=step_overhead_s, decode_batching=batching or RAGGED)

    def interpolate(self, features: ArrayLike) -> Float64Array:
        """Step times at arbitrary feature vectors.

        Args:
            features: float ``[N, 4]`` (or ``[4]``), columns in :data:`FEATURES` order.

        Returns:
            float64 ``[N]`` (or ``[1]``): seconds.

        """
        points = np.atleast_2d(np.asarray(features, dtype=np.float64))
        if points.ndim != 2 or points.shape[1] != len(FEATURES):
            msg = f"features must have shape [N, {len(FEATURES)}], got {points.shape}"
            raise InvalidArgumentError(msg)
        return self._interpolate(points)

    def step_time(self, num_new: NDArray[np.integer], kv_len: NDArray[np.integer]) -> float:
        """Seconds for one step: the table at the step's :func:`step_features` (0 when empty).

        Args:
            num_new: int ``[B]``: tokens each slice computes (``>= 1``).
            kv_len: int ``[B]``: each slice's context after the step (``>= num_new``).

        """
        features = self.step_features(num_new, kv_len)
        if features[0] == 0 and features[2] == 0:  # no slices: no step runs
            return 0.0
        return float(self._interpolate(features[None, :])[0]) + self.step_overhead_s

    def step_features(self, num_new: NDArray[np.integer], kv_len: NDArray[np.integer]) -> Float64Array:
        """The step's features as this model reads them: :func:`step_features` with its ``decode_batching``."""
        return step_features(num_new, kv_len, self.decode_batching)

    def decode_features(self, kv_len: NDArray[np.integer], num_steps: int) -> Float64Array:
        """float64 ``[num_steps, 4]``: the features of decode-only steps ``kv_len + j`` (``B > 0``)."""
        ctx = check_decodes(kv_len, num_steps)
        features = np.zeros((num_steps, len(FEATURES)), dtype=np.float64)
        features[:, 2], features[:, 3] = self.decode_batching.decode_run_features(ctx, num_steps)
        return features

    def decode_step_times(self, kv_len: NDArray[np.integer], num_steps: int) -> Float64Array:
        """Durations of ``num_steps`` pure-decode steps (contexts ``kv_len + j``), vectorized.

        Args:
            kv_len: int ``[B]``: contexts after the first step.
            num_steps: Steps to price.

        Returns:
            float64 ``[num_steps]``: equal to ``step_time(ones(B), kv_len + j)``.

        """
        ctx = check_decodes(kv_len, num_steps)
        if len(ctx) == 0:
            return np.zeros(num_steps, dtype=np.float64)
        times: Float64Array = self._interpolate(self.decode_features(ctx, num_steps)) + self.step_overhead_s
        return times
