"""The scheduler's boundaries: bad requests, bad results and bad policy plugins change nothing."""

from __future__ import annotations

import attrs
import numpy as np
import pytest

from phasesched import (
    DeterministicExecutor,
    DuplicateRequestError,
    FinishReason,
    InvalidPlanError,
    InvalidResultError,
    PlanInFlightError,
    Request,
    RequestRejectedError,
    RequestStatus,
    Scheduler,
    SchedulerConfig,
    SchedulingPolicy,
    Selection,
    StepResult,
    UnknownRequestError,
)
from phasesched.policies import DecodeFirst, FixedChunk, NoChunking, TokenBudget
from phasesched.policies.builder import BatchBuilder
from phasesched.view import SchedulerView
from tests.fakes import Driver, make_requests, result_with, scheduler_for


def snapshot(scheduler: Scheduler) -> tuple[object, ...]:
    """Everything observable about a scheduler's state."""
    ids = [*scheduler.running_request_ids(), *scheduler.waiting_request_ids()]
    return (
        scheduler.num_running,
        scheduler.num_waiting,
        scheduler.kv.num_free_pages,
        tuple(scheduler.running_request_ids()),
        tuple(scheduler.waiting_request_ids()),
        tuple(scheduler.progress(i) for i in ids),
        tuple(scheduler.status(i) for i in ids),
    )


class TestRequests:
    @pytest.mark.parametrize(
        "kwargs",
        [
            {"prompt_len": 0},
            {"prompt_len": -3},
            {"prompt_len": 4, "max_new_tokens": 0},
            {"prompt_token_ids": []},
            {"prompt_token_ids": [1, -2]},
            {"prompt_len": 2, "prompt_token_ids": [1, 2, 3]},
            {"prompt_len": 4, "arrival_time": float("nan")},
        ],
    )
    def test_bad_requests_are_refused_at_construction(self, kwargs: dict[str, object]) -> None:
        """Zero or negative token counts and inconsistent prompts raise ValueError."""
        with pytest.raises(ValueError):
            Request("x", **kwargs)  # type: ignore[arg-type]

    def test_duplicate_id(self) -> None:
        """A second request with a held id is refused and the first is untouched."""
        scheduler = scheduler_for(SchedulingPolicy())
        scheduler.add_request(Request("a", prompt_len=4))
        with pytest.raises(DuplicateRequestError):
            scheduler.add_request(Request("a", prompt_len=9))
        assert scheduler.progress("a") == (0, 4)

    @pytest.mark.parametrize(
        ("request_", "match"),
        [
            (Request("long", prompt_len=5000), "max_model_len"),
            (Request("big", prompt_len=3000, max_new_tokens=300), "KV"),
        ],
    )
    def test_unservable_requests_are_rejected(self, request_: Request, match: str) -> None:
        """Prompts longer than the model limit or the KV cache raise RequestRejectedError and leave nothing behind."""
        scheduler = scheduler_for(SchedulingPolicy(), num_pages=200, page_size=16, max_model_len=4096)
        with pytest.raises(RequestRejectedError, match=match) as caught:
            scheduler.add_request(request_)
        assert caught.value.request_id == request_.request_id
        assert scheduler.num_unfinished == 0

    def test_prompt_the_policy_can_never_start(self) -> None:
        """Without chunking, a prompt longer than the token budget can never run, so it is rejected."""
        scheduler = scheduler_for(SchedulingPolicy(budget=TokenBudget(512, 8), chunker=NoChunking()))
        with pytest.raises(RequestRejectedError, match="chunk sizer"):
            scheduler.add_request(Request("x", prompt_len=600))

    def test_generation_stops_at_model_limit(self) -> None:
        """A request stops with reason LENGTH when its sequence reaches max_model_len."""
        driver = Driver(scheduler_for(SchedulingPolicy(), max_model_len=20))
        driver.scheduler.add_request(Request("a", prompt_len=18, max_new_tokens=10))
        driver.run()
        assert driver.finished["a"].num_generated == 2
        assert driver.finished["a"].reason is FinishReason.LENGTH

    def test_eos_and_stop_tokens(self) -> None:
        """EOS and stop tokens finish a request with reason STOP; ignore_eos keeps it going."""
        driver = Driver(scheduler_for(SchedulingPolicy()))
        driver.scheduler.add_request(Request("eos", prompt_token_ids=[1, 2, 3], max_new_tokens=9, eos_token_id=5))
        driver.scheduler.add_request(Request("stop", prompt_token_ids=[1, 2], max_new_tokens=9, stop_token_ids=[4]))
        driver.scheduler.add_request(
            Request("ignore", prompt_token_ids=[1, 2, 3], max_new_tokens=4, eos_token_id=5, ignore_eos=True)
        )
        driver.run()
        assert driver.finished["eos"].output_token_ids == (3, 4, 5)
        assert driver.finished["eos"].reason is FinishReason.STOP
        assert driver.finished["stop"].output_token_ids == (2, 3, 4)
        assert driver.finished["ignore"].output_token_ids == (3, 4, 5, 6)
        assert driver.finished["ignore"].reason is FinishReason.LENGTH

    def test_executor_can_finish_a_request(self) -> None:
        """A finished flag from the executor retires the request with reason EXECUTOR."""
        scheduler = scheduler_for(SchedulingPolicy())
        scheduler.add_request(Request("a", prompt_len=4, max_new_tokens=9))
        plan = scheduler.schedule()
        outcome = scheduler.update(plan, result_with(plan, finished=np.array([True])))
        assert outcome.finished[0].reason is FinishReason.EXECUTOR
        assert scheduler.num_unfinished == 0
        assert scheduler.kv.num_free_pages == scheduler.kv.num_pages


