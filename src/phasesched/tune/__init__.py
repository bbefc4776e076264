"""Tuning: which policy, which chunk, how many GPUs, aggregated or split, for a workload and an SLO.

``phasesched tune`` searches :class:`SearchSpace` (policy x chunk x token budget x every GPU
layout), finds each candidate's capacity by bisection on the request rate
(:func:`find_capacity`), ranks them by goodput per GPU and recommends one (:func:`run_tune`).
"""

from __future__ import annotations

from phasesched.tune.capacity import CapacityConfig as CapacityConfig
from phasesched.tune.capacity import Probe as Probe
from phasesched.tune.capacity import find_capacity as find_capacity
from phasesched.tune.search import TuneResult as TuneResult
from phasesched.tune.search import TuneRun as TuneRun
from phasesched.tune.search import pareto_front as pareto_front
from phasesched.tune.search import run_tune as run_tune
from phasesched.tune.space import Candidate as Candidate
from phasesched.tune.space import Layout as Layout
from phasesched.tune.space import SearchSpace as SearchSpace
from phasesched.tune.space import layouts as layouts

__all__ = [
    "Candidate",
    "CapacityConfig",
    "Layout",
    "Probe",
    "SearchSpace",
    "TuneResult",
    "TuneRun",
    "find_capacity",
    "layouts",
    "pareto_front",
    "run_tune",
]
