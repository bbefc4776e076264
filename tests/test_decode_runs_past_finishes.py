"""Decode runs that pass finishes leave the scheduler as stepping one by one does."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from phasesched import (
    DeterministicExecutor,
    PolicyOptions,
    Request,
    RequestRejectedError,
    Scheduler,
    SchedulerConfig,
    load_policy,
)
from phasesched.prefix import PromptBlocks
from tests.strategies import Fault, InjectedFaultError
from tests.test_atomicity import state_of

PAGE = 4


@st.composite
def request_lists(draw: st.DrawFn) -> list[Request]:
    """Length-only requests whose prompts share block-hashed prefixes, so the cache names, parks and evicts.

    Some come first and leave after their prefill, leaving idle cached pages that later steps evict.
    """
    out = []
    for index in range(draw(st.integers(0, 4))):
        blocks = PromptBlocks(PAGE, tuple((10 + index) * 1000 + b for b in range(10)))
        out.append(Request(f"f{index}", prompt_len=40, max_new_tokens=1, prompt_blocks=blocks))
    for index in range(draw(st.integers(1, 10))):
        prompt, output, family = draw(st.integers(1, 40)), draw(st.integers(1, 60)), draw(st.integers(0, 2))
        blocks = PromptBlocks(PAGE, tuple(family * 1000 + b for b in range(-(-prompt // PAGE))))
        out.append(
            Request(f"r{index}", prompt_len=prompt, max_new_tokens=output, ignore_eos=True, prompt_blocks=blocks)
        )
    return out


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[Callable[[], Scheduler], int, float]:
    """A way to build a scheduler given a workload, steps to take before looking for a run, and where to cut it."""
    # Mostly with the cache: a full LRU makes steps evict, and the run is then taken segment by segment.
    options = PolicyOptions(max_model_len=512, enable_prefix_caching=draw(st.integers(0, 2)) > 0)
    policy = load_policy(draw(st.sampled_from(["vllm", "sarathi", "sglang", "orca", "trtllm-equal-progress"])), options)
    config = SchedulerConfig(
        num_pages=draw(st.sampled_from([24, 28, 32, 40, 60, 120])), page_size=PAGE, max_model_len=512
    )
    workload = draw(request_lists())

    def build() -> Scheduler:
        scheduler = Scheduler(config, policy)
        for request in workload:
            with contextlib.suppress(RequestRejectedError):  # too big for this cache: both twins skip it
                scheduler.add_request(request)
        return scheduler

    return build, draw(st.integers(0, 30)), draw(st.floats(0.0, 1.0))


Step = tuple[tuple[str, ...], list[int], tuple[str, ...], list[str]]


def step(scheduler: Scheduler, executor: DeterministicExecutor) -> Step:
    """One step; what it scheduled and finished."""
    plan = scheduler.schedule()
    outcome = scheduler.update(plan, executor.execute(plan))
    return plan.request_ids, plan.num_new.tolist(), plan.preempted, [f.request_id for f in outcome.finished]


def cache_state(scheduler: Scheduler) -> tuple[object, ...]:
    """What the KV shows, page ids aside: taking a run at once may hand out other (interchangeable) pages."""
    kv = scheduler._kv
    cache = kv._cache
    names = [] if cache is None else cache._hash_of[kv.idle_cached_pages()].tolist()
    ids = scheduler.running_request_ids()
    return (
        ids,
        [(scheduler.status(i), scheduler.progress(i)) for i in ids],
        scheduler.kv.num_free_pages,
        scheduler.kv.num_cached_pages,
        scheduler.kv.page_counts.tolist(),
        sorted(scheduler.kv.refcounts.tolist()),
        names,
        scheduler.kv.cache_stats,
        scheduler.pending_releases,
    )


@given(scenarios())
@settings(deadline=None, max_examples=400, suppress_health_check=[HealthCheck.too_slow])
def test_a_run_past_finishes_is_stepping(scenario: tuple[Callable[[], Scheduler], int, float]) -> None:
    """Taking k steps of a run that passes finishes equals k steps one by one, and so does everything after."""
    assert_run_is_stepping(*scenario)


@pytest.mark.parametrize("num_pages", [21, 64])  # the steps evict cached pages (taken segment by segment), or not
@pytest.mark.parametrize("count", [1, 2, 3, 8, 12, 19])
def test_a_run_past_finishes_is_stepping_whether_it_evicts_or_not(num_pages: int, count: int) -> None:
    def build() -> Scheduler:
        return started(num_pages, cache=True, outputs=(3, 9, 20))

    assert_run_is_stepping(build, 0, count / 19, expect_run=True)


def assert_run_is_stepping(
    build: Callable[[], Scheduler], warmup: int, fraction: float, *, expect_run: bool = False
) -> None:
    """Step two twins alike past ``warmup`` steps, to a run passing finishes; take a fraction of it at once in one."""
    fast, slow, executor = build(), build(), DeterministicExecutor()
    run = None
    for taken in itertools.count():
        if not fast.num_unfinished:
            assert not expect_run
            return
        run = fast.decode_run(4096, past_finishes=True) if taken >= warmup else None
        if run is not None and run.passes_finishes:
            break
        assert step(fast, executor) == step(slow, executor)
    assert run is not None
    assert slow.decode_run(4096).max_steps < run.max_steps  # type: ignore[union-attr] # the first finish ends it
    count = max(1, round(fraction * run.max_steps))
    finished = [f.request_id for f in fast.advance(run, count)]
    stepped = [step(slow, executor) for _ in range(count)]
    assert all(set(ids) <= set(run.request_ids) and set(num_new) == {1} and not out for ids, num_new, out, _ in stepped)
    assert finished == [request_id for *_, done in stepped for request_id in done]
    assert cache_state(fast) == cache_state(slow)
    fast.check_invariants()
    while slow.num_unfinished:  # and the rest of the workload runs alike
        assert step(fast, executor) == step(slow, executor)
    assert not fast.num_unfinished
    assert cache_state(fast) == cache_state(slow)


def test_runs_pass_finishes_only_when_asked_and_nothing_waits() -> None:
    scheduler = Scheduler(SchedulerConfig(num_pages=256, page_size=PAGE), load_policy("vllm"))
    for index, output in enumerate((3, 9, 20)):
        scheduler.add_request(Request(f"r{index}", prompt_len=8, max_new_tokens=output, ignore_eos=True))
    plan = scheduler.schedule()
    scheduler.update(plan, DeterministicExecutor().execute(plan))
    first = scheduler.decode_run(100)
    assert first is not None
    assert (first.max_steps, first.passes_finishes) == (2, False)
    run = scheduler.decode_run(100, past_finishes=True)
    assert run is not None
    assert (run.max_steps, run.passes_finishes, run.finish_at.tolist()) == (19, True, [2, 8, 19])
    assert scheduler.decode_run(5, past_finishes=True).max_steps == 5  # type: ignore[union-attr]
    scheduler.add_request(Request("late", prompt_len=8, max_new_tokens=4, ignore_eos=True))
    blocked = scheduler.decode_run(100, past_finishes=True)
    assert blocked is None or not blocked.passes_finishes  # it may be admitted when "r0" finishes


def started(num_pages: int, *, cache: bool, outputs: tuple[int, ...]) -> Scheduler:
    """Three 8-token prompts past their prefill (after one 40-token request has come and gone, its pages cached)."""
    options = PolicyOptions(enable_prefix_caching=cache)
    scheduler = Scheduler(SchedulerConfig(num_pages=num_pages, page_size=PAGE), load_policy("vllm", options))
    scheduler.add_request(
        Request("old", prompt_len=40, max_new_tokens=1, prompt_blocks=PromptBlocks(PAGE, tuple(range(10))))
    )
    for index, output in enumerate(outputs):
        blocks = PromptBlocks(PAGE, (100 + index, 200 + index))
        scheduler.add_request(
            Request(f"r{index}", prompt_len=8, max_new_tokens=output, ignore_eos=True, prompt_blocks=blocks)
        )
    while scheduler.num_waiting or scheduler.decode_run(100) is None:  # until all three decode
        plan = scheduler.schedule()
        scheduler.update(plan, DeterministicExecutor().execute(plan))
    return scheduler


@pytest.mark.parametrize(("cache", "num_pages", "at_once"), [(False, 64, True), (True, 64, True), (True, 21, False)])
def test_advance_past_finishes_is_atomic(cache: bool, num_pages: int, at_once: bool) -> None:
    """A run whose last finish fails part-way leaves the scheduler as it was, earlier finishes included.

    Taken at once, both finishes are one retirement; segment by segment (when the steps need
    cached pages evicted), the second one fails after the first has been applied.
    """
    scheduler = started(num_pages, cache=cache, outputs=(3, 9, 20))
    run = scheduler.decode_run(100, past_finishes=True)
    assert run is not None
    assert run.max_steps >= 12
    growth = int(scheduler.kv.pages_to_grow(run.slots, run.kv_len - 1 + run.steps_of(12)).sum())
    assert (growth <= scheduler.kv.num_free_pages - scheduler.kv.num_cached_pages) is at_once
    fault = Fault(0 if at_once else 1)
    scheduler._arrays.unload = fault.wrap(scheduler._arrays.unload)  # type: ignore[method-assign,assignment]
    before = state_of(scheduler)
    with pytest.raises(InjectedFaultError):
        scheduler.advance(run, 12)  # "r0" finishes after 2 steps, "r1" after 8
    assert state_of(scheduler) == before
    assert [f.request_id for f in scheduler.advance(run, 12)] == ["r0", "r1"]
    scheduler.check_invariants()
