"""Trace replay and the suite's names and runners."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from phasesched import cli
from phasesched.errors import InvalidArgumentError
from phasesched.experiments import ExperimentContext, ReplayConfig, run_replay
from phasesched.experiments.replay import DEFAULT_POLICIES, prepare_trace
from phasesched.experiments.suite import (
    EXPERIMENTS,
    QUICK_REPLAY_LIMIT,
    SUITE,
    SuiteOptions,
    run_experiment,
    suite_names,
)
from phasesched.sim import (
    Deployment,
    Periodic,
    SharedPrefixes,
    Workload,
    load_trace,
    shared_prefix,
    synthetic,
    write_trace,
)
from phasesched.sim.arrivals import Poisson
from phasesched.sim.lengths import Uniform


def small_trace(tmp_path: Path, n: int = 40) -> Workload:
    """A generated trace written and read back, as a user's file would be."""
    path = tmp_path / "small.csv"
    write_trace(synthetic(n, Poisson(20.0), Uniform(64, 1024), Uniform(4, 32), seed=1), path)
    return load_trace(path)


class TestReplay:
    def test_every_policy_serves_every_request(self, tmp_path: Path) -> None:
        """One row per policy, all requests completed, CDFs of 101 points; the defaults are used without names."""
        trace = small_trace(tmp_path)
        result = run_replay(ExperimentContext(), ReplayConfig(trace))
        assert result.policies == DEFAULT_POLICIES
        assert [r["policy"] for r in result.rows] == list(DEFAULT_POLICIES)
        assert all(r["completed"] == len(trace) for r in result.rows)
        assert all(len(c["ttft"]) == len(c["itl"]) == 101 for c in result.cdf_ms.values())
        assert result.to_dict()["config"]["trace"] == "small"

    def test_rate_and_limit(self, tmp_path: Path) -> None:
        """The first `limit` requests are served at `rate`; lengths are unchanged."""
        trace = small_trace(tmp_path)
        result = run_replay(ExperimentContext(policies=("vllm",)), ReplayConfig(trace, rate=5.0, limit=10))
        assert len(result.workload) == 10
        assert result.workload.rate == pytest.approx(5.0)
        assert np.array_equal(result.workload.prompt_len, trace.prompt_len[:10])
        assert result.rows[0]["completed"] == 10

    def test_prompts_past_the_context_are_clipped_and_counted(self) -> None:
        """A prompt longer than max_model_len is cut to fit (and counted) instead of failing the run."""
        trace = Workload("long", [0.0, 0.1, 0.2], [100, 5000, 9000], [4, 4, 4])
        workload, clipped = prepare_trace(ReplayConfig(trace), max_model_len=4096)
        assert clipped == 2
        assert workload.prompt_len.tolist() == [100, 4095, 4095]
        context = ExperimentContext(Deployment(max_model_len=4096), policies=("vllm",))
        result = run_replay(context, ReplayConfig(trace))
        assert result.clipped == 2
        assert result.rows[0]["completed"] == 3

    def test_clipped_and_cut_tokens_are_reported(self) -> None:
        """Clipped prompts and cut outputs are counted in requests and tokens: in the title, a column and JSON."""
        trace = Workload("long", [0.0, 0.1, 0.2], [100, 5000, 4000], [4, 4, 200])
        context = ExperimentContext(Deployment(max_model_len=4096), policies=("vllm",))
        result = run_replay(context, ReplayConfig(trace))
        assert (result.clipped, result.clipped_tokens) == (1, 5000 - 4095)
        row = result.rows[0]
        # 5000 -> 4095 keeps 1 of 4 tokens; 4000 + 200 keeps 96 of 200.
        assert (row["truncated_outputs"], row["truncated_output_tokens"]) == (2, 3 + 104)
        assert "1 prompts clipped to fit, 905 prompt tokens cut" in result.title
        assert "truncated_outputs" in [c.key for c in result.columns]
        data = result.to_dict()
        assert (data["clipped_prompts"], data["clipped_prompt_tokens"]) == (1, 905)
        assert data["rows"][0]["truncated_output_tokens"] == 107

    def test_prefix_cache_hits_are_reported(self) -> None:
        """Rows and columns give each policy's cache hit rate and cached tokens: some with the cache on, none off."""
        sharing = SharedPrefixes(system_prompt=512, share=1.0)
        trace = shared_prefix(8, Periodic(0.5), 64, 8, sharing)
        context = ExperimentContext(policies=("vllm", "sarathi"))
        result = run_replay(context, ReplayConfig(trace))
        on, off = result.rows
        assert on["policy"] == "vllm"
        assert on["cached_tokens"] >= 7 * 512  # every session after the first claims the system prompt
        assert 0.0 < on["prefix_hit_rate"] <= 1.0
        assert (off["cached_tokens"], off["prefix_hit_rate"]) == (0, 0.0)
        assert {"prefix_hit_rate", "cached_tokens"} <= {c.key for c in result.columns}
        assert result.to_dict()["rows"][0]["cached_tokens"] == on["cached_tokens"]

    def test_progress_per_request(self, tmp_path: Path) -> None:
        """Progress is reported per policy, in requests, ending at the total."""
        seen: dict[str, tuple[int, int]] = {}
        context = ExperimentContext(policies=("vllm", "sarathi"), progress=lambda t, d, n: seen.update({t: (d, n)}))
        run_replay(context, ReplayConfig(small_trace(tmp_path, 12)))
        assert seen == {"replay vllm": (12, 12), "replay sarathi": (12, 12)}

    def test_empty_trace(self) -> None:
        """An empty trace is an error, not an empty report."""
        with pytest.raises(ValueError, match="no requests"):
            run_replay(ExperimentContext(), ReplayConfig(Workload("empty", [], [], [])))


