"""The steady decode fast path builds exactly the plans the policy would, and trusts no plugin."""

from __future__ import annotations

import contextlib
from unittest import mock

import attrs
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from phasesched import (
    DeterministicExecutor,
    Request,
    RequestRejectedError,
    Scheduler,
    SchedulerConfig,
    SchedulingPolicy,
    Selection,
    StepResult,
    load_policy,
)
from phasesched.policies import PhasePriority
from phasesched.policies.builder import BatchBuilder
from phasesched.view import SchedulerView
from tests.strategies import PRESETS, CappedDecodes, PassThrough, Shape, preset, priorities, request_of, workloads

PlanShape = tuple[object, ...]
METADATA = ("slots", "prompt_len", "samples", "qo_indptr", "kv_indptr", "kv_last_page_len", "kv_len", "positions")


def plans(policy: SchedulingPolicy, shapes: list[Shape], pages: int) -> list[PlanShape]:
    """Every plan of a run, as comparable tuples (requests arrive at the step they name)."""
    scheduler = Scheduler(SchedulerConfig(num_pages=pages, page_size=4, max_model_len=512), policy)
    executor = DeterministicExecutor(vocab_size=50)
    pending = sorted(enumerate(shapes), key=lambda item: item[1][2])
    seen: list[PlanShape] = []
    for step in range(400):
        while pending and pending[0][1][2] <= step:
            index, shape = pending.pop(0)
            with contextlib.suppress(RequestRejectedError):  # too big for this cache: both runs skip it
                scheduler.add_request(request_of(index, shape))
        if not pending and not scheduler.num_unfinished:
            break
        plan = scheduler.schedule(float(step))
        # The steady path keeps the last plan's pages and extends them: they must be the tables' pages now.
        indptr, indices = scheduler._kv.gather(plan.slots, scheduler.kv.page_counts[plan.slots])
        assert plan.kv_indptr.tolist() == indptr.tolist()
        assert plan.kv_indices.tolist() == indices.tolist()
        seen.append(
            (
                plan.request_ids,
                plan.num_new.tolist(),
                plan.start.tolist(),
                plan.kv_indices.tolist(),
                plan.preempted,
                None if plan.input_ids is None else plan.input_ids.tolist(),
                # the rest of the metadata and the outcome: the steady step builds them its own way
                [getattr(plan, name).tolist() for name in METADATA],
                plan.step_id,
                plan.released,
                plan.new_requests,
            )
        )
        outcome = scheduler.update(plan, executor.execute(plan))
        seen.append((outcome.request_ids, outcome.new_token_ids.tolist(), outcome.finished))
        scheduler.check_invariants()
    return seen


def asked_every_step(policy: SchedulingPolicy) -> SchedulingPolicy:
    """``policy`` with its priority behind a plugin wrapper, which the scheduler asks every step."""
    return attrs.evolve(policy, priority=PassThrough(policy.priority))


SETTINGS = settings(deadline=None, max_examples=300, suppress_health_check=[HealthCheck.too_slow])


class TestFastPathEquivalence:
    @given(name=st.sampled_from(PRESETS), shapes=workloads(), pages=st.integers(20, 80))
    @settings(SETTINGS, max_examples=150)
    def test_presets_match_the_policy(self, name: str, shapes: list[Shape], pages: int) -> None:
        """With or without the fast path, every preset produces identical plans step for step."""
        policy = preset(name)
        assert plans(policy, shapes, pages) == plans(asked_every_step(policy), shapes, pages)

    @given(
        name=st.sampled_from(PRESETS),
        shapes=workloads(),
        pages=st.integers(20, 80),
        seats=st.integers(1, 3),
    )
    @settings(SETTINGS, max_examples=150)
    def test_presets_match_the_policy_while_requests_wait_for_a_seat(
        self, name: str, shapes: list[Shape], pages: int, seats: int
    ) -> None:
        """With a sequence cap that binds, so that requests wait beside steady decodes, the plans are identical too."""
        policy = preset(name)
        policy = attrs.evolve(policy, budget=attrs.evolve(policy.budget, max_num_seqs=seats))
        assert plans(policy, shapes, pages) == plans(asked_every_step(policy), shapes, pages)

    @given(priority=priorities(), shapes=workloads(max_size=6), pages=st.integers(16, 64))
    @SETTINGS
    def test_plugin_like_priorities_match_the_policy(
        self, priority: PhasePriority, shapes: list[Shape], pages: int
    ) -> None:
        """Built-in, wrapped and lying priorities give the same plans whether or not the fast path may apply."""
        policy = attrs.evolve(preset("vllm"), priority=priority)
        assert plans(policy, shapes, pages) == plans(asked_every_step(policy), shapes, pages)


class Counting:
    """A plugin phase priority that counts how often the scheduler asks it."""

    schedules_every_decode = True  # the old, unchecked opt-in: no longer trusted

    def __init__(self, inner: PhasePriority) -> None:
        self.inner, self.calls = inner, 0

    def select(self, view: SchedulerView, builder: BatchBuilder) -> Selection:
        """The inner priority's selection, counted."""
        self.calls += 1
        return self.inner.select(view, builder)


