"""A plan the executor could not run can be given back, and requests can be failed."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from phasesched import (
    DeterministicExecutor,
    FinishedRequest,
    FinishReason,
    InvalidPlanError,
    PlanInFlightError,
    Request,
    RequestRejectedError,
    RequestStatus,
    Scheduler,
    SchedulerConfig,
    SchedulingPolicy,
)
from phasesched.policies import TokenBudget
from tests.fakes import expected_tokens, make_requests, scheduler_for
from tests.strategies import PRESETS, Shape, preset, request_of, workloads


def held(scheduler: Scheduler) -> tuple[object, ...]:
    """What a plan may change: who runs, who waits, their progress, the free pages."""
    ids = sorted([*scheduler.running_request_ids(), *scheduler.waiting_request_ids()])
    return (
        scheduler.running_request_ids(),
        list(scheduler.waiting_request_ids()),
        [(scheduler.status(i), scheduler.progress(i)) for i in ids],
        scheduler.kv.num_free_pages,
    )


def step(scheduler: Scheduler) -> tuple[FinishedRequest, ...]:
    """One ordinary step with the deterministic executor."""
    plan = scheduler.schedule()
    return scheduler.update(plan, DeterministicExecutor().execute(plan)).finished


class TestAbandon:
    def test_running_requests_return_to_where_they_stood(self) -> None:
        """Abandoning a plan of running requests records no token and returns the pages of its new tokens."""
        scheduler = scheduler_for(SchedulingPolicy(), num_pages=32, page_size=4)
        for request in make_requests([6, 9], max_new_tokens=8):
            scheduler.add_request(request)
        step(scheduler)
        before = held(scheduler)
        plan = scheduler.schedule()
        assert scheduler.abandon(plan) == ()
        assert held(scheduler) == before
        assert scheduler.plan_in_flight is None
        scheduler.check_invariants()

    def test_admitted_requests_go_back_to_their_place(self) -> None:
        """Requests the plan admitted wait again in their old order, are released, and are announced again."""
        scheduler = scheduler_for(SchedulingPolicy(budget=TokenBudget(64, 2)), num_pages=32, page_size=4)
        for request in make_requests([4, 4, 4], max_new_tokens=3):
            scheduler.add_request(request)
        before = held(scheduler)
        plan = scheduler.schedule()
        assert [r.request_id for r in plan.new_requests] == ["r0", "r1"]
        scheduler.abandon(plan)
        assert held(scheduler) == before
        assert scheduler.pending_releases == ("r0", "r1")
        again = scheduler.schedule()
        assert [r.request_id for r in again.new_requests] == ["r0", "r1"]
        assert again.released == ("r0", "r1")

    def test_preemptions_stand_and_are_reported_by_the_next_plan(self) -> None:
        """A request the abandoned plan preempted stays preempted, and the next plan lists it."""
        policy = SchedulingPolicy(budget=TokenBudget(64, 4))
        scheduler = Scheduler(SchedulerConfig(num_pages=4, page_size=2), policy)
        for request in make_requests([2, 2], max_new_tokens=6):
            scheduler.add_request(request)
        step(scheduler)
        step(scheduler)
        plan = scheduler.schedule()  # both cross a page boundary: one is preempted
        while not plan.preempted:
            scheduler.update(plan, DeterministicExecutor().execute(plan))
            plan = scheduler.schedule()
        scheduler.abandon(plan)
        victim = plan.preempted[0]
        assert scheduler.status(victim) is RequestStatus.PREEMPTED
        assert victim in scheduler.schedule().preempted
        scheduler.check_invariants()

    def test_no_decode_run_skips_the_plan_that_reports_carried_preemptions(self) -> None:
        """A simulation's decode run waits for the plan that lists an abandoned plan's preemptions."""
        scheduler = Scheduler(SchedulerConfig(num_pages=4, page_size=2), SchedulingPolicy(budget=TokenBudget(64, 4)))
        for index in range(2):
            scheduler.add_request(Request(f"r{index}", prompt_len=2, max_new_tokens=6, ignore_eos=True))
        plan = scheduler.schedule()
        while not plan.preempted:  # both cross a page boundary: one is preempted
            scheduler.update(plan, DeterministicExecutor().execute(plan))
            plan = scheduler.schedule()
        scheduler.abandon(plan)
        assert scheduler.decode_run(100) is None
        plan = scheduler.schedule()
        assert plan.preempted
        scheduler.update(plan, DeterministicExecutor().execute(plan))
        assert scheduler.decode_run(100) is not None  # the survivor decodes on; the victim waits for room

    def test_requests_aborted_in_flight_are_retired(self) -> None:
        """A request aborted while its plan was in flight ends when the plan is abandoned."""
        scheduler = scheduler_for(SchedulingPolicy())
        scheduler.add_request(Request("a", prompt_len=4, max_new_tokens=9))
        plan = scheduler.schedule()
        assert scheduler.abort("a") is None
        (record,) = scheduler.abandon(plan)
        assert (record.request_id, record.reason) == ("a", FinishReason.ABORTED)
        assert scheduler.kv.num_free_pages == scheduler.kv.num_pages

    def test_only_the_plan_in_flight(self) -> None:
        """Abandoning a plan that is not in flight raises and changes nothing."""
        scheduler = scheduler_for(SchedulingPolicy())
        scheduler.add_request(Request("a", prompt_len=4, max_new_tokens=9))
        plan = scheduler.schedule()
        scheduler.update(plan, DeterministicExecutor().execute(plan))
        before = held(scheduler)
        with pytest.raises(InvalidPlanError):
            scheduler.abandon(plan)
        assert held(scheduler) == before

    def test_an_abandoned_admission_claims_nothing(self) -> None:
        """A plan that admitted a request onto a cached prefix, given back, leaves pages and counters as they were."""
        scheduler = Scheduler(SchedulerConfig(num_pages=64, page_size=4), preset("vllm"))
        scheduler.add_request(request_of(0, (24, 2, 0)))
        while scheduler.num_unfinished:
            step(scheduler)
        cached, stats = sorted(scheduler.kv.idle_cached_pages()), scheduler.kv.cache_stats
        scheduler.add_request(request_of(1, (28, 2, 0)))  # shares r0's first six pages
        before = held(scheduler)
        plan = scheduler.schedule()
        assert int(plan.start[0]) == 24  # it claimed six cached pages
        assert scheduler.abandon(plan) == ()
        assert held(scheduler) == before
        assert (sorted(scheduler.kv.idle_cached_pages()), scheduler.kv.cache_stats) == (cached, stats)
        scheduler.check_invariants()
        step(scheduler)
        assert scheduler.kv.cache_stats.hits == stats.hits + 6

    @given(
        name=st.sampled_from(PRESETS),
        shapes=workloads(max_size=6, max_prompt=40, max_output=12, max_arrival=10),
        pages=st.integers(12, 40),
        abandoned=st.sets(st.integers(0, 80), max_size=20),
    )
    @settings(deadline=None, max_examples=100, suppress_health_check=[HealthCheck.too_slow])
    def test_abandoned_steps_invent_nothing(
        self, name: str, shapes: list[Shape], pages: int, abandoned: set[int]
    ) -> None:
        """Whatever steps are abandoned, every request ends once with exactly its tokens, and no page leaks."""
        scheduler = Scheduler(SchedulerConfig(num_pages=pages, page_size=4, max_model_len=256), preset(name))
        requests: dict[str, Request] = {}
        for index, shape in enumerate(shapes):
            request = request_of(index, (shape[0], shape[1], 0))
            try:
                scheduler.add_request(request)
            except RequestRejectedError:
                continue
            requests[request.request_id] = request
        finished: dict[str, FinishedRequest] = {}
        for attempt in range(2000):
            if not scheduler.num_unfinished:
                break
            plan = scheduler.schedule()
            # the pages the plan reads are its tables' pages, however the last plan ended
            _, indices = scheduler._kv.gather(plan.slots, scheduler.kv.page_counts[plan.slots])
            assert plan.kv_indices.tolist() == indices.tolist()
            if attempt in abandoned:
                assert scheduler.abandon(plan) == ()
            else:
                for record in scheduler.update(plan, DeterministicExecutor(vocab_size=50).execute(plan)).finished:
                    assert record.request_id not in finished
                    finished[record.request_id] = record
            scheduler.check_invariants()
        assert set(finished) == set(requests)
        assert scheduler.kv.num_free_pages == scheduler.kv.num_pages
        for request_id, record in finished.items():
            request = requests[request_id]
            expected = expected_tokens(request.prompt_len, request.max_new_tokens, vocab_size=50)
            assert record.output_token_ids == expected[: max(256 - request.prompt_len, 1)]


class TestFail:
    def test_fail_ends_a_request_with_its_reason(self) -> None:
        """A failed request ends as FAILED with the reason given and frees its KV."""
        scheduler = scheduler_for(SchedulingPolicy())
        for request in make_requests([4, 4], max_new_tokens=9):
            scheduler.add_request(request)
        step(scheduler)
        record = scheduler.fail("r0", "boom")
        assert (record.status, record.reason, record.error) == (RequestStatus.FAILED, FinishReason.ERROR, "boom")
        assert scheduler.fail("r1", "boom too").num_generated == 1
        assert scheduler.kv.num_free_pages == scheduler.kv.num_pages
        assert scheduler.pending_releases == ("r0", "r1")

    def test_fail_refuses_a_request_in_flight(self) -> None:
        """A request of the plan in flight cannot be failed before the plan is abandoned."""
        scheduler = scheduler_for(SchedulingPolicy())
        scheduler.add_request(Request("a", prompt_len=4))
        plan = scheduler.schedule()
        with pytest.raises(PlanInFlightError):
            scheduler.fail("a", "boom")
        scheduler.abandon(plan)
        assert scheduler.fail("a", "boom").status is RequestStatus.FAILED