class TestAbort:
    def test_abort_waiting_and_running(self) -> None:
        """Aborting frees the request at once when it is not in flight."""
        driver = Driver(scheduler_for(SchedulingPolicy(budget=TokenBudget(64, 1))))
        for request in make_requests([4, 4]):
            driver.scheduler.add_request(request)
        driver.step()
        assert driver.scheduler.status("r0") is RequestStatus.RUNNING
        record = driver.scheduler.abort("r1")
        assert record is not None
        assert record.status is RequestStatus.ABORTED
        assert driver.scheduler.abort("r0") is not None
        assert driver.scheduler.kv.num_free_pages == driver.scheduler.kv.num_pages
        driver.scheduler.check_invariants()

    def test_abort_in_flight_is_retired_by_update(self) -> None:
        """A request aborted while its plan runs is retired (and reported) by that plan's update."""
        scheduler = scheduler_for(SchedulingPolicy())
        scheduler.add_request(Request("a", prompt_len=4, max_new_tokens=9))
        plan = scheduler.schedule()
        assert scheduler.abort("a") is None
        outcome = scheduler.update(plan, DeterministicExecutor().execute(plan))
        assert [(f.request_id, f.reason) for f in outcome.finished] == [("a", FinishReason.ABORTED)]
        assert scheduler.kv.num_free_pages == scheduler.kv.num_pages
        assert "a" in scheduler.schedule().released

    def test_abort_unknown(self) -> None:
        """Aborting an unknown id raises UnknownRequestError."""
        with pytest.raises(UnknownRequestError):
            scheduler_for(SchedulingPolicy()).abort("ghost")


