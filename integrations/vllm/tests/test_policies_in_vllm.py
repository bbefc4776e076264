"""Policies that are not vLLM's, run inside vLLM's scheduler through ``--scheduler-cls``, behave as they should."""

from __future__ import annotations

import os
from typing import Any

import attrs
import pytest
from hypothesis import HealthCheck, given, settings

from phasesched_vllm.testing import Recorder, RequestSpec, StepRecord, build_scheduler
from strategies import Case, cases

ADAPTER = "phasesched_vllm.PhaseschedScheduler"
BUDGET = 512
EXAMPLES = max(10, int(os.environ.get("PHASESCHED_VLLM_EXAMPLES", "100")) // 2)
SETTINGS = settings(
    max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)


@attrs.frozen
class Observed:
    """One step, with what the scheduler held before it."""

    decoding: frozenset[str]
    """Running requests past their prompt with one token to compute, before the step."""
    partial: frozenset[str]
    """Running requests part-way through their prefill, after the step."""
    record: StepRecord


def _adapter(policy: str, case: Case, **config: Any) -> Any:
    d = case.deployment
    return build_scheduler(
        num_blocks=d.num_blocks,
        block_size=d.block_size,
        max_num_seqs=d.max_num_seqs,
        max_num_batched_tokens=BUDGET,
        scheduler_cls=ADAPTER,
        additional_config={"phasesched": {"policy": policy, **config}},
    )


def observe(scheduler: Any, workload: tuple[RequestSpec, ...], max_steps: int = 5000) -> list[Observed]:
    """Every step of ``workload``, with the decode-ready requests before it and the partial prefills after it."""
    recorder = Recorder(scheduler, workload)
    steps: list[Observed] = []
    while not recorder.done:
        assert len(steps) < max_steps, "the workload did not finish (livelock)"
        decoding = frozenset(
            r.request_id
            for r in scheduler.running
            if r.num_computed_tokens == r.num_tokens - 1 and r.num_computed_tokens >= r.num_prompt_tokens
        )
        record = recorder.step()
        partial = frozenset(r.request_id for r in scheduler.running if r.is_prefill_chunk)
        steps.append(Observed(decoding, partial, record))
    return steps


def _check_common(steps: list[Observed], case: Case, budget: int) -> None:
    """Budget and sequence cap in every step; every request finishes exactly once."""
    finished: list[str] = []
    for step in steps:
        tokens = dict(step.record.scheduled)
        assert sum(tokens.values()) <= budget
        assert len(tokens) <= case.deployment.max_num_seqs
        finished.extend(step.record.finished)
    assert sorted(finished) == sorted(f"r{i}" for i in range(len(case.workload)))


class TestSarathi:
    @SETTINGS
    @given(cases(max_prompt=2000))
    def test_budget_holds_and_decodes_never_stall(self, case: Case) -> None:
        """Every step fits Sarathi's 512-token budget and carries every decode-ready request (unless preempted)."""
        steps = observe(_adapter("sarathi", case), case.workload)
        _check_common(steps, case, 512)
        for step in steps:
            tokens = dict(step.record.scheduled)
            assert step.decoding <= tokens.keys() | step.record.preempted
            assert all(tokens[r] == 1 for r in step.decoding & tokens.keys())

    def test_a_long_prompt_is_chunked_beside_decodes(self) -> None:
        """A 3000-token prompt runs in chunks while an earlier request keeps decoding in every step."""
        case = Case(cases_deployment(), (RequestSpec(0, 16, 40), RequestSpec(2, 3000, 2)))
        steps = observe(_adapter("sarathi", case), case.workload)
        chunked = [s for s in steps if dict(s.record.scheduled).get("r1", 0) > 1]
        assert len(chunked) >= 6
        assert all("r0" in dict(s.record.scheduled) for s in chunked)


class TestSglang:
    @SETTINGS
    @given(cases(max_prompt=2000))
    def test_prefill_first_with_one_partial_prefill(self, case: Case) -> None:
        """A step with prompt work carries no decode, and at most one prompt is part-way at a time."""
        steps = observe(_adapter("sglang", case), case.workload)
        _check_common(steps, case, BUDGET)
        for step in steps:
            tokens = dict(step.record.scheduled)
            prefilling = tokens.keys() - step.decoding
            if prefilling:
                assert not tokens.keys() & step.decoding
            assert len(step.partial) <= 1


class TestPluginPolicy:
    def test_sjf_admits_the_shortest_job_first(self) -> None:
        """The example plugin, loaded by name inside vLLM, admits a short job before a longer one that arrived first."""
        workload = (RequestSpec(0, 64, 20), RequestSpec(1, 400, 30), RequestSpec(1, 10, 2))
        case = Case(cases_deployment(max_num_seqs=1), workload)
        steps = observe(_adapter("sjf", case), workload)
        admitted = [r for s in steps for r in sorted(s.record.new)]
        assert admitted == ["r0", "r2", "r1"]
        _check_common(steps, case, BUDGET)

    @SETTINGS
    @given(cases(max_prompt=1000))
    def test_sjf_runs_every_workload_to_the_end(self, case: Case) -> None:
        """The plugin policy keeps vLLM's budget and cap and finishes every request."""
        _check_common(observe(_adapter("sjf", case), case.workload), case, BUDGET)


class TestConfiguration:
    def test_an_unknown_policy_lists_the_known_ones(self) -> None:
        """A typo in --additional-config names the registered policies."""
        with pytest.raises(Exception, match="sarathi"):
            _adapter("sarathy", Case(cases_deployment(), ()))

    def test_a_policy_that_cannot_chunk_needs_the_whole_context_in_its_budget(self) -> None:
        """orca cannot start a max-model-len prompt under a 512-token budget, so the adapter refuses to start."""
        with pytest.raises(ValueError, match="cannot start"):
            _adapter("orca", Case(cases_deployment(), ()))

    def test_async_scheduling_is_refused_with_the_flag_to_pass(self) -> None:
        """vLLM turns async scheduling on by default; the adapter names the flag that turns it off."""
        from phasesched_vllm import PhaseschedScheduler  # noqa: PLC0415

        native = build_scheduler(num_blocks=64)  # vLLM's CPU platform turns async scheduling off: turn it on
        native.vllm_config.scheduler_config.async_scheduling = True
        with pytest.raises(NotImplementedError, match="--no-async-scheduling"):
            PhaseschedScheduler(
                vllm_config=native.vllm_config,
                kv_cache_config=native.kv_cache_config,
                structured_output_manager=native.structured_output_manager,
                block_size=native.block_size,
            )

    def test_policy_options_come_from_additional_config(self) -> None:
        """chunk_size reaches the preset: sarathi with 128-token chunks never schedules a longer slice."""
        case = Case(cases_deployment(), (RequestSpec(0, 1000, 2),))
        steps = observe(_adapter("sarathi", case, chunk_size=128), case.workload)
        assert max(n for s in steps for _, n in s.record.scheduled) == 128


def cases_deployment(max_num_seqs: int = 8) -> Any:
    """A roomy deployment for fixed workloads."""
    from strategies import Deployment  # noqa: PLC0415

    return Deployment(num_blocks=1024, block_size=16, max_num_seqs=max_num_seqs, max_num_batched_tokens=BUDGET)
