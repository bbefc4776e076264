"""Outputs the context limit cuts short are counted, in requests and tokens, never dropped silently."""

from __future__ import annotations

import pytest

from phasesched import DeterministicExecutor, Engine, Request, Scheduler, SchedulerConfig, load_policy
from phasesched.engine import VirtualClock
from phasesched.sim import Deployment, Disaggregation, Workload, simulate


class TestTruncatedOutputs:
    """``truncated_outputs``, ``truncated_output_tokens``: requests that asked for more than fits, what they lost."""

    @pytest.mark.parametrize("split", [False, True])
    @pytest.mark.parametrize("fast_forward", [False, True])
    def test_the_simulator_counts_cut_outputs(self, split: bool, fast_forward: bool) -> None:
        """With 1,000 tokens of context, 900 + 200 and 990 + 30 lose 100 and 20 tokens; 100 + 50 loses none."""
        workload = Workload("w", [0.0, 0.0, 0.1], [900, 100, 990], [200, 50, 30])
        options = {"disaggregation": Disaggregation(1, 1)} if split else {}
        metrics = simulate(
            workload,
            load_policy("vllm"),
            Deployment(max_model_len=1000),
            fast_forward=fast_forward,
            **options,
        ).metrics
        assert metrics["completed"] == 3
        assert (metrics["truncated_outputs"], metrics["truncated_output_tokens"]) == (2, 120)
        assert metrics["total_output_tokens"] == 280 - 120

    def test_nothing_is_counted_when_everything_fits(self) -> None:
        """Requests that fit report zero losses (the keys are always there)."""
        metrics = simulate(Workload("w", [0.0], [100], [50]), load_policy("vllm")).metrics
        assert (metrics["truncated_outputs"], metrics["truncated_output_tokens"]) == (0, 0)
        assert {"truncated_outputs", "truncated_output_tokens"} <= set(metrics.to_dict())

    def test_the_engine_counts_the_context_limit_but_not_eos(self) -> None:
        """An engine run: EOS after 3 of 10 tokens is a normal stop; 5 of 10 at an 8-token context is a loss of 5."""
        engine = Engine(
            Scheduler(SchedulerConfig(num_pages=16, page_size=4, max_model_len=8)),
            DeterministicExecutor(),
            clock=VirtualClock(),
        )
        requests = [
            Request("eos", prompt_token_ids=[1, 2, 3], max_new_tokens=10, eos_token_id=5),  # samples 3, 4, 5
            Request("cut", prompt_token_ids=[1, 2, 3], max_new_tokens=10, ignore_eos=True),
        ]
        metrics = engine.run(requests)
        assert (metrics["completed"], metrics["total_output_tokens"]) == (2, 3 + 5)
        assert (metrics["truncated_outputs"], metrics["truncated_output_tokens"]) == (1, 5)
