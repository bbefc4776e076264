"""The engine loop: real executors measured with the simulator's metrics."""

from __future__ import annotations

import attrs
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from phasesched import (
    DeterministicExecutor,
    Engine,
    InvalidArgumentError,
    PhaseschedError,
    PlanInFlightError,
    Request,
    RequestStatus,
    Scheduler,
    SchedulerConfig,
    SchedulingPolicy,
    StepPlan,
    StepResult,
    VirtualClock,
    WallClock,
    load_policy,
)
from phasesched.costmodel import RooflineCostModel
from phasesched.engine import FailurePolicy
from phasesched.selection import Selection
from phasesched.sim import Deployment, Poisson, SimulatedExecutor, Uniform, simulate, synthetic
from tests.fakes import expected_tokens
from tests.strategies import PRESETS, Shape, preset, request_of, workloads


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

    def test_the_last_request_may_be_rejected(self) -> None:
        """A run whose last arrival can never fit ends normally, counting it as failed."""
        engine = Engine(
            Scheduler(SchedulerConfig(num_pages=8, page_size=4)), DeterministicExecutor(), clock=VirtualClock()
        )
        metrics = engine.run(
            [Request("ok", prompt_len=4, max_new_tokens=2), Request("huge", prompt_len=500, arrival_time=1.0)]
        )
        assert (metrics["completed"], metrics["failed"]) == (1, 1)

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

        scheduler = Scheduler(SchedulerConfig(num_pages=64), SchedulingPolicy(priority=Idle()))
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


@attrs.define
class Flaky:
    """An executor that raises on the calls whose index is in ``failing`` (or on every call)."""

    failing: set[int] = attrs.field(factory=set)
    always: bool = False
    calls: int = 0
    inner: DeterministicExecutor = attrs.field(factory=lambda: DeterministicExecutor(vocab_size=50))

    def execute(self, plan: StepPlan) -> StepResult:
        """The deterministic result, or an error."""
        self.calls += 1
        if self.always or self.calls - 1 in self.failing:
            msg = f"device lost on call {self.calls - 1}"
            raise RuntimeError(msg)
        return self.inner.execute(plan)


class TestExecutorFailures:
    @given(
        name=st.sampled_from(PRESETS),
        shapes=workloads(max_size=6, max_prompt=40, max_output=12, max_arrival=10),
        pages=st.integers(12, 40),
        failing=st.sets(st.integers(0, 60), max_size=30),
        retries=st.integers(0, 3),
    )
    @settings(deadline=None, max_examples=100, suppress_health_check=[HealthCheck.too_slow])
    def test_every_request_ends_once_and_invents_nothing(
        self, name: str, shapes: list[Shape], pages: int, failing: set[int], retries: int
    ) -> None:
        """With an executor failing at random steps, each request completes with its own tokens or fails, once."""
        scheduler = Scheduler(SchedulerConfig(num_pages=pages, page_size=4, max_model_len=256), preset(name))
        engine = Engine(
            scheduler, Flaky(failing), clock=VirtualClock(), keep_requests=True, failure=FailurePolicy(retries)
        )
        requests = sorted((request_of(i, shape) for i, shape in enumerate(shapes)), key=lambda r: r.arrival_time)
        metrics = engine.run(requests)
        assert metrics["completed"] + metrics["failed"] == len(requests)
        rejected = len(requests) - len(engine.finished)
        failed = [r for r in engine.finished.values() if r.status is RequestStatus.FAILED]
        assert metrics["failed"] == len(failed) + rejected
        assert all(r.status is not RequestStatus.ABORTED for r in engine.finished.values())
        assert scheduler.kv.num_free_pages == scheduler.kv.num_pages
        scheduler.check_invariants()
        by_id = {r.request_id: r for r in requests}
        for record in engine.finished.values():
            if record.status is RequestStatus.FINISHED:
                request = by_id[record.request_id]
                expected = expected_tokens(request.prompt_len, request.max_new_tokens, vocab_size=50)
                assert record.output_token_ids == expected[: max(256 - request.prompt_len, 1)]
        assert metrics["total_output_tokens"] == sum(
            r.num_generated for r in engine.finished.values() if r.status is RequestStatus.FINISHED
        )

    @pytest.mark.parametrize("name", ["vllm", "sarathi"])
    def test_a_request_failed_after_its_preemption_is_not_reported_preempted(self, name: str) -> None:
        """A plan that preempts fails; the next, readmitting the victim, fails too: the victim ends once, unpreempted.

        The first failure carries the preemption over to the next plan; the victim then fails with
        the second plan, so no later plan may report it preempted (the metrics had dropped it).
        """
        seen: list[tuple[str, ...]] = []

        @attrs.define
        class Watching(Flaky):
            def execute(self, plan: StepPlan) -> StepResult:
                seen.append(plan.preempted)
                return super().execute(plan)

        scheduler = Scheduler(SchedulerConfig(num_pages=12, page_size=4, max_model_len=256), preset(name))
        engine = Engine(
            scheduler, Watching({9, 10}), clock=VirtualClock(), keep_requests=True, failure=FailurePolicy(0)
        )
        requests = [request_of(i, (16, 12, 0)) for i in range(4)]
        metrics = engine.run(requests)
        victim = seen[9]
        assert victim  # the scenario: call 9 preempts, call 10 readmits the victim and fails it
        assert victim[0] in seen[10]
        assert engine.finished[victim[0]].status is RequestStatus.FAILED
        assert all(victim[0] not in preempted for preempted in seen[11:])
        assert metrics["completed"] + metrics["failed"] == len(requests)
        scheduler.check_invariants()

    def test_a_dead_executor_fails_every_request_and_the_run_ends(self) -> None:
        """An executor that always raises ends every request as failed, with its error, after the retries."""
        engine = Engine(
            Scheduler(SchedulerConfig(num_pages=64)),
            Flaky(always=True),
            clock=VirtualClock(),
            keep_requests=True,
            failure=FailurePolicy(max_retries=1),
        )
        metrics = engine.run([Request(f"r{i}", prompt_len=4, max_new_tokens=3) for i in range(3)])
        assert (metrics["completed"], metrics["failed"]) == (0, 3)
        assert "device lost" in engine.recorder.errors[0]
        assert {r.error for r in engine.finished.values()} == {engine.recorder.errors[0]}
        assert engine.executor.calls == 4  # type: ignore[attr-defined]  # a try and a retry: the batch, the releases

    def test_a_transient_failure_is_retried(self) -> None:
        """A failure within the retries loses nothing: every request completes with its own tokens."""
        engine = Engine(
            Scheduler(SchedulerConfig(num_pages=64)), Flaky({0, 2, 3}), clock=VirtualClock(), keep_requests=True
        )
        metrics = engine.run([Request("a", prompt_token_ids=[1, 2, 3], max_new_tokens=4)])
        assert (metrics["completed"], metrics["failed"]) == (1, 0)
        assert engine.finished["a"].output_token_ids == (3, 4, 5, 6)

    def test_other_exceptions_propagate_with_the_plan_given_back(self) -> None:
        """An exception outside ``retry_on`` propagates, and the scheduler is left with no plan in flight."""
        scheduler = Scheduler(SchedulerConfig(num_pages=64))
        engine = Engine(
            scheduler, Flaky(always=True), clock=VirtualClock(), failure=FailurePolicy(retry_on=(KeyError,))
        )
        with pytest.raises(RuntimeError, match="device lost"):
            engine.run([Request("a", prompt_len=4)])
        assert scheduler.plan_in_flight is None
        scheduler.check_invariants()

    def test_failure_policy_is_validated(self) -> None:
        """A negative retry count is a typed error."""
        with pytest.raises(InvalidArgumentError):
            FailurePolicy(max_retries=-1)


