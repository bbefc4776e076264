"""Each documented divergence from vLLM's scheduler, on a fixed workload that shows it."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from divergences import Divergence, classify
from phasesched_vllm.testing import RequestSpec, StepRecord, build_scheduler, first_difference, run

ADAPTER = "phasesched_vllm.PhaseschedScheduler"


def _both(
    workload: tuple[RequestSpec, ...], policy: str, vllm_policy: Literal["fcfs", "priority"] = "fcfs", **deployment: Any
) -> tuple[list[StepRecord], list[StepRecord]]:
    native = run(build_scheduler(policy=vllm_policy, **deployment), workload)
    config = {"phasesched": {"policy": policy}}
    adapted = run(
        build_scheduler(policy=vllm_policy, scheduler_cls=ADAPTER, additional_config=config, **deployment), workload
    )
    return native, adapted


def _scheduled(record: StepRecord) -> dict[str, int]:
    return dict(record.scheduled)


class TestSelfPreemption:
    WORKLOAD = (RequestSpec(0, 1, 9, priority=1), RequestSpec(1, 1, 8, priority=0))
    DEPLOYMENT: ClassVar[dict[str, Any]] = {
        "num_blocks": 5,
        "block_size": 4,
        "max_num_seqs": 2,
        "max_num_batched_tokens": 32,
    }

    def test_vllm_stops_the_step_where_phasesched_schedules_the_rest(self) -> None:
        """When the least important request is the one out of KV, vLLM preempts it and schedules nobody else.

        phasesched preempts the same request and still runs the other one, which has its block.
        """
        native, adapted = _both(self.WORKLOAD, "vllm-priority", "priority", **self.DEPLOYMENT)
        difference = first_difference(native, adapted)
        assert difference is not None
        _, a, b = difference
        assert a is not None
        assert b is not None
        assert a.preempted == b.preempted == {"r0"}
        assert _scheduled(a) == {}
        assert _scheduled(b) == {"r1": 1}
        assert classify(a, b, self.WORKLOAD, frozenset(Divergence)) is Divergence.SELF_PREEMPTION
        assert len(adapted) < len(native)  # the adapter loses no step to it


class TestPreemptForWaiting:
    WORKLOAD = (RequestSpec(0, 8, 20, priority=2), RequestSpec(3, 8, 4, priority=0))
    DEPLOYMENT: ClassVar[dict[str, Any]] = {
        "num_blocks": 64,
        "block_size": 16,
        "max_num_seqs": 1,
        "max_num_batched_tokens": 32,
    }

    def test_an_urgent_request_evicts_a_running_one_it_outranks(self) -> None:
        """With every seat taken, vllm-priority evicts the less important request; vLLM V1 makes the urgent one wait."""
        native, adapted = _both(self.WORKLOAD, "vllm-priority", "priority", **self.DEPLOYMENT)
        difference = first_difference(native, adapted)
        assert difference is not None
        step, a, b = difference
        assert a is not None
        assert b is not None
        assert step == 3
        assert _scheduled(a) == {"r0": 1}
        assert a.preempted == frozenset()
        assert b.preempted == {"r0"}
        assert _scheduled(b) == {"r1": 8}
        assert classify(a, b, self.WORKLOAD, frozenset(Divergence)) is Divergence.PREEMPT_FOR_WAITING
        first_token = {
            kind: next(i for i, r in enumerate(run_) if "r1" in r.finished or "r1" in r.new)
            for kind, run_ in (("vllm", native), ("adapter", adapted))
        }
        assert first_token["adapter"] < first_token["vllm"]


class TestSameStepPrefixHit:
    WORKLOAD = (RequestSpec(0, 5, 1, prefix=1), RequestSpec(0, 5, 1, prefix=1))
    DEPLOYMENT: ClassVar[dict[str, Any]] = {
        "num_blocks": 4,
        "block_size": 4,
        "max_num_seqs": 2,
        "max_num_batched_tokens": 32,
        "prefix_caching": True,
    }

    def test_a_prefix_computed_in_the_same_step_is_not_credited(self) -> None:
        """vLLM admits the second request on blocks the first allocates in the same step; the adapter waits a step."""
        native, adapted = _both(self.WORKLOAD, "vllm", **self.DEPLOYMENT)
        difference = first_difference(native, adapted)
        assert difference is not None
        step, a, b = difference
        assert a is not None
        assert b is not None
        assert step == 0
        assert a.new == {"r0", "r1"}
        assert b.new == {"r0"}
        assert classify(a, b, self.WORKLOAD, frozenset(Divergence)) is Divergence.SAME_STEP_PREFIX_HIT
        assert "r1" in adapted[1].new

    def test_a_prefix_cached_in_an_earlier_step_is_credited(self) -> None:
        """A prefix held by a running request costs the admission no free block, as in vLLM."""
        workload = (RequestSpec(0, 5, 3, prefix=1), RequestSpec(1, 5, 1, prefix=1))
        native, adapted = _both(workload, "vllm", **self.DEPLOYMENT)
        assert first_difference(native, adapted) is None
        assert _scheduled(native[1])["r1"] == 1  # 4 of its 5 prompt tokens hit the cache
