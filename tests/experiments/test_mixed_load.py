"""Mixed load: the configurations compared, the window measurements, and the verdict."""

from __future__ import annotations

from collections.abc import Callable

import attrs
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from phasesched import POLICIES, PolicyOptions, SchedulingPolicy, load_policy
from phasesched.experiments import ExperimentContext, MixedLoadConfig, MixedLoadResult, Row, run_mixed_load, verdict
from phasesched.experiments.conclusions import phase_split_conclusion_rows, slo_line
from phasesched.experiments.mixed_load import decode_step_s, setups
from phasesched.metrics import BUDGET_PHASES
from phasesched.sim import Deployment
from phasesched.slo import SLO


@pytest.fixture(scope="module")
def quick() -> MixedLoadResult:
    return run_mixed_load(ExperimentContext(), MixedLoadConfig.quick())


def rows_by_label(result: MixedLoadResult) -> dict[str, Row]:
    return {r["label"]: r for r in result.rows}


class TestSetups:
    def test_standard_set_then_extra_policies(self) -> None:
        """No chunking, each chunk, SLO-adaptive, disaggregated, then new policy names (not duplicates)."""
        context = ExperimentContext(policies=("vllm", "no-chunk", "sglang"))
        labels = [s.label for s in setups(context, MixedLoadConfig(), 0.015)]
        assert labels == [
            "no-chunk",
            "sarathi(chunk=256)",
            "sarathi(chunk=512)",
            "sarathi(chunk=1024)",
            "sarathi(chunk=2048)",
            "sarathi(chunk=4096)",
            "sarathi-slo",
            "no-chunk on 1P:1D",
            "vllm",
            "sglang",
        ]

    def test_chunks_use_sarathi_and_slo_gets_its_target(self) -> None:
        """Fixed chunks are sarathi with chunk_size; the SLO-adaptive setup carries the TBT target."""
        plan = {s.label: s for s in setups(ExperimentContext(), MixedLoadConfig(), 0.015)}
        chunked = plan["sarathi(chunk=1024)"]
        assert (chunked.policy, chunked.options) == ("sarathi", {"chunk_size": 1024})
        assert plan["sarathi-slo"].options == {"tbt_target_s": 0.015}
        assert plan["no-chunk on 1P:1D"].workers == 2
        assert plan["no-chunk"].workers == 1

    def test_disaggregation_can_be_left_out(self) -> None:
        """With disaggregation=None there is no disaggregated setup."""
        config = attrs.evolve(MixedLoadConfig(), disaggregation=None)
        assert all(s.disaggregation is None for s in setups(ExperimentContext(), config, 0.01))


