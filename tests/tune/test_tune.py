"""phasesched tune: the search space, capacity by bisection, parallel runs equal to serial, the CLI."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from phasesched import load_policy
from phasesched.cli import main
from phasesched.costmodel import ProfiledCostModel, ProfilePoint, write_profile_csv
from phasesched.costmodel.coverage import GridCoverage
from phasesched.costmodel.hardware import same_hardware
from phasesched.errors import InvalidArgumentError
from phasesched.experiments.context import ExperimentContext
from phasesched.parallel import map_tasks
from phasesched.sim.arrivals import Poisson
from phasesched.sim.builders import synthetic
from phasesched.sim.deployment import Deployment
from phasesched.sim.lengths import Uniform
from phasesched.sim.simulator import simulate
from phasesched.slo import SLO
from phasesched.tune import Candidate, CapacityConfig, Layout, SearchSpace, TuneRun, find_capacity, layouts, run_tune
from phasesched.tune.capacity import probe
from phasesched.tune.search import pareto_front

WORKLOAD = synthetic(40, Poisson(1.0), Uniform(256, 2048), Uniform(16, 64), seed=3)
SLO_ = SLO.parse("ttft=300ms,tpot=30ms")
needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray not installed")


class TestSLO:
    def test_parse_units_and_run_targets(self) -> None:
        """Durations in us/ms/s; run-level percentile keys map to results keys; attainment as a percentage."""
        slo = SLO.parse("ttft=0.5s, tpot=800us, itl_p99=100ms, e2el_mean=2s, attainment=95%")
        assert (slo.ttft_s, slo.tpot_s, slo.attainment) == pytest.approx((0.5, 0.0008, 0.95))
        assert slo.run_targets_ms == (("p99_itl_ms", 100.0), ("mean_e2el_ms", 2000.0))

    @pytest.mark.parametrize("text", ["", "ttft", "ttft=fast", "latency=1s", "attainment=0.9", "ttft=1s,attainment=2"])
    def test_rejects_nonsense(self, text: str) -> None:
        """Unknown keys, bad values and an SLO without a latency target are typed errors."""
        with pytest.raises(InvalidArgumentError):
            SLO.parse(text)

    def test_judge(self) -> None:
        """Attainment is good/completed; a run-level miss fails the run whatever the attainment."""
        values = {"completed": 10, "request_throughput": 2.0, "request_goodput": 1.9, "p99_itl_ms": 120.0}
        assert SLO.parse("ttft=1s").judge(values).meets
        verdict = SLO.parse("ttft=1s,itl_p99=100ms").judge(values)
        assert not verdict.meets
        assert verdict.attainment == pytest.approx(0.95)
        assert verdict.misses == ("p99 ITL 120.0 ms > 100 ms",)

    @given(st.integers(0, 3000), st.sampled_from([0.5, 0.9, 0.95, 0.99, 0.999, 1.0, 1 / 3, 0.7]))
    def test_max_misses_is_the_last_count_judge_passes(self, total: int, attainment: float) -> None:
        """max_misses is the largest miss count whose attainment judge() still accepts (checked by brute force)."""
        slo = SLO(ttft_s=1.0, attainment=attainment)
        passing = [m for m in range(total + 1) if slo.judge(_run(total, good=total - m)).meets]
        assert slo.max_misses(total) == (max(passing) if passing else 0)

    def test_max_misses_without_per_request_targets(self) -> None:
        """Run-level targets alone leave nothing to count per request."""
        assert SLO.parse("itl_p99=100ms").max_misses(100) is None


def _run(total: int, good: int) -> dict[str, float]:
    """Results of a run of ``total`` requests, ``good`` of them meeting the targets, over 7 s."""
    return {"completed": total, "request_throughput": total / 7.0, "request_goodput": good / 7.0}


class TestSpace:
    def test_layouts(self) -> None:
        """Aggregated replicas plus every P:D split of the workers."""
        assert [x.label for x in layouts(4)] == ["4 replicas", "1P:3D", "2P:2D", "3P:1D"]
        assert [x.label for x in layouts(4, aggregated=False)] == ["1P:3D", "2P:2D", "3P:1D"]

    def test_chunks_only_for_policies_that_take_one(self) -> None:
        """orca ignores chunk_size, so it is tried once per layout; labels can be passed back to the CLI."""
        space = SearchSpace(("orca", "sarathi"), chunks=(256, 512))
        takes = lambda policy, _field: policy == "sarathi"
        labels = [c.label for c in space.candidates(2, takes)]
        assert labels == [
            "orca on 2 replicas",
            "orca on 1P:1D",
            "sarathi(chunk=256) on 2 replicas",
            "sarathi(chunk=256) on 1P:1D",
            "sarathi(chunk=512) on 2 replicas",
            "sarathi(chunk=512) on 1P:1D",
        ]
        sarathi = Candidate("sarathi", 512, None, Layout(replicas=2))
        assert sarathi.command_line() == "--policy sarathi --policy-option chunk_size=512"

    def test_pareto_front(self) -> None:
        """A row is on the front unless another has at least its goodput and at most its ITL."""
        rows: list[dict[str, Any]] = [
            {"goodput_per_gpu": 2.0, "p99_itl_ms": 50.0},
            {"goodput_per_gpu": 1.0, "p99_itl_ms": 10.0},
            {"goodput_per_gpu": 1.0, "p99_itl_ms": 60.0},
            {"goodput_per_gpu": 0.0, "p99_itl_ms": None},
        ]
        assert pareto_front(rows) == [True, True, False, False]


class TestCapacity:
    def test_bisection_brackets_the_capacity(self) -> None:
        """The capacity passes, a rate within the tolerance above it fails."""
        candidate = Candidate("vllm", None, None, Layout(replicas=1))
        config = CapacityConfig(start_rate=4.0, tolerance=0.1, max_probes=12)
        found, probes = find_capacity(ExperimentContext(), candidate, WORKLOAD, SLO_, config)
        assert found is not None
        assert found.verdict.meets
        failing = [p.rate for p in probes if not p.verdict.meets]
        assert failing
        assert min(r for r in failing if r > found.rate) <= found.rate * 1.1 / (1 - 1e-9)

    def test_unreachable_slo_gives_no_capacity(self) -> None:
        """A TTFT target below any prefill time is met at no rate."""
        candidate = Candidate("vllm", None, None, Layout(replicas=1))
        found, _ = find_capacity(
            ExperimentContext(), candidate, WORKLOAD, SLO.parse("ttft=1us"), CapacityConfig(max_probes=4)
        )
        assert found is None


class TestStoppingEarly:
    @pytest.mark.parametrize("rate", [1.0, 16.0, 64.0, 1024.0])
    def test_a_stopped_probe_fails_as_the_whole_run_does(self, rate: float) -> None:
        """A probe stops only when the whole run would fail the SLO, and otherwise is the whole run."""
        candidate = Candidate("vllm", None, None, Layout(replicas=1))
        stopped = probe(ExperimentContext(), candidate, WORKLOAD, SLO_, rate)
        whole = simulate(
            WORKLOAD.scaled_to_rate(rate), load_policy("vllm"), ttft_slo_s=SLO_.ttft_s, tpot_slo_s=SLO_.tpot_s
        )
        verdict = SLO_.judge(whole.metrics.values)
        assert stopped.verdict.meets == verdict.meets
        if stopped.stopped_early:
            assert stopped.values["completed"] < len(WORKLOAD)
            assert stopped.verdict.attainment >= verdict.attainment
        else:
            assert stopped.verdict == verdict
        if rate == 1024.0:  # far past capacity: stopped long before the end
            assert stopped.stopped_early

    def test_capacity_is_the_same_without_stopping(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Stopping failing probes early changes no capacity."""
        candidate = Candidate("sarathi", 512, None, Layout(prefill=1, decode=1))
        config = CapacityConfig(start_rate=1.0, tolerance=0.05)
        fast = find_capacity(ExperimentContext(), candidate, WORKLOAD, SLO_, config)
        monkeypatch.setattr(SLO, "max_misses", lambda _self, _total: None)
        slow = find_capacity(ExperimentContext(), candidate, WORKLOAD, SLO_, config)
        assert [p.rate for p in fast[1]] == [p.rate for p in slow[1]]
        assert [p.verdict.meets for p in fast[1]] == [p.verdict.meets for p in slow[1]]
        assert any(p.stopped_early for p in fast[1])
        assert not any(p.stopped_early for p in slow[1])
        best, unstopped = fast[0], slow[0]
        assert best is not None
        assert unstopped is not None
        assert (best.rate, best.verdict, best.stopped_early) == (unstopped.rate, unstopped.verdict, False)
        # A run that may stop records a cut run's step in flight on its own: sums in another order.
        inexact = {k for k in best.values if k.startswith(("mean_", "std_")) or k.endswith(("throughput", "goodput"))}
        for key, value in best.values.items():
            other = unstopped.values[key]
            assert value == (pytest.approx(other, rel=1e-12) if key in inexact else other)


