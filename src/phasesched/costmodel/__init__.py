"""Cost models: how long a step takes.

One Protocol (:class:`CostModel`) serves the simulator, the SLO-adaptive chunk sizer and the
benchmarks. Two implementations: :class:`RooflineCostModel` derives step times from FLOPs and
bytes with hardware and model presets, and :class:`ProfiledCostModel` interpolates a table that
:class:`Profiler` (:func:`profile_executor`) measured on a real executor, reading each step's
decodes as that executor batches them (:class:`DecodeBatching`).
"""

from __future__ import annotations

from phasesched.costmodel.batching import RAGGED as RAGGED
from phasesched.costmodel.batching import DeclaresDecodeBatching as DeclaresDecodeBatching
from phasesched.costmodel.batching import DecodeBatching as DecodeBatching
from phasesched.costmodel.coverage import GridCoverage as GridCoverage
from phasesched.costmodel.hardware import HARDWARE_PRESETS as HARDWARE_PRESETS
from phasesched.costmodel.hardware import Hardware as Hardware
from phasesched.costmodel.hardware import hardware_by_name as hardware_by_name
from phasesched.costmodel.models import MODEL_PRESETS as MODEL_PRESETS
from phasesched.costmodel.models import ModelSpec as ModelSpec
from phasesched.costmodel.models import model_by_name as model_by_name
from phasesched.costmodel.profiled import FEATURES as FEATURES
from phasesched.costmodel.profiled import ProfiledCostModel as ProfiledCostModel
from phasesched.costmodel.profiled import ProfileFormatError as ProfileFormatError
from phasesched.costmodel.profiled import ProfilePoint as ProfilePoint
from phasesched.costmodel.profiled import read_profile_csv as read_profile_csv
from phasesched.costmodel.profiled import step_features as step_features
from phasesched.costmodel.profiled import write_profile_csv as write_profile_csv
from phasesched.costmodel.profiling import ProfileGrid as ProfileGrid
from phasesched.costmodel.profiling import Profiler as Profiler
from phasesched.costmodel.profiling import ProfilingError as ProfilingError
from phasesched.costmodel.profiling import profile_executor as profile_executor
from phasesched.costmodel.protocol import CostModel as CostModel
from phasesched.costmodel.protocol import DecodeFastForward as DecodeFastForward
from phasesched.costmodel.protocol import decode_step_times as decode_step_times
from phasesched.costmodel.roofline import DEFAULT_STEP_OVERHEAD_S as DEFAULT_STEP_OVERHEAD_S
from phasesched.costmodel.roofline import RooflineCostModel as RooflineCostModel
from phasesched.costmodel.roofline import StepBreakdown as StepBreakdown
from phasesched.costmodel.roofline import causal_pairs as causal_pairs

__all__ = [
    "DEFAULT_STEP_OVERHEAD_S",
    "FEATURES",
    "HARDWARE_PRESETS",
    "MODEL_PRESETS",
    "RAGGED",
    "CostModel",
    "DeclaresDecodeBatching",
    "DecodeBatching",
    "DecodeFastForward",
    "GridCoverage",
    "Hardware",
    "ModelSpec",
    "ProfileFormatError",
    "ProfileGrid",
    "ProfilePoint",
    "ProfiledCostModel",
    "Profiler",
    "ProfilingError",
    "RooflineCostModel",
    "StepBreakdown",
    "causal_pairs",
    "decode_step_times",
    "hardware_by_name",
    "model_by_name",
    "profile_executor",
    "read_profile_csv",
    "step_features",
    "write_profile_csv",
]
