"""Measurement: per-request timelines and latency budgets, streaming distributions, run summaries.

The same code measures simulations and real runs: feed a
:class:`~phasesched.metrics.recorder.WorkerRecorder` each step's plan, outcome and times.
"""

from __future__ import annotations

from phasesched.metrics.distribution import Distribution as Distribution
from phasesched.metrics.recorder import BUDGET_PHASES as BUDGET_PHASES
from phasesched.metrics.recorder import GapLog as GapLog
from phasesched.metrics.recorder import LatencyBudget as LatencyBudget
from phasesched.metrics.recorder import MetricsRecorder as MetricsRecorder
from phasesched.metrics.recorder import RequestRecord as RequestRecord
from phasesched.metrics.recorder import Role as Role
from phasesched.metrics.recorder import RunCounters as RunCounters
from phasesched.metrics.recorder import WorkerRecorder as WorkerRecorder
from phasesched.metrics.summary import PERCENTILES as PERCENTILES
from phasesched.metrics.summary import RunMetrics as RunMetrics
from phasesched.metrics.summary import summarize as summarize

__all__ = [
    "BUDGET_PHASES",
    "PERCENTILES",
    "Distribution",
    "GapLog",
    "LatencyBudget",
    "MetricsRecorder",
    "RequestRecord",
    "Role",
    "RunCounters",
    "RunMetrics",
    "WorkerRecorder",
    "summarize",
]
