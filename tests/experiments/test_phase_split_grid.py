"""The phase split and the grid: layouts, per-GPU accounting, budgets, closed-loop cells."""

from __future__ import annotations

import attrs
import numpy as np
import pytest

from phasesched.experiments import (
    ExperimentContext,
    GridConfig,
    PhaseSplitConfig,
    PhaseSplitResult,
    run_grid,
    run_phase_split,
)
from phasesched.experiments.phase_split import TTFT_PHASES
from phasesched.sim import Deployment


@pytest.fixture(scope="module")
def split() -> PhaseSplitResult:
    return run_phase_split(ExperimentContext(policies=("vllm",)), PhaseSplitConfig.quick())


class TestPhaseSplit:
    def test_layouts(self, split: PhaseSplitResult) -> None:
        """Each P:D ratio, then aggregated replicas with each distinct GPU count."""
        assert [(r["label"], r["gpus"], r["kind"]) for r in split.rows] == [
            ("1P:1D", 2, "disaggregated"),
            ("1P:2D", 3, "disaggregated"),
            ("2 replicas", 2, "aggregated"),
            ("3 replicas", 3, "aggregated"),
        ]
        assert all(r["completed"] == split.config.num_requests for r in split.rows)

    def test_transfer_only_when_disaggregated(self, split: PhaseSplitResult) -> None:
        """Disaggregated TTFT includes at least the smallest prompt's KV transfer; aggregated none."""
        workload = split.config.workload(0)
        smallest = int(workload.prompt_len.min()) * Deployment().kv_bytes_per_token()
        floor_ms = smallest / (split.config.link_bandwidth_gbs * 1e9) * 1e3
        for row in split.rows:
            if row["kind"] == "disaggregated":
                assert row["mean_transfer_ms"] >= floor_ms
                assert 0 < row["transfer_share_of_ttft"] < 1
            else:
                assert row["mean_transfer_ms"] == 0

    def test_budget_parts_sum_to_ttft(self, split: PhaseSplitResult) -> None:
        """The mean TTFT budget's phases add up to the mean TTFT of the row."""
        for row in split.rows:
            budget = split.budgets_ms[row["label"]]
            assert list(budget) == list(TTFT_PHASES)
            assert sum(budget.values()) == pytest.approx(row["mean_ttft_ms"])

    def test_per_gpu_figures(self, split: PhaseSplitResult) -> None:
        """Serving the same light load, every layout's total rate is about the same, so per GPU it falls with GPUs."""
        totals = [r["output_tok_s_per_gpu"] * r["gpus"] for r in split.rows]
        assert max(totals) == pytest.approx(min(totals), rel=0.2)
        two, three = split.rows[2], split.rows[3]
        assert three["output_tok_s_per_gpu"] < two["output_tok_s_per_gpu"]
        for row in split.rows:
            assert 0 < row["goodput_per_gpu"] * row["gpus"] <= split.config.rate * 1.5

    def test_same_seed_same_workload(self) -> None:
        """The workload is a function of the config and seed; another seed changes it."""
        config = PhaseSplitConfig.quick()
        assert np.array_equal(config.workload(3).prompt_len, config.workload(3).prompt_len)
        assert not np.array_equal(config.workload(3).prompt_len, config.workload(4).prompt_len)
        assert config.workload(0).rate == pytest.approx(config.rate, rel=0.5)

    def test_several_policies_label_rows(self) -> None:
        """With two policies, every layout runs under each and labels say which."""
        config = attrs.evolve(PhaseSplitConfig.quick(), ratios=((1, 1),), aggregated=False, num_requests=8)
        result = run_phase_split(ExperimentContext(policies=("vllm", "sarathi")), config)
        assert [r["label"] for r in result.rows] == ["vllm 1P:1D", "sarathi 1P:1D"]
        assert set(result.budgets_ms) == {"vllm 1P:1D", "sarathi 1P:1D"}

    def test_link_latency_adds_to_every_transfer(self) -> None:
        """link_latency_s reaches the KV link: each transfer, and so the mean, takes that much longer."""
        config = attrs.evolve(PhaseSplitConfig.quick(), ratios=((1, 1),), aggregated=False, num_requests=8)
        result = run_phase_split(ExperimentContext(policies=("vllm",)), config)
        base = result.rows[0]
        slow = run_phase_split(ExperimentContext(policies=("vllm",)), attrs.evolve(config, link_latency_s=0.05)).rows[0]
        assert slow["mean_transfer_ms"] - base["mean_transfer_ms"] == pytest.approx(50.0 - 0.02, rel=1e-6)
        assert (base["failed"], slow["failed"]) == (0, 0)
        assert result.to_dict()["config"]["link_latency_s"] == 20e-6


class TestGrid:
    def test_cells_and_request_counts(self) -> None:
        """A row per cell in grid order, each with max(requests_per_client * clients, min_requests) requests."""
        config = GridConfig.quick()
        result = run_grid(ExperimentContext(policies=("vllm",)), config)
        assert [(r["prompt_len"], r["output_len"], r["concurrency"]) for r in result.rows] == [
            (p.prompt_len, p.output_len, p.concurrency) for p in config.points()
        ]
        assert [r["requests"] for r in result.rows] == [config.num_requests(p) for p in config.points()]

    def test_single_client_sees_no_queueing(self) -> None:
        """With one client, TTFT is the prompt's prefill step and ITL the single decode step."""
        context = ExperimentContext(policies=("vllm",))
        config = GridConfig(prompts=(2048,), outputs=(8,), concurrency=(1,), requests_per_client=3, min_requests=3)
        (row,) = run_grid(context, config).rows
        cost = context.cost_model()
        assert row["mean_ttft_ms"] == pytest.approx(cost.step_time(np.array([2048]), np.array([2048])) * 1e3)
        low = cost.step_time(np.array([1]), np.array([2049])) * 1e3
        high = cost.step_time(np.array([1]), np.array([2056])) * 1e3
        assert low - 1e-9 <= row["median_itl_ms"] <= high + 1e-9

    def test_more_clients_more_throughput(self) -> None:
        """Generated tokens/s grows with concurrency for short prompts (decode batches amortize weights)."""
        config = GridConfig(prompts=(128,), outputs=(64,), concurrency=(1, 8), requests_per_client=2)
        rows = run_grid(ExperimentContext(policies=("vllm",)), config).rows
        assert rows[1]["output_tok_s"] > 4 * rows[0]["output_tok_s"]


class TestParallel:
    def test_process_pool_equals_serial(self) -> None:
        """Phase split rows are the same computed on two processes as in one."""
        serial = run_phase_split(ExperimentContext(policies=("vllm", "sarathi")), PhaseSplitConfig.quick())
        pooled = run_phase_split(
            ExperimentContext(policies=("vllm", "sarathi"), backend="process", workers=2), PhaseSplitConfig.quick()
        )
        assert serial.rows == pooled.rows
        assert serial.budgets_ms == pooled.budgets_ms
