"""benchmarks/sim_fidelity.py's reporting: the request rows, run-level TTFT and ITL percentiles included."""

from __future__ import annotations

import platform
from pathlib import Path
from types import ModuleType

import attrs
import numpy as np
import pytest

pytest.importorskip("torch")

from phasesched.costmodel import RooflineCostModel
from phasesched.engine import StepRecord
from phasesched.metrics.summary import RunMetrics
from tests.fakes import load_script

BENCHMARK = Path(__file__).resolve().parents[3] / "benchmarks" / "sim_fidelity.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_script(BENCHMARK, "sim_fidelity_under_test")


@pytest.fixture(scope="module")
def two_runs(bench: ModuleType) -> tuple[RunMetrics, RunMetrics]:
    """Two simulations of a small mixed workload, the second with a 1 ms slower step."""
    setup = bench.Setup(num_short=6, num_long=1, short_prompt=(32, 64), long_prompt=(300, 400), output=(4, 8))
    roofline = RooflineCostModel.from_names("H200", "llama-3-8b")
    slower = attrs.evolve(roofline, step_overhead_s=roofline.step_overhead_s + 1e-3)
    workload = setup.workload()
    return bench.run_sim(setup, workload, roofline).metrics, bench.run_sim(setup, workload, slower).metrics


class TestRequestErrors:
    def test_rows_and_order(self, bench: ModuleType, two_runs: tuple[RunMetrics, RunMetrics]) -> None:
        """Per-request TTFT and TPOT, and run-level TTFT and ITL p50/p99, TTFT rows first."""
        errors = bench.request_errors(*two_runs)
        assert list(errors) == [
            "TTFT per request",
            "TTFT p50 (run)",
            "TTFT p99 (run)",
            "mean ITL per request (TPOT)",
            "ITL p50 (run)",
            "ITL p99 (run)",
        ]
        assert len(errors["TTFT per request"]) == 7
        assert all(len(errors[k]) == 1 for k in errors if k.endswith("(run)"))

    @pytest.mark.parametrize(("row", "key"), [("TTFT p50 (run)", "median_ttft_ms"), ("TTFT p99 (run)", "p99_ttft_ms")])
    def test_run_level_ttft(
        self, bench: ModuleType, two_runs: tuple[RunMetrics, RunMetrics], row: str, key: str
    ) -> None:
        """A run-level TTFT row is ``|other - real| / real`` of that percentile, and a slower run shows an error."""
        real, other = two_runs
        (error,) = bench.request_errors(real, other)[row]
        assert error == pytest.approx(abs(other[key] - real[key]) / real[key])
        assert error > 0

    def test_identical_runs_have_no_error(self, bench: ModuleType, two_runs: tuple[RunMetrics, RunMetrics]) -> None:
        """A run compared with itself has zero error in every row."""
        for errors in bench.request_errors(two_runs[0], two_runs[0]).values():
            np.testing.assert_array_equal(errors, 0.0)


def test_table_prints_the_ttft_percentile_rows(bench: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    """The table keeps one aligned line per row; a run-level row shows no p90 (a single sample)."""
    rows = [
        bench.ErrorRow("TTFT per request", 40, 0.05, 0.12, 0.06, 0.03),
        bench.ErrorRow("TTFT p50 (run)", 1, 0.04, run_b=0.05, floor=0.02),
        bench.ErrorRow("TTFT p99 (run)", 1, 0.2, run_b=0.1, floor=0.08),
    ]
    bench.print_table(rows)
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].startswith("TTFT per request")
    assert lines[3].split() == ["TTFT", "p50", "(run)", "1", "4.0%", "-", "5.0%", "2.0%", "pass", "(target", "10%)"]
    assert lines[4].split()[-3] == "FAIL"
    assert len({len(line.split("  pass")[0].split("  FAIL")[0]) for line in lines[2:5]}) == 1


def test_malloc_keeps_freed_memory_where_glibc_runs(bench: ModuleType) -> None:
    """The benchmark's allocator setting takes on glibc, and reports that it cannot elsewhere."""
    assert bench.keep_freed_memory() is (platform.libc_ver()[0] == "glibc")


def test_itl_median_position_reads_the_token_weighted_median(bench: ModuleType) -> None:
    """Ten 1-request steps and three 2-request ones: the median gap is the 8th-smallest 1-request step."""
    prefill = StepRecord(0.0, 0.05, 0.05, (100,), (100,))
    ones = [StepRecord(0.0, 0.0, 0.0, (1,), (101,)) for _ in range(10)]
    twos = [StepRecord(0.0, 0.0, 0.0, (1, 1), (101, 30)) for _ in range(3)]
    steps = [prefill, *ones, *twos]
    wall = np.array([0.05, *(0.0080 + 0.0001 * i for i in range(10)), 0.010, 0.010, 0.010])
    predicted = np.array([0.05, *[0.0080] * 10, 0.0100, 0.0100, 0.0100])
    kinds = np.array([bench._kind(s) for s in steps])
    position = bench.itl_median_position(steps, wall, predicted, kinds)
    # 16 gaps, 10 of them the 1-request steps' (8.0 ... 8.9 ms): the 8th gap is the median.
    assert position["batch_size"] == 1
    assert position["real_ms"] == pytest.approx(8.7)
    assert position["quantile"] == pytest.approx(0.8)
    assert position["priced_ms"] == pytest.approx(8.0)
    assert position["priced_error"] == pytest.approx(0.7 / 8.7)
    assert position["spread_p10"] == pytest.approx(np.percentile(wall[1:11] / 0.008, 10))


def test_itl_median_position_without_decode_steps(bench: ModuleType) -> None:
    steps = [StepRecord(0.0, 0.05, 0.05, (100,), (100,))]
    kinds = np.array([bench._kind(s) for s in steps])
    assert bench.itl_median_position(steps, np.array([0.05]), np.array([0.05]), kinds) == {}