class TestRun:
    def test_no_chunk_stalls_decodes_for_the_whole_prefill(self, quick: MixedLoadResult) -> None:
        """Without chunking the worst gap is the long prompt's prefill step, and its TTFT is close to it."""
        base = rows_by_label(quick)["no-chunk"]
        n = quick.config.long_prompt
        prefill_ms = ExperimentContext().cost_model().step_time(np.array([n]), np.array([n])) * 1e3
        assert base["max_gap_ms"] >= prefill_ms
        assert base["long_ttft_ms"] >= prefill_ms
        assert base["prefill_vs_baseline"] == 1.0

    def test_smaller_chunks_give_smaller_gaps_and_slower_prefill(self, quick: MixedLoadResult) -> None:
        """p99 gaps grow with the chunk; prefill throughput falls as chunks shrink; all below no chunking."""
        rows = rows_by_label(quick)
        small, large, base = rows["sarathi(chunk=256)"], rows["sarathi(chunk=2048)"], rows["no-chunk"]
        assert small["p99_gap_ms"] < large["p99_gap_ms"] < base["p99_gap_ms"]
        assert small["prefill_tok_s"] < large["prefill_tok_s"] <= base["prefill_tok_s"] * 1.0001

    def test_slo_adaptive_keeps_gaps_near_its_target(self, quick: MixedLoadResult) -> None:
        """SLO-adaptive chunks keep the p99 gap at about the TBT target (a decode step of slack)."""
        row = rows_by_label(quick)["sarathi-slo"]
        expected = MixedLoadConfig.quick().tbt_factor * decode_step_s(ExperimentContext(), MixedLoadConfig.quick())
        assert quick.tbt_target_s == pytest.approx(expected)
        assert row["p99_gap_ms"] <= 2 * quick.tbt_target_s * 1e3

    def test_disaggregated_budget_has_a_transfer(self, quick: MixedLoadResult) -> None:
        """The long request's budget sums to its TTFT; only the disaggregated one has a transfer."""
        for row in quick.rows:
            budget = quick.budgets_ms[row["label"]]
            assert list(budget) == list(BUDGET_PHASES)
            assert sum(budget.values()) == pytest.approx(row["long_ttft_ms"])
            assert (budget["transfer"] > 0) == (row["label"] == "no-chunk on 1P:1D")

    def test_window_gaps_match_the_row(self, quick: MixedLoadResult) -> None:
        """The stored window gaps are the ones the row's percentiles come from."""
        for row in quick.rows:
            gaps = quick.window_gaps_s[row["label"]]
            assert row["gaps"] == gaps.size > 0
            assert row["max_gap_ms"] == pytest.approx(gaps.max() * 1e3)
            assert row["p99_gap_ms"] == pytest.approx(np.percentile(gaps, 99) * 1e3)

    def test_to_dict_has_cdfs_and_verdict(self, quick: MixedLoadResult) -> None:
        """to_dict carries 101-point gap CDFs per label, the budgets and the verdict."""
        data = quick.to_dict()
        assert set(data["window_gap_cdf_ms"]) == {r["label"] for r in quick.rows}
        assert all(len(v) == 101 for v in data["window_gap_cdf_ms"].values())
        assert data["verdict"]["winner"]["label"] == quick.verdict().winner["label"]

    def test_gpus_count_tensor_parallelism(self) -> None:
        """With TP=2 every worker is two GPUs: one aggregated worker is 2 GPUs, 1P+1D is 4."""
        config = attrs.evolve(MixedLoadConfig.quick(), chunk_sizes=())
        rows = rows_by_label(run_mixed_load(ExperimentContext(Deployment(tensor_parallel=2)), config))
        assert rows["no-chunk"]["gpus"] == 2
        assert rows["no-chunk on 1P:1D"]["gpus"] == 4

    def test_registered_plugin_joins_the_comparison(self) -> None:
        """A policy registered by name (as a plugin's entry point is) is added to the comparison."""

        def factory(options: PolicyOptions) -> SchedulingPolicy:
            return attrs.evolve(load_policy("sarathi", attrs.evolve(options, chunk_size=128)), name="test-tiny")

        POLICIES.register("test-tiny-chunks", factory)
        try:
            result = run_mixed_load(ExperimentContext(policies=("test-tiny-chunks",)), MixedLoadConfig.quick())
        finally:
            POLICIES.unregister("test-tiny-chunks")
        rows = rows_by_label(result)
        assert rows["test-tiny-chunks"]["p99_gap_ms"] < rows["sarathi(chunk=256)"]["p99_gap_ms"]


def row(label: str, p99: float, tok_s: float, gpus: int = 1) -> Row:
    return {"label": label, "gpus": gpus, "p99_gap_ms": p99, "prefill_tok_s": tok_s}


class TestVerdict:
    def test_lowest_gap_above_the_floor_wins(self) -> None:
        """The winner has the lowest p99 among configurations within 90% of no-chunk's throughput."""
        rows = [row("no-chunk", 470, 100), row("a", 10, 85), row("b", 19, 91), row("c", 37, 96)]
        v = verdict(rows)
        assert v.winner["label"] == "b"
        assert v.baseline["label"] == "no-chunk"
        assert "b protects" in v.text
        assert "19.0 ms" in v.text
        assert "470.0 ms" in v.text
        assert "91%" in v.text

    def test_floor_is_a_parameter(self) -> None:
        """Lowering the floor admits the faster-gap, slower-prefill configuration."""
        rows = [row("no-chunk", 470, 100), row("a", 10, 85), row("b", 19, 91)]
        assert verdict(rows, min_prefill_fraction=0.8).winner["label"] == "a"

    def test_more_gpus_are_not_eligible_but_reported(self) -> None:
        """A configuration on more GPUs cannot win; it is named when its gap beats the winner's."""
        rows = [row("no-chunk", 470, 100), row("b", 19, 91), row("disagg", 5, 100, gpus=2)]
        v = verdict(rows)
        assert v.winner["label"] == "b"
        assert v.more_gpus is not None
        assert v.more_gpus["label"] == "disagg"
        assert "on 2 GPUs" in v.text

    def test_baseline_wins_when_nothing_else_qualifies(self) -> None:
        """When every other configuration loses too much throughput, no-chunk stands."""
        v = verdict([row("no-chunk", 470, 100), row("a", 10, 50)])
        assert v.winner["label"] == "no-chunk"
        assert v.text.startswith("Verdict: no configuration beats no-chunk")

    def test_ties_go_to_the_higher_throughput(self) -> None:
        """Equal p99 gaps: the configuration with more prefill throughput wins."""
        rows = [row("no-chunk", 470, 100), row("a", 19, 92), row("b", 19, 95)]
        assert verdict(rows).winner["label"] == "b"

    def test_needs_a_baseline(self) -> None:
        """Without a no-chunk row there is nothing to compare with."""
        with pytest.raises(ValueError, match="no-chunk"):
            verdict([row("a", 10, 90)])

    def test_unmeasured_rows_are_skipped(self) -> None:
        """A configuration without gaps or throughput is never chosen."""
        rows = [row("no-chunk", 470, 100), {"label": "x", "gpus": 1, "p99_gap_ms": None, "prefill_tok_s": 100}]
        assert verdict(rows).winner["label"] == "no-chunk"

    @given(
        st.lists(st.tuples(st.floats(0.1, 1000), st.floats(1, 200), st.integers(1, 3)), min_size=1, max_size=12),
        st.floats(0.1, 1.0),
    )
    def test_winner_is_eligible_and_minimal(self, specs: list[tuple[float, float, int]], fraction: float) -> None:
        """For any rows: the winner is on the baseline's GPUs, above the floor, with the lowest eligible p99."""
        rows = [row("no-chunk", 470.0, 100.0)] + [row(f"c{i}", p, t, g) for i, (p, t, g) in enumerate(specs)]
        v = verdict(rows, min_prefill_fraction=fraction)
        eligible: Callable[[Row], bool] = lambda r: r["gpus"] == 1 and r["prefill_tok_s"] >= fraction * 100.0
        assert eligible(v.winner)
        assert v.winner["p99_gap_ms"] == min(r["p99_gap_ms"] for r in rows if eligible(r))
        if v.more_gpus is not None:
            assert v.more_gpus["gpus"] > 1
            assert v.more_gpus["p99_gap_ms"] < v.winner["p99_gap_ms"]


