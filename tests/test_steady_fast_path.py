"""The steady decode fast path builds exactly the plans the policy would."""

from __future__ import annotations

import contextlib

import attrs
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


def plans(fast: bool, policy_name: str, lengths: list[tuple[int, int, int]], pages: int) -> list[tuple]:
    """Every plan of a run, as comparable tuples (requests arrive at the step they name)."""
    scheduler = Scheduler(
        SchedulerConfig(num_pages=pages, page_size=4, max_model_len=512),
        load_policy(policy_name, PolicyOptions(max_model_len=512, chunk_size=16)),
    )
    scheduler._steady_fast_path = fast
    executor = DeterministicExecutor(vocab_size=50)
    pending = sorted(enumerate(lengths), key=lambda item: item[1][2])
    seen = []
    for step in range(400):
        while pending and pending[0][1][2] <= step:
            index, (prompt, output, arrival) = pending.pop(0)
            request = Request(
                f"r{index}",
                prompt_token_ids=list(range(prompt)),
                max_new_tokens=output,
                arrival_time=float(arrival),
                priority=index % 3,
            )
            with contextlib.suppress(RequestRejectedError):  # too big for this cache: both runs skip it
                scheduler.add_request(request)
        if not pending and not scheduler.num_unfinished:
            break
        plan = scheduler.schedule(float(step))
        seen.append(
            (
                plan.request_ids,
                plan.num_new.tolist(),
                plan.start.tolist(),
                plan.kv_indices.tolist(),
                plan.preempted,
                None if plan.input_ids is None else plan.input_ids.tolist(),
            )
        )
        scheduler.update(plan, executor.execute(plan))
        scheduler.check_invariants()
    return seen


@given(
    policy=st.sampled_from(["vllm", "sarathi", "sglang", "orca", "trtllm-equal-progress", "vllm-priority"]),
    lengths=st.lists(st.tuples(st.integers(1, 60), st.integers(1, 30), st.integers(0, 40)), min_size=1, max_size=8),
    pages=st.integers(20, 80),
)
@settings(deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow])
def test_fast_path_matches_the_policy(policy: str, lengths: list[tuple[int, int, int]], pages: int) -> None:
    """With or without the fast path, the scheduler produces identical plans step for step."""
    assert plans(True, policy, lengths, pages) == plans(False, policy, lengths, pages)


class Counting:
    """A phase priority that counts how often the scheduler asks it."""

    schedules_every_decode = True

    def __init__(self, inner: object) -> None:
        self.inner, self.calls = inner, 0

    def select(self, view: object, builder: object) -> object:
        self.calls += 1
        return self.inner.select(view, builder)  # type: ignore[attr-defined]


def test_fast_path_skips_the_policy_in_steady_decoding() -> None:
    """Once every request decodes and nothing waits, steps do not ask the policy."""
    policy = load_policy("vllm")
    counting = Counting(policy.priority)
    scheduler = Scheduler(SchedulerConfig(num_pages=64), attrs.evolve(policy, priority=counting))
    scheduler.add_request(Request("a", prompt_len=8, max_new_tokens=20))
    executor = DeterministicExecutor()
    steps = 0
    while scheduler.num_unfinished:
        plan = scheduler.schedule()
        scheduler.update(plan, executor.execute(plan))
        steps += 1
    assert steps == 20
    assert counting.calls == 1  # only the prefill step asked


def test_policies_that_do_not_declare_are_always_asked() -> None:
    """A plugin priority without the declaration is asked every step."""
    policy = load_policy("vllm")
    counting = Counting(policy.priority)
    counting.schedules_every_decode = False  # type: ignore[misc]
    scheduler = Scheduler(SchedulerConfig(num_pages=64), attrs.evolve(policy, priority=counting))
    scheduler.add_request(Request("a", prompt_len=8, max_new_tokens=5))
    executor = DeterministicExecutor()
    while scheduler.num_unfinished:
        plan = scheduler.schedule()
        scheduler.update(plan, executor.execute(plan))
    assert counting.calls == 5