class TestResults:
    def setup_method(self) -> None:
        self.scheduler = scheduler_for(SchedulingPolicy())
        for request in make_requests([4, 9]):
            self.scheduler.add_request(request)
        self.plan = self.scheduler.schedule()
        self.before = snapshot(self.scheduler)

    @pytest.mark.parametrize(
        "make_result",
        [
            lambda plan: StepResult(step_id=plan.step_id + 1, token_ids=np.zeros(2, np.int32)),
            lambda plan: StepResult(step_id=plan.step_id, token_ids=np.zeros(3, np.int32)),
            lambda plan: StepResult(step_id=plan.step_id, token_ids=np.array([-1, 5])),
            lambda plan: StepResult(step_id=plan.step_id, token_ids=np.zeros(2, np.int32), finished=np.ones(3, bool)),
            lambda plan: StepResult(step_id=plan.step_id, token_ids=np.zeros(2, np.int32), duration_s=-1.0),
        ],
    )
    def test_mismatched_results_change_nothing(self, make_result: object) -> None:
        """A result that does not answer the plan raises InvalidResultError and the plan stays in flight."""
        with pytest.raises(InvalidResultError):
            self.scheduler.update(self.plan, make_result(self.plan))  # type: ignore[operator]
        assert snapshot(self.scheduler) == self.before
        assert self.scheduler.plan_in_flight is self.plan
        self.scheduler.update(self.plan, DeterministicExecutor().execute(self.plan))

    def test_result_types_are_checked(self) -> None:
        """Float token ids and non-boolean finish flags are refused when the result is built."""
        with pytest.raises(InvalidResultError):
            StepResult(step_id=0, token_ids=np.zeros(2))
        with pytest.raises(InvalidResultError):
            StepResult(step_id=0, token_ids=np.zeros(2, np.int32), finished=np.zeros(2, np.int32))

    def test_update_for_a_plan_not_in_flight(self) -> None:
        """Updating with a stale plan raises and changes nothing."""
        self.scheduler.update(self.plan, DeterministicExecutor().execute(self.plan))
        with pytest.raises(InvalidResultError):
            self.scheduler.update(self.plan, DeterministicExecutor().execute(self.plan))

    def test_schedule_twice(self) -> None:
        """A second schedule() before update() raises PlanInFlightError."""
        with pytest.raises(PlanInFlightError):
            self.scheduler.schedule()
        assert snapshot(self.scheduler) == self.before


@attrs.define
class Rogue:
    """A phase-priority plugin whose selection can be corrupted on demand."""

    corrupt: object = None

    def select(self, view: SchedulerView, builder: BatchBuilder) -> Selection:
        selection = DecodeFirst().select(view, builder)
        return selection if self.corrupt is None else self.corrupt(view, selection)  # type: ignore[operator]


def _with(**changes: object) -> object:
    return lambda view, selection: attrs.evolve(selection, **changes)


CORRUPTIONS = {
    "over budget": (lambda view, s: attrs.evolve(s, admitted=("w",), admitted_tokens=(8,)), "max_num_batched_tokens"),
    "duplicate": (
        lambda view, s: attrs.evolve(
            s, running_slots=np.repeat(s.running_slots, 2), running_tokens=np.repeat(s.running_tokens, 2)
        ),
        "twice",
    ),
    "unknown slot": (lambda view, s: attrs.evolve(s, running_slots=s.running_slots + 100), "no running request"),
    "zero tokens": (lambda view, s: attrs.evolve(s, running_tokens=s.running_tokens * 0), "at least one"),
    "too many tokens": (lambda view, s: attrs.evolve(s, running_tokens=s.running_tokens + 1), "left to compute"),
    "scheduled and preempted": (lambda view, s: attrs.evolve(s, preempted=(int(s.running_slots[0]),)), "twice"),
    "unknown admission": (lambda view, s: attrs.evolve(s, admitted=("ghost",), admitted_tokens=(1,)), "not waiting"),
    "admitted twice": (lambda view, s: attrs.evolve(s, admitted=("w", "w"), admitted_tokens=(1, 1)), "twice"),
    "admitted too long": (lambda view, s: attrs.evolve(s, admitted=("w",), admitted_tokens=(99,)), "given 99"),
    "lengths differ": (lambda view, s: attrs.evolve(s, admitted=("w",), admitted_tokens=()), "differ in length"),
    "not a selection": (lambda view, s: {"slots": [0]}, "not a Selection"),
    "too many pages": (lambda view, s: attrs.evolve(s, admitted=("w", "f"), admitted_tokens=(4, 4)), "KV pages"),
    "too many seqs": (lambda view, s: attrs.evolve(s, admitted=("w",), admitted_tokens=(1,)), "max_num_seqs"),
    "negative slot": (lambda view, s: attrs.evolve(s, running_slots=s.running_slots - 100), "no running request"),
}


