"""Closed-loop benchmarks: a fixed number of clients, each sending its next request when one finishes.

A :class:`ClosedLoop` fixes *what* is sent, in order; the simulator owns the clock and decides
*when*. :class:`GridPoint` and :func:`grid_points` describe the seed benchmark grid, whose cells
are closed-loop runs at fixed lengths. Lengths are drawn exactly as
:func:`~phasesched.sim.builders.synthetic` draws them, so an open-loop and a closed-loop run
with the same seed send the same requests.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence

import attrs
import numpy as np
from numpy.typing import NDArray

from phasesched.sim._checks import positive_int_field
from phasesched.sim._streams import as_dist, seeded_lengths
from phasesched.sim.lengths import Fixed, LengthDist
from phasesched.sim.workload import Workload
from phasesched.validators import to_float, to_int, typed

__all__ = ["ClosedLoop", "GridPoint", "grid_points"]

IntArray = NDArray[np.int64]


@attrs.frozen
class ClosedLoop:
    """A closed-loop benchmark: ``concurrency`` clients, each sending its next request when one finishes.

    The simulator owns the clock: it issues the first ``concurrency`` requests at time 0 and
    then one more each time a request finishes (after ``think_time_s``), until
    ``num_requests`` have been issued. This spec only fixes *what* is sent, in order.

    Attributes:
        concurrency: Requests in flight at once, ``>= 1``.
        num_requests: Requests in total, ``>= 1``.
        prompt: Prompt lengths (an ``int`` means :class:`~phasesched.sim.lengths.Fixed`).
        output: Output lengths.
        seed: Seeds the lengths exactly as :func:`~phasesched.sim.builders.synthetic` does.
        think_time_s: Pause between a request finishing and its client's next one.

    >>> from phasesched.sim import Uniform
    >>> p, o = ClosedLoop(8, 3, prompt=Uniform(10, 20), output=32).lengths()
    >>> p.shape, o.tolist()
    ((3,), [32, 32, 32])

    """

    concurrency: int = attrs.field(converter=to_int, validator=positive_int_field)
    num_requests: int = attrs.field(converter=to_int, validator=positive_int_field)
    prompt: LengthDist = attrs.field(converter=as_dist)
    output: LengthDist = attrs.field(converter=as_dist)
    seed: int = attrs.field(default=0, converter=to_int, validator=typed(attrs.validators.ge(0)))
    think_time_s: float = attrs.field(
        default=0.0,
        converter=to_float,
        validator=typed(attrs.validators.ge(0.0), attrs.validators.lt(math.inf)),
    )

    def lengths(self) -> tuple[IntArray, IntArray]:
        """The lengths of requests ``0 .. num_requests - 1`` in issue order.

        Returns:
            ``(prompt_len, output_len)``, each int64 ``[num_requests]``; the same for the same seed.

        """
        return seeded_lengths(self.prompt, self.output, self.num_requests, self.seed)

    def as_workload(self, name: str = "closed-loop") -> Workload:
        """The requests as a workload whose arrival times are placeholders (all 0).

        Lets a simulator reuse :meth:`Workload.requests <phasesched.sim.workload.Workload.requests>`;
        it sets each request's real arrival time (for example with
        ``attrs.evolve(request, arrival_time=now)``) when it issues it.
        """
        prompt_len, output_len = self.lengths()
        return Workload(name, np.zeros(self.num_requests), prompt_len, output_len)


@attrs.frozen
class GridPoint:
    """One cell of the benchmark grid: fixed prompt and output lengths at a fixed concurrency."""

    prompt_len: int = attrs.field(converter=to_int, validator=positive_int_field)
    output_len: int = attrs.field(converter=to_int, validator=positive_int_field)
    concurrency: int = attrs.field(converter=to_int, validator=positive_int_field)

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
