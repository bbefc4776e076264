"""Bad arguments to the simulator, cost models and experiments raise PhaseschedErrors of their old builtin kind."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from phasesched import PhaseschedError, load_policy
from phasesched.costmodel import RooflineCostModel
from phasesched.costmodel.profiled import ProfilePoint
from phasesched.costmodel.protocol import decode_step_times
from phasesched.errors import InvalidArgumentError, InvalidTypeError
from phasesched.experiments import ExperimentContext, PhaseSplitConfig, ReplayConfig, run_replay
from phasesched.experiments.suite import SuiteOptions, suite_names
from phasesched.sim import (
    ClosedLoop,
    Deployment,
    Disaggregation,
    Fixed,
    KVLink,
    LogNormal,
    Poisson,
    Uniform,
    Workload,
    fixed,
    load_trace,
    simulate,
    trace_stats,
)

EMPTY = Workload("none", [], [], [])

VALUE_ERRORS: dict[str, Callable[[], object]] = {
    "replicas=0": lambda: simulate(fixed(2, 16, 2), load_policy("vllm"), replicas=0),
    "max_decode_run=0": lambda: simulate(fixed(2, 16, 2), load_policy("vllm"), max_decode_run=0),
    "stop_after_missed=-1": lambda: simulate(fixed(2, 16, 2), load_policy("vllm"), stop_after_missed=-1),
    "Deployment(tensor_parallel=0)": lambda: Deployment(tensor_parallel=0),
    "Deployment(gpu_memory_utilization=1.5)": lambda: Deployment(gpu_memory_utilization=1.5),
    "Disaggregation(decode_workers=0)": lambda: Disaggregation(decode_workers=0),
    "KVLink(0)": lambda: KVLink(0.0),
    "Uniform(5, 2)": lambda: Uniform(5, 2),
    "LogNormal(sigma=-1)": lambda: LogNormal(100, -1.0),
    "LogNormal('x')": lambda: LogNormal("x", 1.0),
    "Poisson(-1)": lambda: Poisson(-1.0),
    "ClosedLoop(think_time_s=-1)": lambda: ClosedLoop(1, 1, prompt=8, output=8, think_time_s=-1.0),
    "Workload(prompt 0)": lambda: Workload("w", [0.0], [0], [1]),
    "Workload.head(-1)": lambda: fixed(2, 8, 8).head(-1),
    "trace_stats(empty)": lambda: trace_stats(EMPTY),
    "load_trace(format='parquet')": lambda: load_trace("x.csv", format="parquet"),
    "ProfilePoint(step_time_s=-1)": lambda: ProfilePoint(1, 0, 0, 0, -1.0),
    "ProfilePoint(decode_seqs=-1)": lambda: ProfilePoint(1, 0, -1, 0, 1.0),
    "Roofline(step_overhead_s=-1)": lambda: RooflineCostModel.from_names(step_overhead_s=-1.0),
    "decode_step_times(num_steps=-1)": lambda: decode_step_times(RooflineCostModel.from_names(), np.array([8]), -1),
    "PhaseSplitConfig(rate=0)": lambda: PhaseSplitConfig(rate=0.0),
    "ReplayConfig(limit=0)": lambda: ReplayConfig(EMPTY, limit=0),
    "run_replay(empty)": lambda: run_replay(ExperimentContext(), ReplayConfig(EMPTY)),
    "suite_names('nope')": lambda: suite_names("nope", SuiteOptions()),
    "ExperimentContext(seed=-1)": lambda: ExperimentContext(seed=-1),
}

TYPE_ERRORS: dict[str, Callable[[], object]] = {
    "Fixed(2.5)": lambda: Fixed(2.5),
    "Uniform(1, '9')": lambda: Uniform(1, "9"),
    "ClosedLoop(prompt='x')": lambda: ClosedLoop(1, 1, prompt="x", output=8),  # type: ignore[arg-type]
    "Workload(name=3)": lambda: Workload(3, [0.0], [1], [1]),  # type: ignore[arg-type]
    "simulate(replicas=1.5)": lambda: simulate(fixed(1, 8, 1), load_policy("vllm"), replicas=1.5),
    "simulate(stop_after_missed=0.5)": lambda: simulate(fixed(1, 8, 1), load_policy("vllm"), stop_after_missed=0.5),
}


class TestOneErrorFamily:
    """Every bad argument a caller can give these modules is a PhaseschedError with a message naming it."""

    @pytest.mark.parametrize("case", list(VALUE_ERRORS))
    def test_bad_values(self, case: str) -> None:
        """A value out of range is an InvalidArgumentError, which is still a ValueError."""
        with pytest.raises(InvalidArgumentError) as caught:
            VALUE_ERRORS[case]()
        assert isinstance(caught.value, PhaseschedError)
        assert isinstance(caught.value, ValueError)
        assert str(caught.value)

    @pytest.mark.parametrize("case", list(TYPE_ERRORS))
    def test_bad_types(self, case: str) -> None:
        """A value of the wrong type is an InvalidTypeError: a PhaseschedError and still a TypeError."""
        with pytest.raises(InvalidTypeError) as caught:
            TYPE_ERRORS[case]()
        assert isinstance(caught.value, TypeError)

    def test_zero_replicas_says_so(self) -> None:
        """``replicas=0`` names the argument, where it once was "min() arg is an empty sequence"."""
        with pytest.raises(InvalidArgumentError, match="replicas must be a positive integer, got 0"):
            simulate(fixed(2, 16, 2), load_policy("vllm"), replicas=0)

    def test_attrs_checks_name_their_class_and_field(self) -> None:
        """A wrapped attrs validator's message says which class and field refused the value."""
        with pytest.raises(InvalidArgumentError, match=r"Deployment\.tensor_parallel: 'tensor_parallel' must be > 0"):
            Deployment(tensor_parallel=0)
