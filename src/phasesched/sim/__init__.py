"""Simulation: workloads, trace replay and (soon) a discrete-event simulator to run them through."""

from __future__ import annotations

# --- workloads and traces (phasesched.sim.workload, phasesched.sim.traces) -------------------
from phasesched.sim.traces import LengthStats as LengthStats
from phasesched.sim.traces import TraceFormat as TraceFormat
from phasesched.sim.traces import TraceFormatError as TraceFormatError
from phasesched.sim.traces import TraceStats as TraceStats
from phasesched.sim.traces import load_trace as load_trace
from phasesched.sim.traces import trace_stats as trace_stats
from phasesched.sim.traces import write_trace as write_trace
from phasesched.sim.workload import ArrivalProcess as ArrivalProcess
from phasesched.sim.workload import Burst as Burst
from phasesched.sim.workload import ClosedLoop as ClosedLoop
from phasesched.sim.workload import Empirical as Empirical
from phasesched.sim.workload import Fixed as Fixed
from phasesched.sim.workload import Gamma as Gamma
from phasesched.sim.workload import GridPoint as GridPoint
from phasesched.sim.workload import LengthDist as LengthDist
from phasesched.sim.workload import LogNormal as LogNormal
from phasesched.sim.workload import Periodic as Periodic
from phasesched.sim.workload import Poisson as Poisson
from phasesched.sim.workload import Uniform as Uniform
from phasesched.sim.workload import Workload as Workload
from phasesched.sim.workload import fixed as fixed
from phasesched.sim.workload import grid_points as grid_points
from phasesched.sim.workload import mixed_load as mixed_load
from phasesched.sim.workload import synthetic as synthetic

# --- end of workloads and traces -------------------------------------------------------------

__all__ = [
    # --- workloads and traces ---
    "ArrivalProcess",
    "Burst",
    "ClosedLoop",
    "Empirical",
    "Fixed",
    "Gamma",
    "GridPoint",
    "LengthDist",
    "LengthStats",
    "LogNormal",
    "Periodic",
    "Poisson",
    "TraceFormat",
    "TraceFormatError",
    "TraceStats",
    "Uniform",
    "Workload",
    "fixed",
    "grid_points",
    "load_trace",
    "mixed_load",
    "synthetic",
    "trace_stats",
    "write_trace",
    # --- end of workloads and traces ---
]
