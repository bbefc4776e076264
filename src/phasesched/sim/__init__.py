"""Simulation: workloads, trace replay, and a discrete-event simulator that runs them through real schedulers."""

from __future__ import annotations

from phasesched.sim.arrivals import ArrivalProcess as ArrivalProcess
from phasesched.sim.arrivals import Burst as Burst
from phasesched.sim.arrivals import Gamma as Gamma
from phasesched.sim.arrivals import Periodic as Periodic
from phasesched.sim.arrivals import Poisson as Poisson
from phasesched.sim.block_hashes import BlockHashes as BlockHashes
from phasesched.sim.builders import fixed as fixed
from phasesched.sim.builders import mixed_load as mixed_load
from phasesched.sim.builders import synthetic as synthetic
from phasesched.sim.closed_loop import ClosedLoop as ClosedLoop
from phasesched.sim.closed_loop import GridPoint as GridPoint
from phasesched.sim.closed_loop import grid_points as grid_points
from phasesched.sim.deployment import Deployment as Deployment
from phasesched.sim.deployment import Disaggregation as Disaggregation
from phasesched.sim.executor import SimulatedExecutor as SimulatedExecutor
from phasesched.sim.guards import SimulationError as SimulationError
from phasesched.sim.lengths import Empirical as Empirical
from phasesched.sim.lengths import Fixed as Fixed
from phasesched.sim.lengths import LengthDist as LengthDist
from phasesched.sim.lengths import LogNormal as LogNormal
from phasesched.sim.lengths import Uniform as Uniform
from phasesched.sim.link import KVLink as KVLink
from phasesched.sim.shared_prefix import SharedPrefixes as SharedPrefixes
from phasesched.sim.shared_prefix import shared_prefix as shared_prefix
from phasesched.sim.simulator import SimResult as SimResult
from phasesched.sim.simulator import Simulator as Simulator
from phasesched.sim.simulator import WorkerStats as WorkerStats
from phasesched.sim.simulator import simulate as simulate
from phasesched.sim.trace_format import TraceFormat as TraceFormat
from phasesched.sim.trace_format import TraceFormatError as TraceFormatError
from phasesched.sim.trace_stats import LengthStats as LengthStats
from phasesched.sim.trace_stats import TraceStats as TraceStats
from phasesched.sim.trace_stats import trace_stats as trace_stats
from phasesched.sim.traces import load_trace as load_trace
from phasesched.sim.traces import write_trace as write_trace
from phasesched.sim.workload import Workload as Workload

__all__ = [
    "ArrivalProcess",
    "BlockHashes",
    "Burst",
    "ClosedLoop",
    "Deployment",
    "Disaggregation",
    "Empirical",
    "Fixed",
    "Gamma",
    "GridPoint",
    "KVLink",
    "LengthDist",
    "LengthStats",
    "LogNormal",
    "Periodic",
    "Poisson",
    "SharedPrefixes",
    "SimResult",
    "SimulatedExecutor",
    "SimulationError",
    "Simulator",
    "TraceFormat",
    "TraceFormatError",
    "TraceStats",
    "Uniform",
    "WorkerStats",
    "Workload",
    "fixed",
    "grid_points",
    "load_trace",
    "mixed_load",
    "shared_prefix",
    "simulate",
    "synthetic",
    "trace_stats",
    "write_trace",
]
