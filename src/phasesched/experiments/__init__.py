"""Experiments: the seed measurements of prefill/decode scheduling, each a function returning a frozen result.

========================  ================================================================
``run_prefill_curve``     TTFT and prefill tokens/s vs prompt length (a batch per length)
``run_decode_curve``      inter-token latency vs sequences decoding together
``run_mixed_load``        token gaps while a long prompt prefills, per way of scheduling it
``run_phase_split``       disaggregated P:D ratios vs aggregated replicas on the same GPUs
``run_grid``              prompt x output x concurrency, closed loop
``run_replay``            a trace through several policies
========================  ================================================================

Each takes an :class:`ExperimentContext` (deployment, policy names, seed, progress) and an
optional config of sizes whose defaults are the seed suite that ``phasesched bench`` runs, and
whose ``quick()`` is a tiny version for tests. Each function's docstring says what it holds
constant and why.
"""

from __future__ import annotations

from phasesched.experiments.context import Column as Column
from phasesched.experiments.context import ExperimentContext as ExperimentContext
from phasesched.experiments.context import ExperimentResult as ExperimentResult
from phasesched.experiments.context import ProgressHook as ProgressHook
from phasesched.experiments.context import Row as Row
from phasesched.experiments.decode_curve import DecodeCurveConfig as DecodeCurveConfig
from phasesched.experiments.decode_curve import DecodeCurveResult as DecodeCurveResult
from phasesched.experiments.decode_curve import run_decode_curve as run_decode_curve
from phasesched.experiments.grid import GridConfig as GridConfig
from phasesched.experiments.grid import GridResult as GridResult
from phasesched.experiments.grid import run_grid as run_grid
from phasesched.experiments.mixed_load import MixedLoadConfig as MixedLoadConfig
from phasesched.experiments.mixed_load import MixedLoadResult as MixedLoadResult
from phasesched.experiments.mixed_load import Verdict as Verdict
from phasesched.experiments.mixed_load import run_mixed_load as run_mixed_load
from phasesched.experiments.mixed_load import verdict as verdict
from phasesched.experiments.phase_split import PhaseSplitConfig as PhaseSplitConfig
from phasesched.experiments.phase_split import PhaseSplitResult as PhaseSplitResult
from phasesched.experiments.phase_split import run_phase_split as run_phase_split
from phasesched.experiments.prefill_curve import PrefillCurveConfig as PrefillCurveConfig
from phasesched.experiments.prefill_curve import PrefillCurveResult as PrefillCurveResult
from phasesched.experiments.prefill_curve import run_prefill_curve as run_prefill_curve
from phasesched.experiments.replay import ReplayConfig as ReplayConfig
from phasesched.experiments.replay import ReplayResult as ReplayResult
from phasesched.experiments.replay import run_replay as run_replay

__all__ = [
    "Column",
    "DecodeCurveConfig",
    "DecodeCurveResult",
    "ExperimentContext",
    "ExperimentResult",
    "GridConfig",
    "GridResult",
    "MixedLoadConfig",
    "MixedLoadResult",
    "PhaseSplitConfig",
    "PhaseSplitResult",
    "PrefillCurveConfig",
    "PrefillCurveResult",
    "ProgressHook",
    "ReplayConfig",
    "ReplayResult",
    "Row",
    "Verdict",
    "run_decode_curve",
    "run_grid",
    "run_mixed_load",
    "run_phase_split",
    "run_prefill_curve",
    "run_replay",
    "verdict",
]
