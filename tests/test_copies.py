"""A scheduler copies and pickles by value: the copy plans what the original does, and no state is shared.

Its token ids and KV tables live in reserved, lazily mapped memory (see :mod:`phasesched.mapped`):
a copy must carry what they hold, not the reserved space (written out in full, a batch of 1,024
requests of 128K tokens pickled to 570 MB), and views of its arrays must show the copy's arrays.
"""

from __future__ import annotations

import contextlib
import copy
import pickle

import numpy as np
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
    SchedulingPolicy,
    load_policy,
)
from tests.test_mixed_fast_path import VOCAB, Arrival, arrivals, plan_shape, policies, request_of


def by_value(scheduler: Scheduler, how: str) -> Scheduler:
    copied: Scheduler = copy.deepcopy(scheduler) if how == "deepcopy" else pickle.loads(pickle.dumps(scheduler))  # noqa: S301
    return copied


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    policy=policies(),
    workload=st.lists(arrivals(), min_size=1, max_size=10),
    copy_at=st.integers(0, 30),
    how=st.sampled_from(("deepcopy", "pickle")),
)
def test_a_copy_plans_what_the_original_plans(
    policy: SchedulingPolicy, workload: list[Arrival], copy_at: int, how: str
) -> None:
    """Copied mid-run, the two go on in lockstep: the same plans and outcomes to the end."""
    config = SchedulerConfig(num_pages=48, page_size=4, max_model_len=256)
    original, twin = Scheduler(config, policy), None
    executor = DeterministicExecutor(vocab_size=VOCAB)
    pending = sorted(enumerate(workload), key=lambda item: item[1].step)
    for step in range(60):
        if step == copy_at:
            twin = by_value(original, how)
        schedulers = [original] if twin is None else [original, twin]
        while pending and pending[0][1].step <= step:
            index, arrival = pending.pop(0)
            for scheduler in schedulers:
                with contextlib.suppress(RequestRejectedError):
                    scheduler.add_request(request_of(index, arrival), precomputed_tokens=arrival.precomputed)
        plans = [scheduler.schedule(float(step)) for scheduler in schedulers]
        assert len({repr(plan_shape(plan)) for plan in plans}) == 1
        result = executor.execute(plans[0])
        outcomes = [scheduler.update(plan, result) for scheduler, plan in zip(schedulers, plans, strict=True)]
        assert len({repr((o.request_ids, o.new_token_ids.tolist(), o.finished)) for o in outcomes}) == 1
    if twin is not None:
        assert original.kv.cache_stats == twin.kv.cache_stats
        assert original.kv.num_free_pages == twin.kv.num_free_pages


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_reserved_scheduler_copies_what_it_holds_not_what_it_reserved(how: str) -> None:
    """Room for 1,024 requests of 128K tokens is 512 MB of token ids, unwritten: a copy carries a few KB."""
    options = PolicyOptions(max_model_len=131072, max_num_seqs=1024, enable_prefix_caching=True)
    config = SchedulerConfig(num_pages=4096, page_size=16, max_model_len=131072)
    scheduler = Scheduler(config, load_policy("vllm", options))
    for i in range(4):
        scheduler.add_request(Request(f"r{i}", prompt_token_ids=list(range(1 + i, 300)), max_new_tokens=8))
    executor = DeterministicExecutor()
    for _ in range(3):
        plan = scheduler.schedule(0.0)
        scheduler.update(plan, executor.execute(plan))
    assert scheduler.kv.page_counts.any()
    assert len(pickle.dumps(scheduler)) < 1 << 20
    twin = by_value(scheduler, how)
    for _ in range(8):
        plans = [s.schedule(0.0) for s in (scheduler, twin)]
        assert plan_shape(plans[0]) == plan_shape(plans[1])
        result = executor.execute(plans[0])
        for s, plan in zip((scheduler, twin), plans, strict=True):
            s.update(plan, result)
    assert np.array_equal(scheduler.kv.page_counts, twin.kv.page_counts)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_hands_out_read_only_plans(how: str) -> None:
    """Copied while its steady steps share arrays from plan to plan, a scheduler still hands out read-only ones."""
    scheduler = Scheduler(SchedulerConfig(num_pages=64, page_size=4), load_policy("vllm"))
    for i in range(3):
        scheduler.add_request(Request(f"r{i}", prompt_token_ids=[5, 6, 7 + i], max_new_tokens=30))
    executor = DeterministicExecutor(vocab_size=VOCAB)
    for _ in range(6):  # past the prompts: steady steps, each fed by the last update
        plan = scheduler.schedule(0.0)
        scheduler.update(plan, executor.execute(plan))
    twin = by_value(scheduler, how)
    for _ in range(10):
        plan = twin.schedule(0.0)
        for name in ("start", "num_new", "kv_indptr", "kv_indices", "kv_len", "kv_last_page_len", "input_ids"):
            assert not getattr(plan, name).flags.writeable, name
        outcome = twin.update(plan, executor.execute(plan))
        assert not outcome.new_token_ids.flags.writeable
