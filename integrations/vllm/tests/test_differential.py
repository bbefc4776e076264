"""The adapter with the ``vllm`` presets against vLLM's own V1 scheduler, step for step.

Each generated workload runs twice, through vLLM's native ``Scheduler`` and through
``PhaseschedScheduler`` loaded by ``--scheduler-cls``, on identical vLLM deployments; every step's
scheduled tokens per request, new and resumed requests, preemptions and finished requests must
agree. Where a test allows one of the documented divergences (``divergences.py``, each with its
own test in ``test_divergences.py``), a run may differ from the step where that divergence
starts on; any other difference fails. ``tests/conftest.py`` prints how many runs matched to the
end and how many stopped at which divergence.
"""

from __future__ import annotations

import os
from typing import Any, Literal

import attrs
from hypothesis import HealthCheck, given, settings

from divergences import Divergence, classify
from outcomes import OUTCOMES
from phasesched import POLICIES, PolicyOptions, SchedulingPolicy
from phasesched.policies import LowestPriority, PreemptionPolicy, presets
from phasesched_vllm.testing import StepRecord, build_scheduler, first_difference, run
from strategies import Case, cases

ADAPTER = "phasesched_vllm.PhaseschedScheduler"
# CI sets PHASESCHED_VLLM_EXAMPLES to scale the number of generated workloads per test.
EXAMPLES = int(os.environ.get("PHASESCHED_VLLM_EXAMPLES", "100"))
SETTINGS = settings(
    max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)


def _runs(
    case: Case, *, vllm_policy: Literal["fcfs", "priority"], phasesched_policy: str, **extra: Any
) -> tuple[list[StepRecord], list[StepRecord]]:
    d = case.deployment
    deployment: dict[str, Any] = {
        "num_blocks": d.num_blocks,
        "block_size": d.block_size,
        "max_num_seqs": d.max_num_seqs,
        "max_num_batched_tokens": d.max_num_batched_tokens,
        "policy": vllm_policy,
        **extra,
    }
    native = run(build_scheduler(**deployment), case.workload)
    adapted = run(
        build_scheduler(
            **deployment, scheduler_cls=ADAPTER, additional_config={"phasesched": {"policy": phasesched_policy}}
        ),
        case.workload,
    )
    return native, adapted


def vllm_priority_v1(options: PolicyOptions) -> SchedulingPolicy:
    """``vllm-priority`` without preemption for waiting requests, as vLLM V1 schedules."""
    return attrs.evolve(presets.vllm_priority(options), preemption=PreemptionPolicy(victims=LowestPriority()))


if "test-vllm-priority-v1" not in POLICIES:
    POLICIES.register("test-vllm-priority-v1", vllm_priority_v1)


def _assert_same(
    native: list[StepRecord],
    adapted: list[StepRecord],
    case: Case,
    test: str,
    allowed: frozenset[Divergence] = frozenset(),
) -> None:
    difference = first_difference(native, adapted)
    if difference is None:
        OUTCOMES.record(test, "identical", len(native))
        return
    step, a, b = difference
    if a is not None and b is not None:
        kind = classify(a, b, case.workload, allowed, native[:step])
        if kind is not None:
            OUTCOMES.record(test, kind.value, step)
            return
    context = "\n".join(f"  step {i}: {r}" for i, r in enumerate(native[max(0, step - 3) : step], max(0, step - 3)))
    msg = f"step {step} differs\n  vLLM:    {a}\n  adapter: {b}\nvLLM's steps before it:\n{context}"
    raise AssertionError(msg)


class TestVllmPreset:
    """``vllm`` in the adapter against vLLM's FCFS scheduler."""

    @SETTINGS
    @given(cases())
    def test_fcfs_matches_every_step(self, case: Case) -> None:
        """Every step of a generated FCFS workload, preemptions included, is vLLM's."""
        _assert_same(*_runs(case, vllm_policy="fcfs", phasesched_policy="vllm"), case, "vllm")

    @SETTINGS
    @given(cases(max_requests=24, max_prompt=3000, max_tokens=64, budgets=(512, 2048, 8192), seqs=(16, 64, 256)))
    def test_fcfs_on_larger_deployments_matches_every_step(self, case: Case) -> None:
        """Larger budgets, sequence caps, prompts and batches: every step is still vLLM's."""
        _assert_same(*_runs(case, vllm_policy="fcfs", phasesched_policy="vllm"), case, "vllm (larger)")

    @SETTINGS
    @given(cases(prefixes=True))
    def test_fcfs_with_prefix_caching_matches_every_step(self, case: Case) -> None:
        """With prefix caching on and shared prompt prefixes, every step is still vLLM's."""
        _assert_same(
            *_runs(case, vllm_policy="fcfs", phasesched_policy="vllm", prefix_caching=True),
            case,
            "vllm+prefix-caching",
            frozenset({Divergence.SAME_STEP_PREFIX_HIT}),
        )


class TestVllmPriorityPreset:
    """``vllm-priority`` in the adapter against vLLM's ``--scheduling-policy priority``."""

    @SETTINGS
    @given(cases(priorities=True))
    def test_priority_matches_every_step(self, case: Case) -> None:
        """Every step of a generated workload with priorities is vLLM's, up to a documented divergence."""
        _assert_same(
            *_runs(case, vllm_policy="priority", phasesched_policy="vllm-priority"),
            case,
            "vllm-priority",
            frozenset({Divergence.SELF_PREEMPTION, Divergence.PREEMPT_FOR_WAITING}),
        )

    @SETTINGS
    @given(cases(priorities=True))
    def test_priority_without_preempting_for_waiting_matches_every_step(self, case: Case) -> None:
        """Without preemption for waiting requests, only vLLM's self-preemption stop tells the two apart."""
        _assert_same(
            *_runs(case, vllm_policy="priority", phasesched_policy="test-vllm-priority-v1"),
            case,
            "vllm-priority minus preempt-for-waiting",
            frozenset({Divergence.SELF_PREEMPTION}),
        )


class TestPauseStates:
    def test_pausing_new_requests_and_all_requests_matches_vllm(self) -> None:
        """PAUSED_NEW admits nobody but runs the running; PAUSED_ALL runs nothing; both as vLLM does."""
        from vllm.v1.core.sched.interface import PauseState  # noqa: PLC0415

        from phasesched_vllm.testing import Recorder, RequestSpec  # noqa: PLC0415

        workload = (RequestSpec(0, 40, 12), RequestSpec(1, 300, 6), RequestSpec(3, 20, 4), RequestSpec(5, 70, 3))
        pauses = {2: PauseState.PAUSED_NEW, 6: PauseState.PAUSED_ALL, 8: PauseState.UNPAUSED}
        runs = []
        for scheduler_cls in (None, ADAPTER):
            scheduler = build_scheduler(
                num_blocks=256, max_num_seqs=8, max_num_batched_tokens=64, scheduler_cls=scheduler_cls
            )
            recorder = Recorder(scheduler, workload)
            while not recorder.done:
                if len(recorder.records) in pauses:
                    recorder.scheduler.set_pause_state(pauses[len(recorder.records)])
                recorder.step()
            runs.append(recorder.records)
        native, adapted = runs
        assert first_difference(native, adapted) is None
        assert native[6].scheduled == ()
        assert not any(record.new for record in native[2:8])
