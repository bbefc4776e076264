"""schedule(), update() and add_request() are atomic: whatever raises inside them, and wherever, changes nothing.

A one-shot fault is injected at a random call of a random part (a policy plugin, the KV manager,
the running arrays, the waiting queue, the plan builder). The driver checks that the call left
the scheduler exactly as before, retries it, and at the end compares every plan and every output
with a run without the fault: a rollback that missed anything shows as a different plan later.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import attrs
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import phasesched.kv
from phasesched import (
    DeterministicExecutor,
    FinishedRequest,
    InvalidPlanError,
    PhaseschedError,
    PolicyOptions,
    Request,
    RequestRejectedError,
    Scheduler,
    SchedulerConfig,
    SchedulingPolicy,
    Selection,
    StepPlan,
    load_policy,
)
from phasesched.plan import build_step_plan
from phasesched.policies import ChunkContext, PhasePriority, PrefillCandidate, VictimOrder
from phasesched.policies.builder import BatchBuilder
from phasesched.policies.chunking import ChunkSizer
from phasesched.policies.queue_order import QueueOrder
from phasesched.prefix import PromptBlocks
from phasesched.view import SchedulerView
from tests.strategies import PRESETS, Fault, InjectedFaultError, Shape, preset, request_of, workloads


@attrs.frozen
class FaultyPriority:
    """A plugin priority that fails when its fault fires."""

    inner: PhasePriority
    fault: Fault

    def select(self, view: SchedulerView, builder: BatchBuilder) -> Selection:
        """The inner selection, or the fault."""
        return self.fault.wrap(self.inner.select)(view, builder)  # type: ignore[return-value]


@attrs.frozen
class FaultyChunker:
    """A plugin chunk sizer that fails when its fault fires."""

    inner: ChunkSizer
    fault: Fault

    def chunk(self, candidate: PrefillCandidate, context: ChunkContext) -> int:
        """The inner chunk, or the fault."""
        return self.fault.wrap(self.inner.chunk)(candidate, context)  # type: ignore[return-value]


@attrs.frozen
class FaultyVictims:
    """A plugin victim order that fails when its fault fires."""

    inner: VictimOrder
    fault: Fault

    def order(self, view: SchedulerView, slots: Any) -> Any:
        """The inner order, or the fault."""
        return self.fault.wrap(self.inner.order)(view, slots)


@attrs.frozen
class FaultyQueueOrder:
    """A plugin queue order that fails when its fault fires."""

    inner: QueueOrder
    fault: Fault

    def key(self, request: Request) -> Any:
        """The inner key, or the fault."""
        return self.fault.wrap(self.inner.key)(request)


def with_plugin(policy: SchedulingPolicy, part: str, fault: Fault) -> SchedulingPolicy:
    """``policy`` with one strategy behind a faulty plugin wrapper."""
    if part == "priority":
        return attrs.evolve(policy, priority=FaultyPriority(policy.priority, fault))
    if part == "chunker":
        return attrs.evolve(policy, chunker=FaultyChunker(policy.chunker, fault))
    if part == "victims":
        preemption = attrs.evolve(policy.preemption, victims=FaultyVictims(policy.preemption.victims, fault))
        return attrs.evolve(policy, preemption=preemption)
    if part == "queue_order":
        return attrs.evolve(policy, queue_order=FaultyQueueOrder(policy.queue_order, fault))
    return policy


PLUGIN_PARTS = ("priority", "chunker", "victims", "queue_order")
INTERNAL_PARTS: dict[str, Callable[[Scheduler], tuple[object, str]]] = {
    "kv.extend_many": lambda s: (s._kv, "extend_many"),
    "kv.open": lambda s: (s._kv, "open"),
    "kv.free_many": lambda s: (s._kv, "free_many"),
    "kv.gather": lambda s: (s._kv, "gather"),
    "kv.claim": lambda s: (s._kv, "claim"),
    "kv.register_many": lambda s: (s._kv, "register_many"),
    "arrays.load": lambda s: (s._arrays, "load"),
    "arrays.unload": lambda s: (s._arrays, "unload"),
    "tokens.write": lambda s: (s._arrays.tokens, "write"),
    "waiting.push": lambda s: (s._waiting, "push"),
    "waiting.remove": lambda s: (s._waiting, "remove"),
}
PARTS = (*PLUGIN_PARTS, *INTERNAL_PARTS, "build_step_plan")


@contextlib.contextmanager
def installed(scheduler: Scheduler, part: str, fault: Fault) -> Iterator[None]:
    """Make ``part`` of ``scheduler`` (an internal one, or the plan builder) fail when ``fault`` fires."""
    if part in INTERNAL_PARTS:
        owner, name = INTERNAL_PARTS[part](scheduler)
        setattr(owner, name, fault.wrap(getattr(owner, name)))
    if part == "build_step_plan":
        with mock.patch("phasesched.scheduler.build_step_plan", fault.wrap(build_step_plan)):
            yield
        return
    yield


def state_of(scheduler: Scheduler) -> tuple[object, ...]:
    """Everything observable about a scheduler, KV tables included."""
    ids = sorted([*scheduler.running_request_ids(), *scheduler.waiting_request_ids()])
    return (
        scheduler.running_request_ids(),
        list(scheduler.waiting_request_ids()),
        [(scheduler.status(i), scheduler.progress(i)) for i in ids],
        scheduler.kv.num_free_pages,
        scheduler.kv.page_counts.tolist(),
        scheduler.kv.refcounts.tolist(),
        scheduler.kv.idle_cached_pages(),
        scheduler.kv.cache_stats,
        scheduler.plan_in_flight,
        scheduler.pending_releases,
    )


def attempt(scheduler: Scheduler, fault: Fault, operation: Callable[[], Any]) -> Any:
    """Run ``operation``; if the injected fault fires, check nothing changed and run it again."""
    with fault.pause():
        before = state_of(scheduler)
    try:
        return operation()
    except InjectedFaultError:
        with fault.pause():
            assert state_of(scheduler) == before, "a failed call changed the scheduler"
            scheduler.check_invariants()
        return operation()


Trace = tuple[list[tuple[object, ...]], dict[str, FinishedRequest]]


def drive(policy: SchedulingPolicy, shapes: list[Shape], pages: int, part: str, fault: Fault) -> Trace:
    """Serve ``shapes`` with ``part`` faulty; return every plan's shape and every finished request."""
    scheduler = Scheduler(SchedulerConfig(num_pages=pages, page_size=4, max_model_len=256), policy)
    executor = DeterministicExecutor(vocab_size=50)
    pending = sorted(enumerate(shapes), key=lambda item: item[1][2])
    seen: list[tuple[object, ...]] = []
    finished: dict[str, FinishedRequest] = {}
    with installed(scheduler, part, fault):
        for step in range(600):
            while pending and pending[0][1][2] <= step:
                index, shape = pending.pop(0)
                request = request_of(index, shape, eos=7)
                with contextlib.suppress(RequestRejectedError):
                    attempt(scheduler, fault, functools.partial(scheduler.add_request, request))
            if not pending and not scheduler.num_unfinished:
                break
            plan: StepPlan = attempt(scheduler, fault, functools.partial(scheduler.schedule, float(step)))
            seen.append(
                (plan.step_id, plan.request_ids, plan.num_new.tolist(), plan.kv_indices.tolist(), plan.released)
            )
            result = executor.execute(plan)
            outcome = attempt(scheduler, fault, functools.partial(scheduler.update, plan, result))
            finished.update((f.request_id, f) for f in outcome.finished)
            with fault.pause():
                scheduler.check_invariants()
    assert scheduler.num_unfinished == 0
    assert scheduler.kv.num_free_pages == scheduler.kv.num_pages
    return seen, finished