class TestParallel:
    def test_process_pool_equals_serial(self) -> None:
        """Two processes give exactly the rows, capacities and recommendation of a serial run."""
        space = SearchSpace(("vllm", "sarathi"), chunks=(512,))
        config = CapacityConfig(start_rate=4.0, tolerance=0.2, max_probes=5)
        context = ExperimentContext()
        serial = run_tune(context, [WORKLOAD], SLO_, space, TuneRun(2, config, backend="serial"))
        pooled = run_tune(context, [WORKLOAD], SLO_, space, TuneRun(2, config, backend="process", workers=2))
        assert serial.rows == pooled.rows
        assert serial.recommendation == pooled.recommendation

    def test_short_workload_is_called_a_burst(self) -> None:
        """When the workload spans under a minute at the recommended rate, the recommendation says so."""
        space = SearchSpace(("vllm",), chunks=(512,), disaggregated=False)
        config = CapacityConfig(start_rate=4.0, tolerance=0.2, max_probes=5)
        result = run_tune(ExperimentContext(), [WORKLOAD], SLO_, space, TuneRun(1, config, backend="serial"))
        assert "a burst more than a steady load" in result.recommendation

    def test_map_tasks_keeps_order(self) -> None:
        """Results come back in input order from the pool."""
        assert map_tasks(divmod, [(7, 2), (9, 4), (1, 1)], backend="process", workers=2) == [(3, 1), (2, 1), (1, 0)]

    def test_unknown_backend(self) -> None:
        """A typo is a typed error naming the backends."""
        with pytest.raises(InvalidArgumentError, match="serial, process, ray"):
            map_tasks(divmod, [(1, 1)], backend="dask")  # type: ignore[arg-type]

    @needs_ray
    def test_ray_equals_serial(self) -> None:
        """The Ray backend (a local cluster) gives a tune the same rows and recommendation as the serial one."""
        import ray  # noqa: PLC0415 -- an optional extra

        space = SearchSpace(("vllm",), chunks=(512,), disaggregated=False)
        config = CapacityConfig(start_rate=4.0, tolerance=0.2, max_probes=4)
        try:
            on_ray = run_tune(ExperimentContext(), [WORKLOAD], SLO_, space, TuneRun(1, config, backend="ray"))
        finally:
            ray.shutdown()
        serial = run_tune(ExperimentContext(), [WORKLOAD], SLO_, space, TuneRun(1, config, backend="serial"))
        assert on_ray.rows == serial.rows
        assert on_ray.recommendation == serial.recommendation