class TestPolicyPlugins:
    @pytest.mark.parametrize("name", sorted(CORRUPTIONS))
    def test_invalid_plan_is_rejected_before_it_touches_state(self, name: str) -> None:
        """Whatever a rogue policy proposes, the scheduler raises InvalidPlanError and stays as it was."""
        corrupt, match = CORRUPTIONS[name]
        rogue = Rogue()
        budget = TokenBudget(9 if name == "over budget" else 16, 2 if name == "too many seqs" else 8)
        policy = SchedulingPolicy(budget=budget, chunker=FixedChunk(8), priority=rogue)
        scheduler = Scheduler(SchedulerConfig(num_pages=5, page_size=4), policy)
        for request in make_requests([4, 4], max_new_tokens=8):
            scheduler.add_request(request)
        driver = Driver(scheduler)
        driver.step()
        scheduler.add_request(Request("w", prompt_len=8, max_new_tokens=1))
        scheduler.add_request(Request("f", prompt_len=4, max_new_tokens=1))
        before = snapshot(scheduler)
        rogue.corrupt = corrupt
        with pytest.raises(InvalidPlanError, match=match):
            scheduler.schedule()
        assert snapshot(scheduler) == before
        scheduler.check_invariants()
        rogue.corrupt = None
        driver.run()
        assert scheduler.kv.num_free_pages == scheduler.kv.num_pages

    def test_invalid_chunk_size_from_plugin(self) -> None:
        """A chunk sizer that returns more than the budget allows is rejected with a typed error."""

        @attrs.frozen
        class Greedy:
            def chunk(self, candidate: object, context: object) -> int:
                return 10_000

        scheduler = scheduler_for(SchedulingPolicy(budget=TokenBudget(64, 8), chunker=Greedy()))
        with pytest.raises(InvalidPlanError, match="Greedy"):
            scheduler.add_request(Request("a", prompt_len=40))
        assert scheduler.num_unfinished == 0

    def test_chunk_sizer_errors_leave_scheduler_unchanged(self) -> None:
        """A chunk sizer that misbehaves mid-run raises InvalidPlanError and nothing changes."""

        @attrs.define
        class Flaky:
            bad: bool = False

            def chunk(self, candidate: object, context: object) -> int:
                return -1 if self.bad else 8

        sizer = Flaky()
        scheduler = scheduler_for(SchedulingPolicy(budget=TokenBudget(64, 8), chunker=sizer))
        scheduler.add_request(Request("a", prompt_len=40))
        before = snapshot(scheduler)
        sizer.bad = True
        with pytest.raises(InvalidPlanError, match="Flaky"):
            scheduler.schedule()
        assert snapshot(scheduler) == before

    def test_admissions_count_their_whole_prefill_pages(self) -> None:
        """A plugin admitting prompts by one-token first chunks cannot overfill the cache with their later chunks."""

        @attrs.frozen
        class Greedy:
            def select(self, view: SchedulerView, builder: BatchBuilder) -> Selection:
                waiting = [c.request_id for c in view.waiting()]
                return Selection(
                    np.empty(0, np.int32), np.empty(0, np.int32), tuple(waiting), tuple(1 for _ in waiting)
                )

        policy = SchedulingPolicy(budget=TokenBudget(64, 16), priority=Greedy())
        scheduler = Scheduler(SchedulerConfig(num_pages=8, page_size=4), policy)
        for request in make_requests([8] * 7, max_new_tokens=1, with_ids=False):  # 7 x 2 pages, 7 first pages
            scheduler.add_request(request)
        before = snapshot(scheduler)
        with pytest.raises(InvalidPlanError, match="prefills need 14 KV pages"):
            scheduler.schedule()
        assert snapshot(scheduler) == before