class TestAtomicity:
    @given(
        name=st.sampled_from(PRESETS),
        shapes=workloads(max_size=6, max_prompt=40, max_output=12, max_arrival=10),
        pages=st.integers(12, 40),
        part=st.sampled_from(PARTS),
        countdown=st.integers(0, 60),
    )
    @settings(deadline=None, max_examples=200, suppress_health_check=[HealthCheck.too_slow])
    # r2 is preempted for r1, which is admitted into r2's slot; the step then fails: r2's row must come back.
    @example(
        name="vllm-priority", shapes=[(9, 5, 1), (17, 1, 5), (9, 5, 1)], pages=12, part="kv.extend_many", countdown=1
    )
    def test_a_fault_anywhere_changes_nothing(
        self, name: str, shapes: list[Shape], pages: int, part: str, countdown: int
    ) -> None:
        """A call that fails part-way leaves the scheduler as it was; retried, the run is the fault-free run."""
        policy = preset(name)
        fault = Fault(countdown)
        faulty = drive(with_plugin(policy, part, fault), shapes, pages, part, fault)
        never = Fault(10**9)
        clean = drive(with_plugin(policy, part, never), shapes, pages, part, never)
        assert faulty == clean

    def test_a_half_done_admission_strands_nobody(self) -> None:
        """An admission that fails on its second request leaves the first one waiting, and both are served."""
        scheduler = Scheduler(SchedulerConfig(num_pages=64, page_size=4), preset("vllm"))
        for index in range(2):
            scheduler.add_request(request_of(index, (8, 3, 0)))
        fault = Fault(1)  # the second load fails
        scheduler._arrays.load = fault.wrap(scheduler._arrays.load)  # type: ignore[method-assign,assignment]
        before = state_of(scheduler)
        with contextlib.suppress(InjectedFaultError):
            scheduler.schedule()
        assert fault.fired
        assert state_of(scheduler) == before
        assert list(scheduler.waiting_request_ids()) == ["r0", "r1"]
        executor = DeterministicExecutor()
        while scheduler.num_unfinished:
            plan = scheduler.schedule()
            scheduler.update(plan, executor.execute(plan))
        assert scheduler.kv.num_free_pages == scheduler.kv.num_pages

    @pytest.mark.parametrize("part", ["kv.claim", "kv.extend_many", "kv.gather", "build_step_plan", "kv.register_many"])
    def test_a_failed_claim_or_registration_restores_the_cache_exactly(self, part: str) -> None:
        """A step that claimed idle cached pages (or named new ones) and then failed leaves the LRU order as it was."""
        scheduler = Scheduler(SchedulerConfig(num_pages=64, page_size=4), preset("vllm"))
        executor = DeterministicExecutor()
        for index, length in enumerate((24, 11, 30)):  # three prompts sharing their first pages
            scheduler.add_request(request_of(index, (length, 2, 0)))
            while scheduler.num_unfinished:
                warm = scheduler.schedule()
                scheduler.update(warm, executor.execute(warm))
        assert len(scheduler.kv.idle_cached_pages()) > 6
        scheduler.add_request(request_of(9, (28, 2, 0)))
        fault = Fault(0)
        with installed(scheduler, part, fault):
            before = state_of(scheduler)
            plan: StepPlan | None = None
            with contextlib.suppress(InjectedFaultError):
                plan = scheduler.schedule()
            if plan is not None:  # the fault is in update(): compare with the state it started from
                before = state_of(scheduler)
                with contextlib.suppress(InjectedFaultError):
                    scheduler.update(plan, executor.execute(plan))
            assert fault.fired
            with fault.pause():
                assert state_of(scheduler) == before
                scheduler.check_invariants()

    def test_a_queue_key_that_does_not_compare_is_refused(self) -> None:
        """A plugin queue order whose key cannot be compared with the others' is a typed error, and nothing changes."""

        @attrs.frozen
        class Mixed:
            def key(self, request: Request) -> object:
                return None if request.request_id == "odd" else (request.arrival_time,)

        scheduler = Scheduler(SchedulerConfig(num_pages=64), attrs.evolve(preset("vllm"), queue_order=Mixed()))
        scheduler.add_request(Request("a", prompt_len=4))
        before = state_of(scheduler)
        with pytest.raises(InvalidPlanError, match="does not compare"):
            scheduler.add_request(Request("odd", prompt_len=4))
        assert state_of(scheduler) == before
        scheduler.add_request(Request("b", prompt_len=4))
        assert list(scheduler.waiting_request_ids()) == ["a", "b"]

    def test_abort_and_fail_are_atomic(self) -> None:
        """An abort that fails part-way leaves the request held and the KV as it was."""
        scheduler = Scheduler(SchedulerConfig(num_pages=64, page_size=4), preset("vllm"))
        scheduler.add_request(request_of(0, (8, 3, 0)))
        plan = scheduler.schedule()
        scheduler.update(plan, DeterministicExecutor().execute(plan))
        fault = Fault(0)
        scheduler._arrays.unload = fault.wrap(scheduler._arrays.unload)  # type: ignore[method-assign,assignment]
        before = state_of(scheduler)
        with pytest.raises(InjectedFaultError):
            scheduler.abort("r0")
        assert state_of(scheduler) == before
        scheduler.check_invariants()
        assert scheduler.fail("r0", "gone").status.value == "failed"

    @pytest.mark.parametrize("fail_in", ["park", "tail_first"])
    def test_a_finish_that_fails_while_releasing_pages_changes_nothing(self, fail_in: str) -> None:
        """A fault after the freed tables' references are dropped (parking cached pages) leaves them as they were."""
        options = PolicyOptions(enable_prefix_caching=True)
        scheduler = Scheduler(SchedulerConfig(num_pages=64, page_size=4), load_policy("vllm", options))
        blocks = PromptBlocks(4, (1, 2, 3))
        scheduler.add_request(Request("a", prompt_len=12, max_new_tokens=2, ignore_eos=True, prompt_blocks=blocks))
        scheduler.add_request(Request("b", prompt_len=12, max_new_tokens=9, ignore_eos=True, prompt_blocks=blocks))
        executor = DeterministicExecutor()
        plan = scheduler.schedule()
        scheduler.update(plan, executor.execute(plan))  # "a" and "b" share their three prompt pages
        plan = scheduler.schedule()
        result = executor.execute(plan)  # its update finishes "a"
        fault = Fault(0)
        if fail_in == "park":
            cache = scheduler._kv._cache
            assert cache is not None
            cache.park = fault.wrap(cache.park)  # type: ignore[method-assign,assignment]
        else:
            patch = mock.patch("phasesched.kv._tail_first", fault.wrap(phasesched.kv._tail_first))
            patch.start()
        before = state_of(scheduler)
        try:
            with pytest.raises(InjectedFaultError):
                scheduler.update(plan, result)
            assert state_of(scheduler) == before
            scheduler.check_invariants()
            assert [f.request_id for f in scheduler.update(plan, result).finished] == ["a"]
        finally:
            if fail_in != "park":
                patch.stop()
        scheduler.check_invariants()

    def test_advance_is_atomic(self) -> None:
        """A decode run whose finishing step fails part-way leaves the scheduler as it was."""
        scheduler = Scheduler(SchedulerConfig(num_pages=64, page_size=4), preset("vllm"))
        scheduler.add_request(Request("a", prompt_len=4, max_new_tokens=6, ignore_eos=True))
        plan = scheduler.schedule()
        scheduler.update(plan, DeterministicExecutor().execute(plan))
        run = scheduler.decode_run(100)
        assert run is not None
        fault = Fault(0)
        scheduler._arrays.unload = fault.wrap(scheduler._arrays.unload)  # type: ignore[method-assign,assignment]
        before = state_of(scheduler)
        with pytest.raises(InjectedFaultError):
            scheduler.advance(run, run.max_steps)  # the last step finishes "a", and retiring it fails
        assert state_of(scheduler) == before
        assert [f.request_id for f in scheduler.advance(run, run.max_steps)] == ["a"]


