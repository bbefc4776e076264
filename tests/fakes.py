"""Shared test helpers: request factories, a driver loop, and executors with known behaviour."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType

import attrs
import numpy as np

from phasesched import (
    DeterministicExecutor,
    FinishedRequest,
    Request,
    Scheduler,
    SchedulerConfig,
    SchedulingPolicy,
    StepOutcome,
    StepPlan,
    StepResult,
)


def make_requests(
    lengths: Iterable[int],
    max_new_tokens: int = 4,
    *,
    with_ids: bool = True,
    prefix: str = "r",
    arrival_time: float = 0.0,
) -> list[Request]:
    """Requests with prompts ``0, 1, ..., n - 1`` (or length-only)."""
    return [
        Request(
            f"{prefix}{i}",
            prompt_token_ids=list(range(n)) if with_ids else None,
            prompt_len=-1 if with_ids else n,
            max_new_tokens=max_new_tokens,
            arrival_time=arrival_time,
        )
        for i, n in enumerate(lengths)
    ]


def expected_tokens(prompt_len: int, num: int, vocab_size: int = 32000) -> tuple[int, ...]:
    """What :class:`DeterministicExecutor` produces: the token sampled at position p is p + 1."""
    return tuple((prompt_len + i) % vocab_size for i in range(num))


@attrs.define
class Driver:
    """Runs the schedule / execute / update loop and records every plan and finish."""

    scheduler: Scheduler
    executor: DeterministicExecutor | PagedContentExecutor = attrs.field(factory=DeterministicExecutor)
    plans: list[StepPlan] = attrs.field(factory=list)
    outcomes: list[StepOutcome] = attrs.field(factory=list)
    finished: dict[str, FinishedRequest] = attrs.field(factory=dict)

    def step(self, now: float = 0.0) -> StepPlan:
        """One loop iteration."""
        plan = self.scheduler.schedule(now)
        outcome = self.scheduler.update(plan, self.executor.execute(plan))
        self.plans.append(plan)
        self.outcomes.append(outcome)
        for record in outcome.finished:
            assert record.request_id not in self.finished, "a request finished twice"
            self.finished[record.request_id] = record
        return plan

    def run(self, max_steps: int = 10_000) -> None:
        """Step until nothing is left (fails if that takes more than ``max_steps``)."""
        for _ in range(max_steps):
            if not self.scheduler.num_unfinished:
                return
            self.step()
        msg = f"still {self.scheduler.num_unfinished} requests after {max_steps} steps"
        raise AssertionError(msg)


def scheduler_for(
    policy: SchedulingPolicy, *, num_pages: int = 256, page_size: int = 16, max_model_len: int = 32768
) -> Scheduler:
    """A scheduler with the given policy and KV geometry."""
    return Scheduler(SchedulerConfig(num_pages=num_pages, page_size=page_size, max_model_len=max_model_len), policy)


def tokens_by_request(plan: StepPlan) -> dict[str, int]:
    """Tokens each request computes in ``plan``."""
    return dict(zip(plan.request_ids, plan.num_new.tolist(), strict=True))


def result_with(plan: StepPlan, token: int = 7, finished: np.ndarray | None = None) -> StepResult:
    """A result that samples ``token`` everywhere it samples."""
    tokens = np.where(plan.samples, token, -1)
    return StepResult(step_id=plan.step_id, token_ids=tokens, finished=finished)


def load_script(path: Path, name: str) -> ModuleType:
    """Import a script that is not in a package (an example, a benchmark, the GPU check) as module ``name``."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # attrs classes resolve their module by name
    spec.loader.exec_module(module)
    return module


@attrs.define
class PagedContentExecutor:
    """A fake executor that keeps real paged KV *contents*: each page holds the token ids written into it.

    Every slice writes its input ids at its positions into the pages the plan names, then reads
    its whole context back through ``kv_indices`` and samples a token that depends on all of it.
    So a plan pointing at the wrong page, a stale page, or a cached page whose content differs
    changes the outputs, and reading a position nobody wrote raises. ``written`` counts writes
    per page, for tests that check cached pages are not rewritten.
    """

    vocab_size: int = 50
    pages: dict[int, dict[int, int]] = attrs.field(factory=dict)
    written: dict[int, int] = attrs.field(factory=dict)

    def execute(self, plan: StepPlan) -> StepResult:
        """Write, read back, and sample from the whole context."""
        assert plan.input_ids is not None, "the content executor needs token ids"
        size, tokens = plan.page_size, np.full(plan.batch_size, -1, dtype=np.int64)
        for i in range(plan.batch_size):
            table = plan.kv_indices[plan.kv_indptr[i] : plan.kv_indptr[i + 1]].tolist()
            start, num = int(plan.start[i]), int(plan.num_new[i])
            first = int(plan.qo_indptr[i])
            for k in range(num):
                pos = start + k
                page = table[pos // size]
                self.pages.setdefault(page, {})[pos % size] = int(plan.input_ids[first + k])
                self.written[page] = self.written.get(page, 0) + 1
            if plan.samples[i]:
                context = tuple(self.pages[table[p // size]][p % size] for p in range(start + num))
                tokens[i] = hash(context) % self.vocab_size
        return StepResult(step_id=plan.step_id, token_ids=tokens)