class TestSuite:
    def test_names(self, tmp_path: Path) -> None:
        """The suite runs five experiments, plus replay when a trace is given; one name runs alone."""
        assert suite_names(None, SuiteOptions()) == SUITE
        assert suite_names(None, SuiteOptions(trace=small_trace(tmp_path))) == (*SUITE, "replay")
        assert suite_names("grid", SuiteOptions()) == ("grid",)

    def test_bad_names(self) -> None:
        """Unknown experiments and a replay without a trace are refused."""
        with pytest.raises(ValueError, match="known"):
            suite_names("nope", SuiteOptions())
        with pytest.raises(ValueError, match="trace"):
            suite_names("replay", SuiteOptions())
        with pytest.raises(ValueError, match="known"):
            run_experiment("nope", ExperimentContext())
        with pytest.raises(ValueError, match="trace"):
            run_experiment("replay", ExperimentContext())

    def test_cli_offers_every_experiment(self) -> None:
        """The CLI's choices (spelled out to keep --help light) are the suite's experiments."""
        assert cli.EXPERIMENTS == EXPERIMENTS

    def test_quick_replay_is_limited(self, tmp_path: Path) -> None:
        """A quick replay serves QUICK_REPLAY_LIMIT requests unless a limit is given."""
        trace = small_trace(tmp_path, 80)
        quick = run_experiment("replay", ExperimentContext(policies=("vllm",)), SuiteOptions(quick=True, trace=trace))
        assert quick.rows[0]["completed"] == QUICK_REPLAY_LIMIT
        limited = SuiteOptions(quick=True, trace=trace, limit=5)
        assert run_experiment("replay", ExperimentContext(policies=("vllm",)), limited).rows[0]["completed"] == 5

    def test_rate_reaches_the_phase_split(self) -> None:
        """--rate sets the phase split's Poisson rate."""
        result = run_experiment("phase-split", ExperimentContext(), SuiteOptions(quick=True, rate=3.0))
        assert result.to_dict()["config"]["rate"] == 3.0

    @pytest.mark.parametrize("name", SUITE)
    def test_quick_runs(self, name: str) -> None:
        """Every suite experiment runs at quick size and yields rows whose keys its columns name."""
        result = run_experiment(name, ExperimentContext(), SuiteOptions(quick=True))
        assert result.rows
        for column in result.columns:
            assert all(column.key in row for row in result.rows), column.key

    @pytest.mark.parametrize("name", SUITE)
    def test_process_pool_equals_serial(self, name: str) -> None:
        """Every suite experiment gives the same results on two processes as in one (plain bench uses the pool)."""
        serial = run_experiment(name, ExperimentContext(backend="serial"), SuiteOptions(quick=True))
        pooled = run_experiment(name, ExperimentContext(backend="process", workers=2), SuiteOptions(quick=True))
        assert pooled.to_dict() == serial.to_dict()


class TestMapOrder:
    def test_costliest_first_keeps_input_order(self) -> None:
        """Costs change the order tasks start in, never the order results come back in."""
        context = ExperimentContext(backend="process", workers=2)
        started: list[int] = []
        context_serial = ExperimentContext(backend="serial")
        args = [(i, 3) for i in range(6)]
        assert context.map("t", pow, args, costs=[1, 5, 2, 9, 0, 3]) == [i**3 for i in range(6)]
        out = context_serial.map("t", _record, [(i, started) for i in range(4)], costs=[1, 4, 2, 3])
        assert out == [0, 1, 2, 3]
        assert started == [1, 3, 2, 0]

    def test_one_cost_per_task(self) -> None:
        """A cost list of the wrong length is a typed error."""
        with pytest.raises(InvalidArgumentError, match="2 costs for 3 tasks"):
            ExperimentContext(backend="serial").map("t", pow, [(1, 1)] * 3, costs=[1, 2])


def _record(i: int, started: list[int]) -> int:
    started.append(i)
    return i
