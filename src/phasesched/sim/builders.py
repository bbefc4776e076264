"""Workload builders: open-loop workloads made from a length distribution, an arrival process and a seed.

:func:`synthetic` is the general builder; :func:`fixed` (identical requests, no randomness) and
:func:`mixed_load` (short requests decoding when one long prompt arrives) build the workloads the
curve and interference experiments need. Each returns a
:class:`~phasesched.sim.workload.Workload`, the same for the same arguments and seed.

Every random draw comes from a generator seeded explicitly. Arrivals, prompt lengths and output
lengths use three independent streams spawned from one :class:`numpy.random.SeedSequence`, so two
workloads that share a seed and length distributions get identical lengths whatever their arrival
processes (and so does a :class:`~phasesched.sim.closed_loop.ClosedLoop` with the same seed):
comparisons are paired.
"""

from __future__ import annotations

import math

import numpy as np

from phasesched.errors import InvalidArgumentError
from phasesched.sim._checks import positive_int, sample_count
from phasesched.sim._streams import seed_streams, seeded_lengths
from phasesched.sim.arrivals import ArrivalProcess, Burst, Periodic
from phasesched.sim.lengths import Fixed, LengthDist
from phasesched.sim.workload import Workload

__all__ = ["fixed", "mixed_load", "synthetic"]


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
        prompt: Prompt lengths (an ``int`` means :class:`~phasesched.sim.lengths.Fixed`).
        output: Output lengths (an ``int`` means :class:`~phasesched.sim.lengths.Fixed`).
        seed: Seeds three independent streams (arrivals, prompts, outputs), so changing only the
            arrival process keeps every length.
        name: Label; by default built from ``n`` and ``seed``.

    Returns:
        The workload.

    >>> from phasesched.sim import LogNormal, Poisson, Uniform
    >>> w = synthetic(100, Poisson(10.0), LogNormal(512, 1.0), Uniform(16, 64), seed=1)
    >>> len(w), float(w.arrival_s[0]), bool(w.output_len.max() <= 64)
    (100, 0.0, True)

    """
    n = sample_count(n)
    arrival_rng, _, _ = seed_streams(seed)
    prompt_len, output_len = seeded_lengths(prompt, output, n, seed)
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
    :meth:`Workload.requests <phasesched.sim.workload.Workload.requests>` is
    ``f"{prefix}{num_short}"``. (Rows are ordered by time, and the long one comes after any short
    one that arrives at the same instant.)

    Args:
        num_short: Short requests (0 measures the long prompt alone, the baseline).
        short_prompt: Their prompt lengths (an ``int`` means :class:`~phasesched.sim.lengths.Fixed`).
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
        raise InvalidArgumentError(msg)
    num_short = sample_count(num_short)
    prompts, outputs = seeded_lengths(short_prompt, short_output, num_short, seed)
    return Workload(
        name,
        arrival_s=np.append(np.zeros(num_short), long_arrival_s),
        prompt_len=np.append(prompts, positive_int("long_prompt", long_prompt)),
        output_len=np.append(outputs, positive_int("long_output", long_output)),
    )