class TestVerdictEvidence:
    ROWS = (
        {"label": "no-chunk", "gpus": 1, "p99_gap_ms": 470.0, "prefill_tok_s": 34_000.0},
        {"label": "sarathi(chunk=512)", "gpus": 1, "p99_gap_ms": 19.1, "prefill_tok_s": 31_000.0},
        {"label": "sarathi(chunk=1024)", "gpus": 1, "p99_gap_ms": 19.5, "prefill_tok_s": 33_000.0},
        {"label": "sarathi-slo", "gpus": 1, "p99_gap_ms": 12.4, "prefill_tok_s": 30_500.0},
    )

    def test_runner_up_within_noise(self) -> None:
        """The runner-up is named with its gap, and a difference under 5% is called noise."""
        v = verdict(self.ROWS)
        assert v.runner_up is not None
        assert v.runner_up["label"] == "sarathi(chunk=1024)"
        assert "Runner-up: sarathi(chunk=1024), p99 gap 19.5 ms" in v.text
        assert "within noise" in v.text

    def test_near_miss_is_named(self) -> None:
        """A configuration just under the throughput floor with lower gaps is mentioned, not silently dropped."""
        v = verdict(self.ROWS)
        assert [r["label"] for r in v.near_misses] == ["sarathi-slo"]
        assert "Just under the 90% floor: sarathi-slo reaches a p99 gap of 12.4 ms at 89.7%" in v.text

    def test_verdict_names_only_passable_policies(self) -> None:
        """Every label of the standard set is a registered policy, with options in the label's parentheses."""
        for setup in setups(ExperimentContext(), MixedLoadConfig(), 0.015):
            assert setup.label.split("(")[0].split(" on ")[0] in POLICIES.names()


class TestConclusions:
    def test_slo_line_names_who_meets_it(self) -> None:
        """A winner missing the SLO's ITL target is said to miss it, and the rows that meet it are named."""
        rows = [dict(r, prefill_vs_baseline=None) for r in TestVerdictEvidence.ROWS]
        v = verdict(rows)
        text = slo_line(v, SLO.parse("itl_p99=15ms"), rows)
        assert "sarathi(chunk=512)'s p99 gap of 19.1 ms misses it" in text
        assert "Meeting it: sarathi-slo (12.4 ms, 90% prefill, 1 GPUs)" in text
        assert "meets it" in slo_line(v, SLO.parse("itl_p99=20ms"), rows)

    def test_phase_split_conclusion_shows_itl(self) -> None:
        """The phase split's conclusion names the best goodput per GPU and the lowest p99 ITL, with both ITLs."""
        rows = (
            {"label": "2 replicas", "gpus": 2, "goodput_per_gpu": 3.0, "p99_ttft_ms": 300.0, "p99_itl_ms": 129.0},
            {"label": "3 replicas", "gpus": 2, "goodput_per_gpu": 2.95, "p99_ttft_ms": 300.0, "p99_itl_ms": 100.0},
            {"label": "1P:1D", "gpus": 2, "goodput_per_gpu": 2.5, "p99_ttft_ms": 420.0, "p99_itl_ms": 8.7},
        )
        text = phase_split_conclusion_rows(rows)
        assert "2 replicas serves the most goodput per GPU" in text
        assert "p99 ITL 129.0 ms" in text
        assert "within noise (2%)" in text
        assert "lowest p99 ITL: 1P:1D, 8.7 ms" in text
