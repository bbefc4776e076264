"""Shared helpers for the torch executor tests: an engine loop that records logits, synthetic plans."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import pytest

pytest.importorskip("torch")  # --doctest-modules imports this file too, where torch may be absent
import attrs
import numpy as np
import torch

from phasesched import FinishedRequest, Request, Scheduler, SchedulerConfig, SchedulingPolicy, StepPlan
from phasesched.prefix_cache import CacheStats
from phasesched_torch import LlamaConfig, TorchExecutor

TINY = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2)


@attrs.define
class EngineRun:
    """What one engine loop produced."""

    finished: dict[str, FinishedRequest] = attrs.field(factory=dict)
    logits: dict[str, list[torch.Tensor]] = attrs.field(factory=lambda: defaultdict(list))
    plans: list[StepPlan] = attrs.field(factory=list)
    cache_stats: CacheStats = attrs.field(factory=CacheStats)

    def outputs(self) -> dict[str, tuple[int, ...]]:
        return {rid: f.output_token_ids for rid, f in self.finished.items()}  # type: ignore[misc]

    @property
    def num_preemptions(self) -> int:
        return sum(f.num_preemptions for f in self.finished.values())

    @property
    def had_mixed_step(self) -> bool:
        """Whether some step carried decodes and prefill tokens together."""
        return any(p.num_decodes and p.num_prefill_tokens for p in self.plans)


def run_engine(
    executor: TorchExecutor,
    policy: SchedulingPolicy,
    requests: Iterable[Request],
    *,
    num_pages: int,
    page_size: int,
    max_steps: int = 5000,
) -> EngineRun:
    """The schedule -> execute -> update loop on the real scheduler, keeping every sampled row's logits."""
    scheduler = Scheduler(SchedulerConfig(num_pages=num_pages, page_size=page_size), policy)
    for request in requests:
        scheduler.add_request(request)
    run = EngineRun()
    for _ in range(max_steps):
        if not scheduler.num_unfinished:
            run.cache_stats = scheduler.kv.cache_stats
            return run
        plan = scheduler.schedule()
        result = executor.execute(plan)
        outcome = scheduler.update(plan, result)
        scheduler.check_invariants()
        run.plans.append(plan)
        logits = executor.last_logits
        if logits is not None and logits.step_id == plan.step_id:
            for rid in logits.request_ids:
                run.logits[rid].append(logits.of(rid).clone())
        for record in outcome.finished:
            run.finished[record.request_id] = record
    msg = f"still {scheduler.num_unfinished} requests after {max_steps} steps"
    raise AssertionError(msg)


def random_prompts(lengths: Iterable[int], vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, n).tolist() for n in lengths]


def make_requests(prompts: list[list[int]], max_new_tokens: int, **kwargs: object) -> list[Request]:
    return [
        Request(f"r{i}", prompt_token_ids=p, max_new_tokens=max_new_tokens, **kwargs)  # type: ignore[arg-type]
        for i, p in enumerate(prompts)
    ]


def synthetic_plan(
    start: list[int],
    num_new: list[int],
    pages: list[list[int]],
    *,
    page_size: int,
    input_ids: list[int] | None = None,
    step_id: int = 0,
    vocab_size: int = 512,
) -> StepPlan:
    """A hand-built plan, as a profiler makes them: slices at any point of their sequence, any pages.

    Decode-looking slices (one token) get ``prompt_len = start``; token ids default to a pattern.
    """
    from phasesched.plan import build_step_plan  # noqa: PLC0415 -- the plan builder is not re-exported

    start_a, new_a = np.array(start, np.int32), np.array(num_new, np.int32)
    kv_indptr = np.concatenate([[0], np.cumsum([len(p) for p in pages])]).astype(np.int32)
    total = int(new_a.sum())
    ids = np.arange(total) % vocab_size if input_ids is None else np.array(input_ids)
    return build_step_plan(
        step_id=step_id,
        request_ids=tuple(f"s{i}" for i in range(len(start))),
        slots=np.arange(len(start), dtype=np.int32),
        start=start_a,
        num_new=new_a,
        prompt_len=np.where(new_a == 1, start_a, start_a + new_a).astype(np.int32),
        samples=np.ones(len(start), dtype=bool),
        kv_indptr=kv_indptr,
        kv_indices=np.array([p for ps in pages for p in ps], dtype=np.int32),
        page_size=page_size,
        input_ids=ids.astype(np.int32),
    )
