"""The engine loop: real executors measured with the simulator's metrics."""

from __future__ import annotations

import numpy as np
import pytest

from phasesched import (
    DeterministicExecutor,
    Engine,
    PhaseschedError,
    Request,
    Scheduler,
    SchedulerConfig,
    SchedulingPolicy,
    VirtualClock,
    WallClock,
    load_policy,
)
from phasesched.costmodel import RooflineCostModel
from phasesched.selection import Selection
from phasesched.sim import Deployment, Poisson, SimulatedExecutor, Uniform, simulate, synthetic


class TestEngine:
    def test_matches_the_simulator_step_for_step(self) -> None:
        """On a virtual clock with the simulated executor, the engine reproduces the simulator exactly."""
        workload = synthetic(40, Poisson(15.0), Uniform(16, 3000), Uniform(1, 60), seed=5)
        deployment = Deployment(num_pages=4000)
        simulated = simulate(workload, load_policy("sarathi"), deployment, fast_forward=False).metrics
        engine = Engine(
            Scheduler(deployment.scheduler_config(), load_policy("sarathi")),
            SimulatedExecutor(RooflineCostModel.from_names()),
            clock=VirtualClock(),
        )
        served = engine.run(workload.requests())
        for key in ("completed", "median_ttft_ms", "p99_itl_ms", "max_e2el_ms", "total_output_tokens", "duration"):
            assert served[key] == pytest.approx(simulated[key], rel=1e-12), key

    def test_a_request_that_can_never_fit_is_counted_as_failed(self) -> None:
        """A prompt beyond the KV capacity is counted in ``failed`` and the others are still served."""
        engine = Engine(
            Scheduler(SchedulerConfig(num_pages=8, page_size=4)), DeterministicExecutor(), clock=VirtualClock()
        )
        requests = [
            Request("ok", prompt_len=5, max_new_tokens=3),
            Request("huge", prompt_len=500, max_new_tokens=3, arrival_time=0.5),
            Request("ok2", prompt_len=5, max_new_tokens=3, arrival_time=1.0),
        ]
        metrics = engine.run(requests)
        assert (metrics["completed"], metrics["failed"], metrics["total_output_tokens"]) == (2, 1, 6)
        assert "huge" in engine.recorder.errors[0]

    def test_wall_clock_waits_for_arrivals(self) -> None:
        """On the wall clock a request arriving later is not served before it arrives."""
        engine = Engine(Scheduler(SchedulerConfig(num_pages=64)), DeterministicExecutor(), keep_requests=True)
        requests = [
            Request("now", prompt_token_ids=[1, 2], max_new_tokens=2),
            Request("later", prompt_token_ids=[3, 4], max_new_tokens=2, arrival_time=0.05),
        ]
        metrics = engine.run(requests)
        assert metrics["completed"] == 2
        assert metrics.requests is not None
        assert all(r.budget.total_s == pytest.approx(r.e2el_s) for r in metrics.requests)
        assert isinstance(engine.clock, WallClock)
        assert engine.clock.now() >= 0.05

    def test_keeps_step_records(self) -> None:
        """With keep_steps the engine logs every step's shape and times."""
        engine = Engine(
            Scheduler(SchedulerConfig(num_pages=64)), DeterministicExecutor(), clock=VirtualClock(), keep_steps=True
        )
        engine.run([Request("a", prompt_len=5, max_new_tokens=3)])
        assert [s.num_new for s in engine.steps] == [(5,), (1,), (1,)]
        assert [s.kv_len for s in engine.steps] == [(5,), (6,), (7,)]

    def test_a_policy_that_never_schedules_is_reported(self) -> None:
        """A plugin that schedules nothing while requests wait stops the engine with a clear error."""

        class Idle:
            def select(self, view: object, builder: object) -> Selection:
                return Selection(np.empty(0, np.int32), np.empty(0, np.int32))

        scheduler = Scheduler(SchedulerConfig(num_pages=64), SchedulingPolicy(priority=Idle()))  # type: ignore[arg-type]
        engine = Engine(scheduler, DeterministicExecutor(), clock=VirtualClock())
        with pytest.raises(PhaseschedError, match="scheduled nothing"):
            engine.run([Request("a", prompt_len=5)])


class Recording:
    """An executor that remembers every plan it was given."""

    def __init__(self) -> None:
        self.released: list[str] = []
        self.inner = DeterministicExecutor()

    def execute(self, plan: object) -> object:
        self.released.extend(plan.released)  # type: ignore[attr-defined]
        return self.inner.execute(plan)  # type: ignore[arg-type]


def test_engine_tells_the_executor_about_every_finished_request() -> None:
    """Every request's release reaches the executor, the last ones included."""
    executor = Recording()
    engine = Engine(Scheduler(SchedulerConfig(num_pages=64)), executor, clock=VirtualClock())  # type: ignore[arg-type]
    engine.run([Request(f"r{i}", prompt_len=4, max_new_tokens=2 + i) for i in range(3)])
    assert sorted(executor.released) == ["r0", "r1", "r2"]
    assert not engine.scheduler.pending_releases
