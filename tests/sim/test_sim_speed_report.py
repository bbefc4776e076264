"""benchmarks/sim_speed.py's report: the calls per request that ``--profile`` adds do not depend on the run."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

from phasesched.sim import Poisson, synthetic
from tests.fakes import load_script

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "sim_speed.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_script(BENCHMARK, "sim_speed_under_test")


class TestCallsPerRequest:
    def test_a_profiled_run_counts_the_same_calls_every_time(self, bench: ModuleType) -> None:
        """Two profiled runs of one workload report the same calls per request, and a longer run another count."""
        small = synthetic(12, Poisson(1.0), 1024, 64, seed=0, name="small")
        rows = [bench.run_case("small", "sarathi", small, profile=True, top=3) for _ in range(2)]
        assert rows[0]["calls_per_request"] == rows[1]["calls_per_request"] > 0
        longer = synthetic(12, Poisson(1.0), 1024, 256, seed=0, name="longer")
        assert bench.run_case("longer", "sarathi", longer, profile=True, top=3)["calls_per_request"] != pytest.approx(
            rows[0]["calls_per_request"]
        )

    def test_the_table_shows_the_count_only_for_profiled_runs(
        self, bench: ModuleType, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """The calls/req column and its note appear when a row was profiled, and not otherwise."""
        workload = synthetic(4, Poisson(1.0), 256, 16, seed=0, name="tiny")
        bench.print_table([bench.run_case("tiny", "vllm", workload, profile=False, top=3)])
        assert "calls/req" not in capsys.readouterr().out
        bench.print_table([bench.run_case("tiny", "vllm", workload, profile=True, top=3)])
        assert "calls/req" in capsys.readouterr().out


class TestRunsPerRequest:
    def test_runs_per_request_count_the_fast_forwarded_runs(self, bench: ModuleType) -> None:
        """The runs the simulator took at once, per request, as the workers counted them."""
        workload = synthetic(12, Poisson(1.0), 1024, 64, seed=0, name="small")
        row = bench.run_case("small", "vllm", workload, profile=False, top=3)
        assert row["fast_forwarded_steps"] > 0
        assert row["runs_per_request"] > 0
        assert (
            row["runs_per_request"]
            == sum(w.runs for w in bench.simulate(workload, bench.load_policy("vllm"), bench.DEPLOYMENT).workers) / 12
        )


class TestRepeats:
    def test_the_least_cpu_run_is_reported_with_the_range(
        self, bench: ModuleType, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """Of a case's runs, the one with the least CPU is its row; the table shows every run's range."""
        workload = synthetic(4, Poisson(1.0), 256, 16, seed=0, name="tiny")
        runs = [bench.run_case("tiny", "vllm", workload, profile=False, top=3) for _ in range(3)]
        for run, cpu in zip(runs, (0.3, 0.1, 0.2), strict=True):  # as a busy neighbour would leave them
            run["cpu_s"], run["cpu_ms_per_request"] = cpu, 1000.0 * cpu / 4
        row = bench.least_cpu(runs)
        assert row["cpu_s"] == 0.1
        assert row["runs_ms_per_request"] == [75.0, 25.0, 50.0]
        bench.print_table([row])
        out = capsys.readouterr().out
        assert "25.000-75.000" in out
        assert "least CPU" in out
        bench.print_table([bench.least_cpu(runs[:1])])  # one run: no range
        assert "range" not in capsys.readouterr().out

    def test_repeat_must_be_positive(self, bench: ModuleType) -> None:
        """``--repeat 0`` is refused before anything runs."""
        with pytest.raises(SystemExit):
            bench.main(["--cases", "poisson-1k", "--repeat", "0"])
