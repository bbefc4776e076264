"""Seed streams: how one seed becomes the independent generators a workload is drawn from.

The open-loop builders (:mod:`~phasesched.sim.builders`) and the closed-loop spec
(:mod:`~phasesched.sim.closed_loop`) both draw through here, which is what keeps the promise
:mod:`~phasesched.sim.builders` documents: a seed spawns independent arrival, prompt and output
streams, so workloads that share a seed and length distributions share their lengths.
"""

from __future__ import annotations

import operator

import numpy as np
from numpy.typing import NDArray

from phasesched.errors import InvalidArgumentError, InvalidTypeError
from phasesched.sim.lengths import Fixed, LengthDist

__all__ = ["as_dist", "seed_streams", "seeded_lengths"]

IntArray = NDArray[np.int64]


def as_dist(value: int | LengthDist) -> LengthDist:
    """``Fixed(value)`` for an integer; a length distribution as it is."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return Fixed(int(value))
    if not isinstance(value, LengthDist):
        msg = f"expected a length (int) or a LengthDist, got {type(value).__name__}"
        raise InvalidTypeError(msg)
    return value


def seed_streams(seed: int) -> tuple[np.random.Generator, np.random.Generator, np.random.Generator]:
    """Independent generators for arrivals, prompt lengths and output lengths."""
    if operator.index(seed) < 0:
        msg = f"seed must be a non-negative integer, got {seed}"
        raise InvalidArgumentError(msg)
    arrivals, prompts, outputs = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(3))
    return arrivals, prompts, outputs


def seeded_lengths(prompt: int | LengthDist, output: int | LengthDist, n: int, seed: int) -> tuple[IntArray, IntArray]:
    """``n`` prompt and ``n`` output lengths, each int64 ``[n]``, from ``seed``'s length streams."""
    _, prompt_rng, output_rng = seed_streams(seed)
    return as_dist(prompt).sample(prompt_rng, n), as_dist(output).sample(output_rng, n)
