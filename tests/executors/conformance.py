"""What every executor must do with any plan, as a test class to subclass per executor.

A subclass provides the ``make_executor(num_pages, page_size)`` fixture and ``VOCAB_SIZE``; pytest
collects the ``test_*`` methods for it. Nothing here knows which executor runs: only the
:class:`phasesched.Executor` contract and the scheduler's view of results.

Executors that hold no KV cache (the deterministic and simulated ones) set ``HOLDS_KV = False``:
they cannot see an out-of-range page, so that one check does not apply to them. One that makes no
timing claim (the deterministic one) sets ``REPORTS_DURATION = False``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest

from phasesched import (
    Executor,
    InvalidPlanError,
    PolicyOptions,
    Request,
    Scheduler,
    SchedulerConfig,
    StepPlan,
    load_policy,
)
from phasesched.plan import build_step_plan

MakeExecutor = Callable[[int, int], Executor]


def _requests(vocab_size: int, lengths: tuple[int, ...], max_new_tokens: int) -> list[Request]:
    rng = np.random.default_rng(7)
    return [
        Request(f"c{i}", prompt_token_ids=rng.integers(0, vocab_size, n).tolist(), max_new_tokens=max_new_tokens)
        for i, n in enumerate(lengths)
    ]


def _run(
    executor: Executor, scheduler: Scheduler, *, timed: bool = True, max_steps: int = 2000
) -> tuple[dict[str, tuple[int, ...]], list[StepPlan]]:
    outputs: dict[str, tuple[int, ...]] = {}
    plans: list[StepPlan] = []
    for _ in range(max_steps):
        if not scheduler.num_unfinished:
            return outputs, plans
        plan = scheduler.schedule()
        result = executor.execute(plan)
        result.check_against(plan)
        if timed and not plan.is_empty:
            assert result.duration_s is not None
            assert math.isfinite(result.duration_s)
            assert result.duration_s > 0
        outcome = scheduler.update(plan, result)
        scheduler.check_invariants()
        plans.append(plan)
        outputs |= {f.request_id: tuple(f.output_token_ids or ()) for f in outcome.finished}
    msg = f"still {scheduler.num_unfinished} requests after {max_steps} steps"
    raise AssertionError(msg)


def _single_plan(page: int, page_size: int, vocab_size: int) -> StepPlan:
    """One 3-token prefill slice in ``page`` (which may lie outside the cache)."""
    return build_step_plan(
        step_id=0,
        request_ids=("solo",),
        slots=np.zeros(1, dtype=np.int32),
        start=np.zeros(1, dtype=np.int32),
        num_new=np.full(1, 3, dtype=np.int32),
        prompt_len=np.full(1, 3, dtype=np.int32),
        samples=np.ones(1, dtype=bool),
        kv_indptr=np.array([0, 1], dtype=np.int32),
        kv_indices=np.array([page], dtype=np.int32),
        page_size=page_size,
        input_ids=(np.arange(3) % vocab_size).astype(np.int32),
    )


class ExecutorConformance:
    """The executor contract; subclass with a ``make_executor`` fixture and ``VOCAB_SIZE``."""

    VOCAB_SIZE: int
    HOLDS_KV = True
    REPORTS_DURATION = True

    def test_is_an_executor(self, make_executor: MakeExecutor) -> None:
        """It satisfies phasesched's Executor protocol."""
        assert isinstance(make_executor(8, 4), Executor)

    def test_empty_plan(self, make_executor: MakeExecutor) -> None:
        """An idle step yields no tokens and a valid result."""
        plan = Scheduler(SchedulerConfig(num_pages=8, page_size=4)).schedule()
        result = make_executor(8, 4).execute(plan)
        result.check_against(plan)
        assert result.token_ids.shape == (0,)

    def test_engine_loop_with_chunks_decodes_and_preemption(self, make_executor: MakeExecutor) -> None:
        """Chunked prefills beside decodes, under page pressure, finish with in-vocabulary tokens."""
        policy = load_policy("sarathi", PolicyOptions(chunk_size=8))
        scheduler = Scheduler(SchedulerConfig(num_pages=10, page_size=4), policy)  # tight: one preemption
        requests = _requests(self.VOCAB_SIZE, (5, 11, 19, 2), max_new_tokens=6)
        for request in requests:
            scheduler.add_request(request)
        outputs, plans = _run(make_executor(10, 4), scheduler, timed=self.REPORTS_DURATION)
        assert set(outputs) == {r.request_id for r in requests}
        assert all(len(tokens) == 6 for tokens in outputs.values())
        assert all(0 <= t < self.VOCAB_SIZE for tokens in outputs.values() for t in tokens)
        assert any(p.num_decodes and p.num_prefill_tokens for p in plans), "no mixed step was exercised"
        assert any(p.preempted for p in plans), "no preemption was exercised"

    def test_greedy_runs_repeat(self, make_executor: MakeExecutor) -> None:
        """The same requests on a fresh executor give the same greedy tokens."""
        runs = []
        for _ in range(2):
            scheduler = Scheduler(SchedulerConfig(num_pages=32, page_size=4), load_policy("vllm"))
            for request in _requests(self.VOCAB_SIZE, (7, 3), max_new_tokens=4):
                scheduler.add_request(request)
            runs.append(_run(make_executor(32, 4), scheduler, timed=self.REPORTS_DURATION)[0])
        assert runs[0] == runs[1]

    def test_non_sampling_slices_get_minus_one(self, make_executor: MakeExecutor) -> None:
        """A slice that stops short of its last known token returns -1."""
        scheduler = Scheduler(
            SchedulerConfig(num_pages=16, page_size=4), load_policy("sarathi", PolicyOptions(chunk_size=4))
        )
        scheduler.add_request(_requests(self.VOCAB_SIZE, (10,), max_new_tokens=2)[0])
        plan = scheduler.schedule()
        assert plan.samples.tolist() == [False]
        assert make_executor(16, 4).execute(plan).token_ids.tolist() == [-1]

    def test_bad_plan_raises_and_changes_nothing(self, make_executor: MakeExecutor) -> None:
        """A page outside the cache is an InvalidPlanError; the executor then runs good plans as before."""
        if not self.HOLDS_KV:
            pytest.skip("this executor holds no KV pages to check")
        executor, fresh = make_executor(8, 4), make_executor(8, 4)
        with pytest.raises(InvalidPlanError):
            executor.execute(_single_plan(8, 4, self.VOCAB_SIZE))
        good = _single_plan(3, 4, self.VOCAB_SIZE)
        assert executor.execute(good).token_ids.tolist() == fresh.execute(good).token_ids.tolist()