def run_counting(priority: PhasePriority, max_new_tokens: int) -> int:
    """Steps one request to the end under ``priority``; return how many steps it took."""
    scheduler = Scheduler(SchedulerConfig(num_pages=64), attrs.evolve(load_policy("vllm"), priority=priority))
    scheduler.add_request(Request("a", prompt_len=8, max_new_tokens=max_new_tokens))
    executor = DeterministicExecutor()
    steps = 0
    while scheduler.num_unfinished:
        plan = scheduler.schedule()
        scheduler.update(plan, executor.execute(plan))
        steps += 1
    return steps


class TestFastPathTrust:
    def test_builtin_priorities_are_not_asked_in_steady_decoding(self) -> None:
        """Once every request decodes and nothing waits, a built-in priority's steps are built without it."""
        scheduler = Scheduler(SchedulerConfig(num_pages=64), load_policy("vllm"))
        scheduler.add_request(Request("a", prompt_len=8, max_new_tokens=20))
        executor = DeterministicExecutor()
        plan = scheduler.schedule()
        scheduler.update(plan, executor.execute(plan))
        assert scheduler.decode_run(100) is not None  # the steady path applies from here on

    def test_plugins_are_asked_every_step_whatever_they_declare(self) -> None:
        """A plugin priority is asked every step, even one that declares ``schedules_every_decode``."""
        counting = Counting(load_policy("vllm").priority)
        assert run_counting(counting, 20) == 20
        assert counting.calls == 20

    def test_a_lying_declaration_does_not_schedule_every_decode(self) -> None:
        """A priority that declares every decode but caps them gets its cap, not every decode."""
        policy = attrs.evolve(load_policy("vllm"), priority=CappedDecodes(1))
        scheduler = Scheduler(SchedulerConfig(num_pages=64), policy)
        executor = DeterministicExecutor()
        for i in range(3):
            scheduler.add_request(Request(f"r{i}", prompt_len=4, max_new_tokens=5))
        plan = scheduler.schedule()
        scheduler.update(plan, executor.execute(plan))  # the three prompts, then one decode per step
        for _ in range(4):
            plan = scheduler.schedule()
            assert plan.batch_size == 1
            scheduler.update(plan, executor.execute(plan))

    def test_subclasses_of_builtins_are_not_trusted(self) -> None:
        """Only the built-in classes themselves qualify for the fast path, not subclasses that may override them."""
        from phasesched.policies import DecodeFirst  # noqa: PLC0415 -- local to this test

        @attrs.frozen
        class Mine(DecodeFirst):
            pass

        scheduler = Scheduler(SchedulerConfig(num_pages=64), attrs.evolve(load_policy("vllm"), priority=Mine()))
        scheduler.add_request(Request("a", prompt_len=8, max_new_tokens=20))
        plan = scheduler.schedule()
        scheduler.update(plan, DeterministicExecutor().execute(plan))
        assert scheduler.decode_run(100) is None


class TestSteadyUpdate:
    def test_a_failed_steady_update_puts_back_the_last_tokens(self) -> None:
        """Its undo restores each request's last token from the plan's input ids: the next plan feeds them again."""
        scheduler = Scheduler(SchedulerConfig(num_pages=64, page_size=4), load_policy("vllm"))
        for i in range(3):
            scheduler.add_request(Request(f"r{i}", prompt_token_ids=[5, 6, 7], max_new_tokens=30))
        executor = DeterministicExecutor(vocab_size=50)
        for _ in range(6):  # past the prompts, into steady steps fed by the last update
            plan = scheduler.schedule()
            scheduler.update(plan, executor.execute(plan))
        plan = scheduler.schedule()
        assert plan.input_ids is not None
        tokens = scheduler._arrays.tokens
        with mock.patch.object(tokens, "write", side_effect=MemoryError), pytest.raises(MemoryError):
            scheduler.update(plan, StepResult(step_id=plan.step_id, token_ids=np.full(3, 42)))
        scheduler.abandon(plan)
        again = scheduler.schedule()
        assert again.input_ids is not None
        assert again.input_ids.tolist() == plan.input_ids.tolist()
        assert again.kv_len.tolist() == plan.kv_len.tolist()

    def test_fed_steps_match_gathered_ones(self) -> None:
        """Steps fed by the last update hand out exactly what gathering from the state gives, read-only."""
        scheduler = Scheduler(SchedulerConfig(num_pages=64, page_size=4), load_policy("vllm"))
        for i in range(3):
            scheduler.add_request(Request(f"r{i}", prompt_token_ids=[5, 6, 7 + i], max_new_tokens=30))
        executor = DeterministicExecutor(vocab_size=50)
        arrays = scheduler._arrays
        for _ in range(20):
            plan = scheduler.schedule()
            assert plan.input_ids is not None
            if plan.num_decodes == plan.batch_size:  # past the prompts
                assert plan.input_ids.tolist() == arrays.last_token[plan.slots].tolist()
            assert plan.kv_len.tolist() == (arrays.computed[plan.slots] + plan.num_new).tolist()
            assert plan.kv_last_page_len.tolist() == ((plan.kv_len - 1) % 4 + 1).tolist()
            outcome = scheduler.update(plan, executor.execute(plan))
            assert not outcome.new_token_ids.flags.writeable
