"""Every error a caller can provoke in the core is a PhaseschedError that names what is wrong."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from phasesched import (
    InvalidArgumentError,
    InvalidPlanError,
    InvalidRequestError,
    InvalidResultError,
    PagedKVManager,
    PolicyOptions,
    Request,
    RequestRejectedError,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    SchedulingPolicy,
    Selection,
    StepResult,
    load_policy,
)
from phasesched.costmodel import RooflineCostModel
from phasesched.policies import (
    DecodeFirst,
    EqualProgress,
    FixedChunk,
    LongPrefillThreshold,
    PreemptionPolicy,
    PriorityOrder,
    ShortestRemainingPrefill,
    TokenBudget,
)
from phasesched.request import SLO
from phasesched.sim.executor import SimulatedExecutor

BAD_CONSTRUCTIONS: dict[str, Callable[[], object]] = {
    "config num_pages 0": lambda: SchedulerConfig(num_pages=0),
    "config num_pages float": lambda: SchedulerConfig(num_pages=8.5),  # type: ignore[arg-type]
    "config num_pages bool": lambda: SchedulerConfig(num_pages=True),
    "config page_size str": lambda: SchedulerConfig(num_pages=8, page_size="16"),  # type: ignore[arg-type]
    "config max_model_len beyond int32": lambda: SchedulerConfig(num_pages=8, max_model_len=2**31),
    "config watermark 1": lambda: SchedulerConfig(num_pages=8, watermark=1.0),
    "config watermark nan": lambda: SchedulerConfig(num_pages=8, watermark=float("nan")),
    "options chunk_size 0": lambda: PolicyOptions(chunk_size=0),
    "options max_num_seqs -1": lambda: PolicyOptions(max_num_seqs=-1),
    "options max_num_batched_tokens float": lambda: PolicyOptions(max_num_batched_tokens=1.5),  # type: ignore[arg-type]
    "options tbt nan": lambda: PolicyOptions(tbt_target_s=float("nan")),
    "options max_model_len 0": lambda: PolicyOptions(max_model_len=0),
    "budget 0": lambda: TokenBudget(max_num_batched_tokens=0),
    "budget bool": lambda: TokenBudget(max_num_seqs=True),
    "fixed chunk 0": lambda: FixedChunk(0),
    "fixed chunk float": lambda: FixedChunk(8.0),  # type: ignore[arg-type]
    "threshold -1": lambda: LongPrefillThreshold(-1),
    "decode-first max_declined -1": lambda: DecodeFirst(max_declined=-1),
    "equal progress unit 0": lambda: EqualProgress(unit=0),
    "priority order aging nan": lambda: PriorityOrder(aging_per_s=float("nan")),
    "srpf aging 0": lambda: ShortestRemainingPrefill(aging_tokens_per_s=0.0),
    "preemption victims": lambda: PreemptionPolicy(victims="latest"),  # type: ignore[arg-type]
    "policy budget": lambda: SchedulingPolicy(budget=8192),  # type: ignore[arg-type]
    "policy chunker": lambda: SchedulingPolicy(chunker=512),  # type: ignore[arg-type]
    "sarathi-slo without a cost model": lambda: load_policy("sarathi-slo"),
    "kv pages float": lambda: PagedKVManager(8.5, 16),  # type: ignore[arg-type]
    "scheduler config": lambda: Scheduler(8),  # type: ignore[arg-type]
    "selection float tokens": lambda: Selection(np.zeros(0, np.int32), np.zeros(0, np.int32), ("a",), (1.5,)),  # type: ignore[arg-type]
    "simulated token id beyond int32": lambda: SimulatedExecutor(RooflineCostModel.from_names(), token_id=2**31),
    "simulated token id float": lambda: SimulatedExecutor(RooflineCostModel.from_names(), token_id=1.0),  # type: ignore[arg-type]
}

BAD_REQUESTS: dict[str, dict[str, object]] = {
    "float prompt_len": {"prompt_len": 4.5},
    "nan max_new_tokens": {"prompt_len": 4, "max_new_tokens": float("nan")},
    "float max_new_tokens": {"prompt_len": 4, "max_new_tokens": 2.0},
    "bool max_new_tokens": {"prompt_len": 4, "max_new_tokens": True},
    "nan priority": {"prompt_len": 4, "priority": float("nan")},
    "priority beyond int64": {"prompt_len": 4, "priority": 2**63},
    "prompt id beyond int32": {"prompt_token_ids": [1, 2**32 + 5]},
    "float prompt id": {"prompt_token_ids": [1.0, 2.0]},
    "eos beyond int32": {"prompt_len": 4, "eos_token_id": 2**31},
    "negative eos": {"prompt_len": 4, "eos_token_id": -1},
    "stop id beyond int32": {"prompt_len": 4, "stop_token_ids": [2**40]},
    "empty prompt": {"prompt_token_ids": []},
    "infinite arrival": {"prompt_len": 4, "arrival_time": float("inf")},
    "ignore_eos int": {"prompt_len": 4, "ignore_eos": 1},
    "slo not an SLO": {"prompt_len": 4, "slo": 0.5},
    "sampling dict": {"prompt_len": 4, "sampling": {"temperature": 1.0}},
}


class TestConstruction:
    @pytest.mark.parametrize("name", sorted(BAD_CONSTRUCTIONS))
    def test_bad_values_raise_a_typed_error(self, name: str) -> None:
        """Configs, policies and the KV manager refuse bad values with a typed error, not ValueError or TypeError."""
        with pytest.raises((InvalidArgumentError, InvalidPlanError)):
            BAD_CONSTRUCTIONS[name]()

    @pytest.mark.parametrize("name", sorted(BAD_REQUESTS))
    def test_bad_requests_raise_a_typed_error(self, name: str) -> None:
        """A request field the scheduler could not store raises InvalidRequestError at construction."""
        with pytest.raises(InvalidRequestError):
            Request("x", **BAD_REQUESTS[name])  # type: ignore[arg-type]

    def test_a_float_prompt_length_is_blamed_on_the_request(self) -> None:
        """A float prompt length names the field, not the chunk sizer."""
        with pytest.raises(InvalidRequestError, match="prompt_len must be an int"):
            Request("x", prompt_len=4.0)  # type: ignore[arg-type]

    @pytest.mark.parametrize(
        "kwargs", [{"temperature": float("nan")}, {"top_k": -1}, {"top_p": 0.0}, {"top_p": float("nan")}, {"seed": 1.5}]
    )
    def test_bad_sampling_and_slo_values(self, kwargs: dict[str, object]) -> None:
        """Sampling parameters and SLOs out of range are typed errors."""
        with pytest.raises(InvalidRequestError):
            SamplingParams(**kwargs)  # type: ignore[arg-type]
        with pytest.raises(InvalidRequestError):
            SLO(ttft_s=float("nan"))

    def test_numpy_scalars_are_accepted(self) -> None:
        """Numpy integers and floats from a workload's arrays are valid field values."""
        request = Request("x", prompt_len=np.int64(4), max_new_tokens=np.int32(2), arrival_time=np.float64(1.5))
        assert request.max_total_tokens == 6