BAD_VALUES = st.one_of(
    st.just(float("nan")),
    st.just(float("inf")),
    st.floats(allow_nan=False, allow_infinity=False),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.none(),
    st.text(max_size=3),
)


class TestRequestsAtTheDoor:
    @given(
        field=st.sampled_from(["prompt_len", "max_new_tokens", "eos_token_id", "priority", "arrival_time"]),
        value=BAD_VALUES,
    )
    @settings(deadline=None, max_examples=200)
    def test_a_request_is_refused_or_served(self, field: str, value: object) -> None:
        """Any value in any field is refused with a PhaseschedError at construction, or the request is served whole."""
        kwargs: dict[str, Any] = {"prompt_len": 5, "max_new_tokens": 3, field: value}
        try:
            request = Request("x", **kwargs)
        except PhaseschedError:
            return
        scheduler = Scheduler(SchedulerConfig(num_pages=64, page_size=4, max_model_len=64), preset("vllm"))
        good = Request("good", prompt_len=4, max_new_tokens=2)
        scheduler.add_request(good)
        with contextlib.suppress(PhaseschedError):
            scheduler.add_request(request)
        executor = DeterministicExecutor()
        while scheduler.num_unfinished:
            plan = scheduler.schedule()
            scheduler.update(plan, executor.execute(plan))
            scheduler.check_invariants()

    @given(ids=st.lists(st.one_of(st.integers(-(2**40), 2**40), st.floats()), min_size=1, max_size=5))
    @settings(deadline=None, max_examples=100)
    def test_token_ids_are_int32_or_refused(self, ids: list[object]) -> None:
        """Prompt and stop token ids outside [0, 2**31) or not ints are refused with a typed error."""
        valid = all(type(t) is int and 0 <= t < 2**31 for t in ids)
        for kwargs in ({"prompt_token_ids": ids}, {"prompt_len": 3, "stop_token_ids": ids}):
            assert accepted(kwargs) == valid


def accepted(kwargs: dict[str, Any]) -> bool:
    """Whether ``Request("x", **kwargs)`` is accepted (a refusal must be a PhaseschedError)."""
    try:
        Request("x", **kwargs)
    except PhaseschedError:
        return False
    return True
