"""Workloads: what arrives when, with how many prompt tokens, asking for how many output tokens.

A :class:`Workload` is a value: three aligned read-only arrays (arrival time, prompt length,
output length) plus a name. It is cheap to keep 100,000 rows in one (about 2.4 MB), and
:meth:`Workload.requests` turns rows into :class:`~phasesched.Request` objects one at a time, so a
simulator never holds more requests than it has admitted.

This module holds only the value and its transformations. Workloads come from
:mod:`~phasesched.sim.builders` (synthetic ones, drawn from the strategies in
:mod:`~phasesched.sim.lengths` and :mod:`~phasesched.sim.arrivals`) or from
:mod:`~phasesched.sim.traces` (real ones, read from a file).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterator

import attrs
import numpy as np
from numpy.typing import ArrayLike, NDArray

from phasesched.errors import InvalidArgumentError
from phasesched.request import Request, SamplingParams
from phasesched.sim._checks import check_positive_finite, int_column, positive_int, time_column
from phasesched.sim.block_hashes import BlockHashes
from phasesched.validators import typed

__all__ = ["Workload"]

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]

# Requests built by Workload.requests() share one (frozen) SamplingParams instead of one each.
_GREEDY = SamplingParams()
# Rows converted to Python scalars at a time by Workload.requests(): bounds its memory.
_CHUNK = 1024


def _as_array(values: ArrayLike) -> NDArray[np.generic]:
    return np.asarray(values)


def _as_optional_array(values: ArrayLike | None) -> NDArray[np.generic] | None:
    return None if values is None else np.asarray(values)


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
        blocks: Each prompt's block hashes (a Mooncake trace's ``hash_ids``), or ``None``:
            with them, requests carry :class:`~phasesched.prefix.PromptBlocks` and a policy with
            prefix caching replays the trace's cache hits.

    Raises:
        InvalidArgumentError: if the arrays disagree in length, are out of order, or hold a length below 1.

    >>> w = Workload("tiny", arrival_s=[0.0, 0.5, 1.0], prompt_len=[8, 16, 4], output_len=[2, 2, 1])
    >>> len(w), w.duration_s, w.rate
    (3, 1.0, 2.0)
    >>> next(w.requests()).max_new_tokens
    2

    """

    name: str = attrs.field(validator=typed(attrs.validators.instance_of(str)))
    arrival_s: FloatArray = attrs.field(converter=_as_array)
    prompt_len: IntArray = attrs.field(converter=_as_array)
    output_len: IntArray = attrs.field(converter=_as_array)
    priority: IntArray | None = attrs.field(default=None, converter=_as_optional_array)
    blocks: BlockHashes | None = None

    def __attrs_post_init__(self) -> None:
        times = time_column(self.arrival_s)
        n = times.shape[0]
        object.__setattr__(self, "arrival_s", times)
        object.__setattr__(self, "prompt_len", int_column(self.prompt_len, "prompt_len", n, positive=True))
        object.__setattr__(self, "output_len", int_column(self.output_len, "output_len", n, positive=True))
        if self.priority is not None:
            object.__setattr__(self, "priority", int_column(self.priority, "priority", n, positive=False))
        if self.blocks is not None and len(self.blocks) != n:
            msg = f"blocks has {len(self.blocks)} rows for {n} requests"
            raise InvalidArgumentError(msg)

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
        check_positive_finite("factor", factor)
        return attrs.evolve(self, arrival_s=self.arrival_s * factor)

    def scaled_to_rate(self, requests_per_s: float) -> Workload:
        """The same requests replayed at a mean rate of ``requests_per_s`` (gaps rescaled uniformly).

        Burstiness (the inter-arrival CV) is scale-free, so it is kept; only the clock changes.

        Raises:
            InvalidArgumentError: if the target is not positive, or the workload has no rate to rescale
                (fewer than two requests, or all of them at one instant).

        """
        check_positive_finite("requests_per_s", requests_per_s)
        if not (math.isfinite(self.rate) and self.rate > 0):
            msg = f"workload {self.name!r} has rate {self.rate}; it cannot be rescaled to a rate"
            raise InvalidArgumentError(msg)
        return self.time_scaled(self.rate / requests_per_s)

    def head(self, n: int) -> Workload:
        """The first ``n`` requests (all of them if there are fewer)."""
        if operator.index(n) < 0:
            msg = f"head() needs n >= 0, got {n}"
            raise InvalidArgumentError(msg)
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
            raise InvalidArgumentError(msg)
        lo, hi = np.searchsorted(self.arrival_s, [t0, t1], side="left")
        part = self._rows(slice(int(lo), int(hi)))
        return attrs.evolve(part, arrival_s=part.arrival_s - t0)  # >= 0: a >= t0 implies fl(a - t0) >= 0

    def clip_lengths(self, max_prompt: int | None = None, max_output: int | None = None) -> Workload:
        """Lengths capped at ``max_prompt`` / ``max_output`` (for a model's context limit); no row is dropped."""
        prompt, output = self.prompt_len, self.output_len
        if max_prompt is not None:
            prompt = np.minimum(prompt, positive_int("max_prompt", max_prompt))
        if max_output is not None:
            output = np.minimum(output, positive_int("max_output", max_output))
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
                    prompt_blocks=None if self.blocks is None else self.blocks.row(i),
                )

    def _rows(self, rows: slice) -> Workload:
        priority = None if self.priority is None else self.priority[rows]
        blocks = None if self.blocks is None else self.blocks.take(rows)
        return Workload(self.name, self.arrival_s[rows], self.prompt_len[rows], self.output_len[rows], priority, blocks)