class TestSchedulerInputs:
    def test_add_request_needs_a_request(self) -> None:
        """Anything but a Request is refused with InvalidArgumentError."""
        with pytest.raises(InvalidArgumentError):
            Scheduler(SchedulerConfig(num_pages=8)).add_request("a")  # type: ignore[arg-type]

    @pytest.mark.parametrize("now", [float("nan"), float("inf")])
    def test_schedule_needs_a_finite_time(self, now: float) -> None:
        """A NaN or infinite clock is refused and nothing changes."""
        scheduler = Scheduler(SchedulerConfig(num_pages=8))
        with pytest.raises(InvalidArgumentError):
            scheduler.schedule(now)
        assert scheduler.plan_in_flight is None

    def test_precomputed_tokens_must_be_an_int(self) -> None:
        """A float count of precomputed tokens is a rejected request."""
        with pytest.raises(RequestRejectedError, match="precomputed_tokens"):
            Scheduler(SchedulerConfig(num_pages=8)).add_request(Request("a", prompt_len=8), precomputed_tokens=2.5)  # type: ignore[arg-type]

    def test_decode_run_needs_an_int(self) -> None:
        """A float step count is a typed error."""
        with pytest.raises(InvalidArgumentError):
            Scheduler(SchedulerConfig(num_pages=8)).decode_run(2.5)  # type: ignore[arg-type]


class TestResults:
    @pytest.mark.parametrize("token", [2**32 + 5, 2**31, -(2**31) - 1])
    def test_token_ids_beyond_int32_are_refused(self, token: int) -> None:
        """A token id that int32 cannot hold is refused instead of wrapping (2**32 + 5 would become 5)."""
        with pytest.raises(InvalidResultError, match="int32"):
            StepResult(step_id=0, token_ids=np.array([token, 1], dtype=np.int64))

    def test_int32_token_ids_are_kept(self) -> None:
        """The largest int32 token id goes through unchanged."""
        result = StepResult(step_id=0, token_ids=np.array([2**31 - 1, -1], dtype=np.int64))
        assert result.token_ids.tolist() == [2**31 - 1, -1]

    def test_update_needs_a_step_result(self) -> None:
        """Anything but a StepResult is refused and the plan stays in flight."""
        scheduler = Scheduler(SchedulerConfig(num_pages=8))
        scheduler.add_request(Request("a", prompt_len=4))
        plan = scheduler.schedule()
        with pytest.raises(InvalidResultError):
            scheduler.update(plan, {"token_ids": [1]})  # type: ignore[arg-type]
        assert scheduler.plan_in_flight is plan