class TestEngineInputs:
    def test_requests_already_waiting_are_served(self) -> None:
        """Requests added to the scheduler before the run are served and measured like the others."""
        scheduler = Scheduler(SchedulerConfig(num_pages=64))
        scheduler.add_request(Request("early", prompt_len=4, max_new_tokens=3))
        engine = Engine(scheduler, DeterministicExecutor(), clock=VirtualClock())
        metrics = engine.run([Request("late", prompt_len=4, max_new_tokens=2, arrival_time=1.0)])
        assert (metrics["completed"], metrics["total_output_tokens"]) == (2, 5)

    def test_requests_already_running_elsewhere_are_refused(self) -> None:
        """A scheduler running requests this engine did not start is refused with a typed error."""
        scheduler = Scheduler(SchedulerConfig(num_pages=64))
        scheduler.add_request(Request("a", prompt_len=4, max_new_tokens=3))
        plan = scheduler.schedule()
        engine = Engine(scheduler, DeterministicExecutor(), clock=VirtualClock())
        with pytest.raises(PlanInFlightError):
            engine.run([])
        scheduler.update(plan, DeterministicExecutor().execute(plan))
        with pytest.raises(InvalidArgumentError, match="did not start"):
            engine.run([])

    def test_a_second_run_goes_on_with_its_own_requests(self) -> None:
        """After a run stopped by an error, the next run of the same engine serves what it left."""
        engine = Engine(Scheduler(SchedulerConfig(num_pages=64)), DeterministicExecutor(), clock=VirtualClock())
        requests = [
            Request("a", prompt_len=4, max_new_tokens=3, arrival_time=2.0),
            Request("b", prompt_len=4, max_new_tokens=3, arrival_time=1.0),
        ]
        with pytest.raises(InvalidArgumentError, match="arrival_time order"):
            engine.run(requests)
        metrics = engine.run([])
        assert metrics["completed"] == 1

    def test_unsorted_arrivals_are_refused(self) -> None:
        """A request arriving before the one ahead of it raises instead of being admitted late."""
        engine = Engine(Scheduler(SchedulerConfig(num_pages=64)), DeterministicExecutor(), clock=VirtualClock())
        requests = [Request("a", prompt_len=4, arrival_time=1.0), Request("b", prompt_len=4, arrival_time=0.5)]
        with pytest.raises(InvalidArgumentError, match=r"'b' arrives at 0\.5 s, after 'a' at 1\.0 s"):
            engine.run(requests)