class TestScreening:
    SPACE = SearchSpace(("vllm", "sarathi", "orca"), chunks=(256, 2048))
    CONFIG = CapacityConfig(start_rate=4.0, tolerance=0.1, max_probes=8)
    WORKLOAD = synthetic(160, Poisson(1.0), Uniform(256, 2048), Uniform(16, 64), seed=5)

    def tune(self, **screening: Any) -> Any:
        run = TuneRun(2, self.CONFIG, backend="serial", confirm_top=1, **screening)
        return run_tune(ExperimentContext(), [self.WORKLOAD], SLO_, self.SPACE, run)

    def test_screening_keeps_the_winner_measured_on_the_whole_workload(self) -> None:
        """Screened on 40 requests, the same configuration wins, measured on all 160, and some were dropped."""
        full, screened = self.tune(), self.tune(screen=40)
        assert screened.screened_on == 40
        assert screened.rows[0]["label"] == full.rows[0]["label"]
        assert screened.rows[0]["requests_measured"] == 160
        tolerance = 2 * self.CONFIG.tolerance  # the bisections start apart, so each resolves within its tolerance
        assert screened.rows[0]["capacity_rps"] == pytest.approx(full.rows[0]["capacity_rps"], rel=tolerance)
        dropped = [row for row in screened.rows if row["screened_out"]]
        assert 0 < len(dropped) < len(full.rows)
        assert len(screened.rows) == len(full.rows)
        assert "Screening: all" in screened.recommendation

    def test_screened_out_rows_come_last_and_are_marked(self) -> None:
        """They were measured on fewer requests: ranked after every measured row, off the Pareto front."""
        rows = self.tune(screen=40).rows
        flags = [row["screened_out"] for row in rows]
        assert flags == sorted(flags), "a screened-out row outranks a measured one"
        for row in rows:
            if row["screened_out"]:
                assert (row["requests_measured"], row["pareto"]) == (40, "")
                assert row["bound"].startswith("screened")
        assert [row["rank"] for row in rows] == list(range(1, len(rows) + 1))

    def test_no_screen_when_the_workload_is_no_longer(self) -> None:
        """A screen as long as the workload measures every candidate once, fully."""
        result = self.tune(screen=160)
        assert result.screened_on is None
        assert not any(row["screened_out"] for row in result.rows)


class TestCommand:
    def test_tune_end_to_end(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """A tiny tune prints the deployment, the table and a recommendation, and writes results.json."""
        code = main(
            [
                "tune", "--gpus", "2", "--policy", "vllm,orca", "--chunks", "512", "--limit", "30",
                "--slo", "ttft=400ms,tpot=40ms", "--max-probes", "4", "--backend", "serial",
                "--prompt-len", "uniform:128:1024", "--output-len", "16", "--output", str(tmp_path), "--no-plots",
            ]
        )  # fmt: skip
        out = capsys.readouterr().out
        assert code == 0
        assert "H200 x 1 (TP1) serving llama-3-8b; KV 868,416 tokens" in out
        assert "Recommendation:" in out
        payload = json.loads((tmp_path / "results.json").read_text())
        assert payload["deployment"]["kv_tokens"] == 868_416
        rows = payload["tune"]["rows"]
        assert {r["layout"] for r in rows} == {"2 replicas", "1P:1D"}
        assert {r["policy_label"] for r in rows} == {"vllm(chunk=512)", "orca"}

    def test_deployment_options_reach_results(self, tmp_path: Path) -> None:
        """Memory and KV options of bench land in the deployment block; KV capacity follows the utilization."""
        out = tmp_path / "out"
        args = ["bench", "prefill", "--quick", "--no-plots", "--quiet", "--policy", "vllm", "--output", str(out)]
        assert main([*args, "--gpu-memory-utilization", "0.5", "--watermark", "0.1", "--tp", "2"]) == 0
        deployment = json.loads((out / "results.json").read_text())["deployment"]
        assert (deployment["tensor_parallel"], deployment["watermark"]) == (2, 0.1)
        expected = Deployment(tensor_parallel=2, gpu_memory_utilization=0.5).kv_tokens()
        assert deployment["kv_tokens"] == expected < Deployment(tensor_parallel=2).kv_tokens()

    def test_screening_from_the_command_line(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """--screen N screens on the first N requests; results.json says so per row and for the run."""
        code = main(
            [
                "tune", "--gpus", "2", "--policy", "vllm,orca,sarathi", "--chunks", "512", "--limit", "40",
                "--screen", "12", "--screen-keep", "0.05", "--max-probes", "4", "--backend", "serial",
                "--slo", "ttft=400ms,tpot=40ms", "--prompt-len", "uniform:128:1024", "--output-len", "16",
                "--output", str(tmp_path), "--no-plots",
            ]
        )  # fmt: skip
        assert code == 0
        assert "Screening: all 6 configurations were first measured on the first 12 requests" in capsys.readouterr().out
        payload = json.loads((tmp_path / "results.json").read_text())
        assert payload["tune"]["screen_requests"] == 12
        assert {r["requests_measured"] for r in payload["tune"]["rows"]} <= {12, 40}

    @pytest.mark.parametrize(("option", "value"), [("--screen", "0"), ("--screen", "some"), ("--screen-keep", "1.5")])
    def test_bad_screening_options(self, option: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
        """A screen that is not a positive count, auto or off, or a share outside (0, 1), is an error."""
        assert main(["tune", "--gpus", "2", "--limit", "20", "--backend", "serial", option, value]) in {1, 2}
        assert option in capsys.readouterr().err

    def test_bad_slo_is_a_usage_error(self, capsys: pytest.CaptureFixture[str]) -> None:
        """An unknown SLO key exits 2 with argparse's message."""
        assert main(["tune", "--gpus", "2", "--slo", "latency=1s"]) == 2
        assert "unknown SLO target 'latency'" in capsys.readouterr().err


class TestProfileMismatch:
    def _profile(self, tmp_path: Path) -> Path:
        points = [ProfilePoint(p, 0, d, 64, 1e-3 + 1e-6 * p + 1e-5 * d) for p in (0, 512) for d in (0, 8)]
        path = tmp_path / "profile.csv"
        write_profile_csv(path, points, {"executor": "torch", "model": "tiny", "device": "cpu"})
        return path

    def test_refused_without_permission(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """A CPU/tiny profile priced as H200 + Llama-3-8B exits 1 naming the recorded setup."""
        args = ["bench", "prefill", "--quick", "--no-plots", "--quiet", "--output", str(tmp_path / "out")]
        assert main([*args, "--cost-model", str(self._profile(tmp_path))]) == 1
        err = capsys.readouterr().err
        assert "hardware 'cpu'" in err
        assert "model 'tiny'" in err
        assert "--allow-profile-mismatch" in err

    def test_a_gpu_named_as_it_names_itself_is_its_preset(self, tmp_path: Path) -> None:
        """A profile recorded on ``NVIDIA H200`` prices an H200 run; a CUDA device alone or another GPU does not.

        ``phasesched profile`` records the device's own name (the GPU check's profile, recorded
        as ``cuda`` before it did, was refused on the H200 it was measured on).
        """
        points = [ProfilePoint(p, 0, d, 64, 1e-3 + 1e-6 * p + 1e-5 * d) for p in (0, 512) for d in (0, 8)]
        args = ["bench", "prefill", "--quick", "--no-plots", "--quiet", "--model", "llama-3-8b", "--num-pages", "4096"]
        for recorded, accepted in (("NVIDIA H200", True), ("cuda", False), ("NVIDIA H100 80GB HBM3", False)):
            path = tmp_path / f"{recorded}.csv"
            metadata = {"executor": "flashinfer", "model": "llama-3-8b", "device": "cuda", "hardware": recorded}
            write_profile_csv(path, points, metadata)
            out = tmp_path / f"out-{recorded}"
            assert (main([*args, "--output", str(out), "--cost-model", str(path)]) == 0) is accepted, recorded

    @pytest.mark.parametrize(
        ("recorded", "name", "same"),
        [
            ("NVIDIA H200", "H200", True),
            ("NVIDIA H100 80GB HBM3", "H100-SXM", True),
            ("NVIDIA A100-SXM4-80GB", "A100-80GB", True),
            ("h200", "H200", True),
            ("NVIDIA H200", "H100-SXM", False),
            ("NVIDIA GH200 480GB", "H200", False),
            ("cuda", "H200", False),
            ("cpu", "H200", False),
        ],
    )
    def test_same_hardware(self, recorded: str, name: str, same: bool) -> None:
        """A device's own name matches the preset whose model number is one of its words, and nothing else."""
        assert same_hardware(recorded, name) is same

    def test_allowed_takes_the_profiles_names(self, tmp_path: Path) -> None:
        """With permission (and explicit KV pages) the run and results.json name the profiled setup."""
        out = tmp_path / "out"
        profile = str(self._profile(tmp_path))
        args = ["bench", "prefill", "--quick", "--no-plots", "--quiet", "--output", str(out), "--cost-model", profile]
        assert main([*args, "--allow-profile-mismatch", "--num-pages", "4096"]) == 0
        deployment = json.loads((out / "results.json").read_text())["deployment"]
        assert (deployment["hardware"], deployment["model"], deployment["cost_model"]) == ("cpu", "tiny", "profiled")

    def test_out_of_grid_predictions_are_warned(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """Prefills far beyond the profiled 512 tokens are counted and warned about with the covered range."""
        out = tmp_path / "out"
        profile = str(self._profile(tmp_path))
        args = ["bench", "prefill", "--quick", "--no-plots", "--quiet", "--output", str(out), "--cost-model", profile]
        assert main([*args, "--allow-profile-mismatch", "--num-pages", "4096", "--policy", "no-chunk"]) == 0
        err = capsys.readouterr().err
        assert "fell outside the profiled grid and were extrapolated" in err
        assert "prefill_tokens up to 4,096 (profiled 0..512)" in err
        coverage = json.loads((out / "results.json").read_text())["settings"]["profile_coverage"]
        assert coverage["outside_grid"] > 0


needs_optuna = pytest.mark.skipif(importlib.util.find_spec("optuna") is None, reason="optuna not installed")


@needs_optuna
class TestOptuna:
    def test_study_measures_at_most_trials_and_is_reproducible(self) -> None:
        """A seeded TPE study picks the same candidates twice; repeats are measured once."""
        space = SearchSpace(("vllm", "sarathi", "orca"), chunks=(256, 512, 1024))
        config = CapacityConfig(start_rate=4.0, tolerance=0.25, max_probes=4)
        run = TuneRun(2, config, backend="serial", search="optuna", trials=6, seed=1)
        first = run_tune(ExperimentContext(), [WORKLOAD], SLO_, space, run)
        second = run_tune(ExperimentContext(), [WORKLOAD], SLO_, space, run)
        assert 1 <= len(first.rows) <= 6
        assert first.rows == second.rows
        assert first.recommendation.startswith("Recommendation:")


class TestOutOfGridCountsFromWorkers:
    """Tasks on other processes report their out-of-grid predictions back, exactly as a serial run counts them."""

    def _coverage(self) -> GridCoverage:
        points = [ProfilePoint(p, 0, d, c, 1e-3 + 1e-6 * p + 1e-5 * d) for p in (0, 512) for d in (0, 8) for c in (64,)]
        return GridCoverage(ProfiledCostModel(points))

    def _context(self) -> ExperimentContext:
        deployment = Deployment(hardware="cpu", model="tiny", cost_model=self._coverage(), num_pages=4096)
        return ExperimentContext(deployment, ("vllm", "sarathi"))

    def test_tune_counts_the_same_on_a_pool(self) -> None:
        """run_tune on two processes leaves the same counts (and maxima) as on one, and they are not zero."""
        space = SearchSpace(("vllm", "sarathi"), chunks=(256,), disaggregated=False)
        config = CapacityConfig(start_rate=4.0, tolerance=0.25, max_probes=3)
        counts = []
        for run in (TuneRun(2, config, backend="serial"), TuneRun(2, config, backend="process", workers=2)):
            context = self._context()
            result = run_tune(context, [WORKLOAD], SLO_, space, run)
            coverage = context.deployment.cost_model
            assert isinstance(coverage, GridCoverage)
            counts.append((coverage.predictions, coverage.outside, coverage.seen_max.tolist(), result.rows))
        assert counts[0] == counts[1]
        assert counts[0][1] > 0

    def test_map_counting_adds_once_in_process(self) -> None:
        """A task run in this process (one worker, or serial) is not counted twice."""
        for backend in ("serial", "process"):
            context = attrs.evolve(self._context(), backend=backend, workers=1)
            context.map("t", _price, [(context.detached(), 4096)] * 3)
            coverage = context.deployment.cost_model
            assert isinstance(coverage, GridCoverage)
            assert (coverage.predictions, coverage.outside) == (3, 3)

    def test_tune_cli_warns_on_a_pool(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """phasesched tune with a profile and two processes warns and records the counts, as bench does."""
        profile = tmp_path / "profile.csv"
        points = [ProfilePoint(p, 0, d, 64, 1e-3 + 1e-6 * p + 1e-5 * d) for p in (0, 512) for d in (0, 8)]
        write_profile_csv(profile, points, {"executor": "torch", "model": "tiny", "device": "cpu"})
        argv = [
            "tune", "--gpus", "1", "--policy", "vllm", "--chunks", "512", "--limit", "20", "--no-split",
            "--max-probes", "2", "--cost-model", str(profile), "--allow-profile-mismatch", "--num-pages", "4096",
            "--backend", "process", "--workers", "2", "--no-plots", "--quiet", "--output", str(tmp_path / "out"),
        ]  # fmt: skip
        assert main(argv) == 0
        assert "fell outside the profiled grid" in capsys.readouterr().err
        coverage = json.loads((tmp_path / "out" / "results.json").read_text())["profile_coverage"]
        assert coverage["outside_grid"] > 0


def _price(context: ExperimentContext, tokens: int) -> float:
    return context.cost_model().step_time(np.array([tokens]), np.array([tokens]))
