"""The ``phasesched`` command line, end to end: in process through ``main`` and as a subprocess."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest

from phasesched import POLICIES, PolicyOptions, SchedulingPolicy, cli, load_policy
from phasesched.cli import main
from phasesched.costmodel import ProfiledCostModel, ProfilePoint, RooflineCostModel, read_profile_csv, write_profile_csv
from phasesched.experiments.context import REPRESENTATIVE_POLICIES
from phasesched.sim import load_trace, synthetic, trace_stats, write_trace
from phasesched.sim.arrivals import Poisson
from phasesched.sim.lengths import Uniform

REPO = Path(__file__).resolve().parents[1]
# The repository carries copies of the shared traces (as tests/sim/test_traces.py finds them).
TRACES = next(
    (p for p in (REPO / "data" / "traces", REPO.parent / "shared" / "traces") if p.is_dir()), REPO / "data" / "traces"
)
PNG = b"\x89PNG\r\n\x1a\n"
needs_plots = pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib not installed")


def command(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run ``phasesched`` as a user would: the installed script if there is one, else ``python -m``."""
    script = shutil.which("phasesched", path=str(Path(sys.executable).parent))
    argv = [script] if script else [sys.executable, "-m", "phasesched.cli"]
    return subprocess.run([*argv, *args], capture_output=True, text=True, timeout=timeout, check=False)


def results(folder: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((folder / "results.json").read_text())
    return data


def assert_pngs(folder: Path, names: list[str]) -> None:
    for name in names:
        assert (folder / name).read_bytes()[:8] == PNG, name


class TestHelp:
    def test_help_as_a_command(self) -> None:
        """`phasesched --help` exits 0 and lists the subcommands."""
        done = command("--help", timeout=60)
        assert done.returncode == 0, done.stderr
        for sub in ("bench", "tune", "trace", "profile", "policies"):
            assert sub in done.stdout

    @pytest.mark.parametrize("sub", [["bench"], ["tune"], ["trace", "stats"], ["profile"], ["policies"]])
    def test_help_of_each_subcommand(self, sub: list[str], capsys: pytest.CaptureFixture[str]) -> None:
        """Every subcommand's --help exits 0."""
        assert main([*sub, "--help"]) == 0
        assert "usage: phasesched" in capsys.readouterr().out

    def test_bench_help_names_every_option(self, capsys: pytest.CaptureFixture[str]) -> None:
        """bench --help documents the options the issue asks for."""
        main(["bench", "--help"])
        text = capsys.readouterr().out
        for option in ("--hardware", "--model", "--policy", "--trace", "--rate", "--output", "--cost-model", "--quick"):
            assert option in text

    def test_version(self, capsys: pytest.CaptureFixture[str]) -> None:
        """--version prints the package version."""
        assert main(["--version"]) == 0
        assert capsys.readouterr().out.startswith("phasesched ")


class TestUsageErrors:
    @pytest.mark.parametrize(
        "argv",
        [
            [],
            ["bench", "nope"],
            ["bench", "--rate", "-1"],
            ["bench", "--limit", "0"],
            ["bench", "replay"],
            ["profile", "--output", "x.csv"],
            ["trace"],
        ],
    )
    def test_exit_2(self, argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
        """Malformed command lines exit with status 2 and a usage message."""
        assert main(argv) == 2
        assert "usage:" in capsys.readouterr().err

    def test_unknown_policy_lists_the_known_ones(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """An unknown policy fails with status 1 before any simulation, naming the known policies."""
        assert main(["bench", "mixed", "--policy", "vllm,nope", "--output", str(tmp_path / "out")]) == 1
        err = capsys.readouterr().err
        assert "nope" in err
        assert "known:" in err
        assert "sarathi" in err
        assert not (tmp_path / "out").exists()

    def test_unknown_hardware(self, capsys: pytest.CaptureFixture[str]) -> None:
        """An unknown hardware preset is a clear failure."""
        assert main(["bench", "--hardware", "B300", "--no-plots"]) == 1
        assert "no hardware preset named 'B300'" in capsys.readouterr().err

    def test_model_that_does_not_fit(self, capsys: pytest.CaptureFixture[str]) -> None:
        """Llama-3-70B on one H200 leaves no KV room: status 1, saying so."""
        assert main(["bench", "--model", "llama-3-70b", "--no-plots"]) == 1
        assert "does not fit" in capsys.readouterr().err


@needs_plots
class TestBench:
    def test_mixed_as_a_command(self, tmp_path: Path) -> None:
        """`phasesched bench mixed --output DIR` writes results.json, figures and prints the verdict."""
        out = tmp_path / "mixed"
        done = command("bench", "mixed", "--quick", "--output", str(out))
        assert done.returncode == 0, done.stderr
        data = results(out)
        assert list(data["experiments"]) == ["mixed_load"]
        assert data["verdict"]["winner"]["label"] in {r["label"] for r in data["experiments"]["mixed_load"]["rows"]}
        assert data["figures"] == ["mixed_load_gap_cdf.png", "mixed_load_budget.png"]
        assert_pngs(out, data["figures"])
        assert "Verdict:" in done.stdout
        assert "Mixed load" in done.stdout

    def test_suite_in_process(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """`bench --quick`: every suite experiment in results.json, each figure written, settings recorded."""
        assert main(["bench", "--quick", "--output", str(tmp_path), "--seed", "3"]) == 0
        data = results(tmp_path)
        assert list(data["experiments"]) == ["prefill_curve", "decode_curve", "mixed_load", "phase_split", "grid"]
        assert data["settings"]["hardware"] == "H200"
        assert data["settings"]["seed"] == 3
        assert data["settings"]["cost_model"] == "roofline"
        assert data["command"] == ["phasesched", "bench", "--quick", "--output", str(tmp_path), "--seed", "3"]
        assert set(data["figures"]) == {p.name for p in tmp_path.glob("*.png")}
        assert len(data["figures"]) == 6  # the phase split draws its TTFT budget and its TTFT-beside-ITL figure
        assert_pngs(tmp_path, data["figures"])
        for experiment in data["experiments"].values():
            assert experiment["rows"]
            assert experiment["wall_s"] > 0
        out = capsys.readouterr().out
        assert "Verdict:" in out
        assert "results.json" in out

    def test_quiet_prints_only_the_verdict_and_paths(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """--quiet leaves out tables; the verdict and the results path remain."""
        assert main(["bench", "mixed", "--quick", "--quiet", "--no-plots", "--output", str(tmp_path)]) == 0
        out = capsys.readouterr().out
        assert "Verdict:" in out
        assert "Mixed load" not in out
        assert not list(tmp_path.glob("*.png"))

    def test_plugin_policy_joins_mixed_load(self, tmp_path: Path) -> None:
        """`bench mixed --policy NAME` adds a policy found by its registered name to the comparison."""

        def factory(options: PolicyOptions) -> SchedulingPolicy:
            return attrs.evolve(load_policy("sarathi", attrs.evolve(options, chunk_size=192)), name="cli-test-policy")

        POLICIES.register("cli-test-policy", factory)
        try:
            status = main(
                [
                    "bench",
                    "mixed",
                    "--quick",
                    "--no-plots",
                    "--quiet",
                    "--policy",
                    "cli-test-policy",
                    "--output",
                    str(tmp_path),
                ]
            )
        finally:
            POLICIES.unregister("cli-test-policy")
        assert status == 0
        labels = [r["label"] for r in results(tmp_path)["experiments"]["mixed_load"]["rows"]]
        assert labels[-1] == "cli-test-policy"

    @pytest.mark.skipif("sjf" not in POLICIES, reason="examples/custom_policy (an entry-point plugin) not installed")
    def test_entry_point_plugin_joins_mixed_load(self, tmp_path: Path) -> None:
        """A policy installed through the phasesched.policies entry point joins the comparison too."""
        assert (
            main(["bench", "mixed", "--quick", "--no-plots", "--quiet", "--policy", "sjf", "--output", str(tmp_path)])
            == 0
        )
        assert "sjf" in [r["label"] for r in results(tmp_path)["experiments"]["mixed_load"]["rows"]]

    def test_replay(self, tmp_path: Path) -> None:
        """`bench replay --trace --policy a,b --rate`: a row per policy, at the requested rate, and its figure."""
        trace = tmp_path / "t.csv"
        write_trace(synthetic(30, Poisson(5.0), Uniform(32, 512), Uniform(4, 16), seed=2), trace)
        out = tmp_path / "out"
        assert (
            main(
                [
                    "bench",
                    "replay",
                    "--trace",
                    str(trace),
                    "--policy",
                    "vllm,sarathi",
                    "--rate",
                    "20",
                    "--quiet",
                    "--output",
                    str(out),
                ]
            )
            == 0
        )
        data = results(out)
        replay = data["experiments"]["replay"]
        assert [r["policy"] for r in replay["rows"]] == ["vllm", "sarathi"]
        assert replay["served_rate"] == pytest.approx(20.0)
        assert data["verdict"] is None
        assert_pngs(out, ["replay_cdf.png"])

    def test_cost_model_file_prices_the_steps(self, tmp_path: Path) -> None:
        """--cost-model uses the profiled table: a batch prefilled in one step takes the table's price for it."""
        table = tmp_path / "profile.csv"
        assert (
            main(
                [
                    "profile",
                    "--executor",
                    "sim",
                    "--quiet",
                    "--repeats",
                    "1",
                    "--warmup",
                    "0",
                    "--prefill-tokens",
                    "0,256,4096",
                    "--prefill-prefix",
                    "0",
                    "--decode-seqs",
                    "0,1",
                    "--decode-context",
                    "16,4096",
                    "--output",
                    str(table),
                ]
            )
            == 0
        )
        out = tmp_path / "out"
        assert (
            main(
                [
                    "bench",
                    "prefill",
                    "--quick",
                    "--no-plots",
                    "--quiet",
                    "--policy",
                    "no-chunk",
                    "--cost-model",
                    str(table),
                    "--output",
                    str(out),
                ]
            )
            == 0
        )
        data = results(out)
        assert data["settings"]["cost_model"] == str(table)
        model = ProfiledCostModel.from_csv(table)
        for row in data["experiments"]["prefill_curve"]["rows"]:
            batch = np.full(row["batch"], row["prompt_len"])  # no-chunk prefills the whole batch in one step
            assert row["first_ttft_ms"] == pytest.approx(model.step_time(batch, batch) * 1e3)


class TestTraceStats:
    @pytest.mark.skipif(not TRACES.is_dir(), reason="data/traces is absent")
    @pytest.mark.parametrize(
        ("name", "rows"),
        [
            ("AzureLLMInferenceTrace_code.csv", "8,819"),
            ("AzureLLMInferenceTrace_conv.csv", "19,366"),
            ("conversation_trace.jsonl", "12,031"),
        ],
    )
    def test_shared_traces(self, name: str, rows: str, capsys: pytest.CaptureFixture[str]) -> None:
        """Each staged trace's statistics table starts with its request count."""
        assert main(["trace", "stats", str(TRACES / name)]) == 0
        assert f"{rows} requests" in capsys.readouterr().out

    def test_generated_csv(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """A trace written by write_trace: the table is trace_stats' and --json its values."""
        path = tmp_path / "gen.csv"
        write_trace(synthetic(200, Poisson(4.0), Uniform(10, 900), Uniform(1, 50), seed=7), path)
        expected = trace_stats(load_trace(path))
        assert main(["trace", "stats", str(path)]) == 0
        assert capsys.readouterr().out.strip() == expected.format_table()
        assert main(["trace", "stats", str(path), "--json"]) == 0
        data = json.loads(capsys.readouterr().out)
        assert data["rows"] == 200
        assert data["mean_rate"] == pytest.approx(expected.mean_rate)
        assert data["prompt"]["max"] == expected.prompt.max

    def test_malformed_trace(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """A bad row fails with status 1 and names its line."""
        path = tmp_path / "bad.csv"
        path.write_text("arrival_s,prompt_len,output_len\n0.0,10,5\n0.5,ten,5\n")
        assert main(["trace", "stats", str(path)]) == 1
        assert "bad.csv:3: prompt_len is not an integer" in capsys.readouterr().err

    def test_missing_file(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """A missing file is status 1, not a traceback."""
        assert main(["trace", "stats", str(tmp_path / "none.csv")]) == 1
        assert "none.csv" in capsys.readouterr().err


class TestErrorsReachTheUser:
    """Refused input is one line on stderr with status 1; anything else is a bug and shows its traceback."""

    BINARY = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe"

    def one_line(self, err: str) -> str:
        """The single ``phasesched: error:`` line of ``err``, after checking it is the only line."""
        lines = err.strip().splitlines()
        assert len(lines) == 1, err
        assert lines[0].startswith("phasesched: error: ")
        assert "Traceback" not in err
        return lines[0]

    def test_a_binary_trace_is_named_as_not_a_text_trace(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """`trace stats` on a PNG names the file and says it is not a text trace."""
        path = tmp_path / "picture.csv"
        path.write_bytes(self.BINARY)
        assert main(["trace", "stats", str(path)]) == 1
        line = self.one_line(capsys.readouterr().err)
        assert str(path) in line
        assert "not a text trace" in line

    def test_a_binary_trace_is_refused_before_a_replay(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """`bench replay --trace` on a non-UTF-8 file fails the same way, before any run."""
        path = tmp_path / "latin1.csv"
        path.write_bytes("arrival_s,prompt_len,output_len\n0.0,10,5 # caf\u00e9\n".encode("latin-1"))
        argv = ["bench", "replay", "--trace", str(path), "--no-plots", "--output", str(tmp_path / "out")]
        assert main(argv) == 1
        assert "not a text trace" in self.one_line(capsys.readouterr().err)
        assert not (tmp_path / "out").exists()

    def test_a_binary_cost_model_is_named(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """`--cost-model` on a binary file names the file and says it is not a text profile."""
        path = tmp_path / "profile.csv"
        path.write_bytes(self.BINARY)
        assert main(["bench", "mixed", "--cost-model", str(path), "--no-plots"]) == 1
        line = self.one_line(capsys.readouterr().err)
        assert str(path) in line
        assert "not a text profile CSV" in line

    def test_an_empty_trace_is_one_line(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """`trace stats` on an empty JSON Lines file: a PhaseschedError, one line."""
        path = tmp_path / "empty.jsonl"
        path.write_text("")
        assert main(["trace", "stats", str(path)]) == 1
        assert "empty" in self.one_line(capsys.readouterr().err)

    def test_rows_years_apart(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """Two rows three years apart: the statistics come back (once they took 1.6 GB)."""
        path = tmp_path / "sparse.csv"
        path.write_text(f"arrival_s,prompt_len,output_len\n0,10,5\n{3 * 365 * 86_400},20,5\n")
        assert main(["trace", "stats", str(path)]) == 0
        assert "2 requests over 94,608,000 s" in capsys.readouterr().out

    def test_a_bug_is_not_reported_as_user_error(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """An unexpected ValueError inside a command propagates (a traceback), not a one-line 'error'."""
        path = tmp_path / "t.csv"
        path.write_text("arrival_s,prompt_len,output_len\n0,10,5\n")

        def broken(*_: object, **__: object) -> None:
            msg = "a bug"
            raise ValueError(msg)

        monkeypatch.setattr(cli, "trace_stats", broken)
        with pytest.raises(ValueError, match="a bug"):
            main(["trace", "stats", str(path)])

    def test_a_bug_prints_its_traceback(self, tmp_path: Path) -> None:
        """Run as a program, a bug prints the full traceback, and no `phasesched: error:` line."""
        path = tmp_path / "t.csv"
        path.write_text("arrival_s,prompt_len,output_len\n0,10,5\n")
        program = (
            "import sys, phasesched.cli as c\n"
            "def broken(*a, **k): raise ZeroDivisionError('a bug')\n"
            "c.trace_stats = broken\n"
            f"sys.exit(c.main(['trace', 'stats', {str(path)!r}]))\n"
        )
        done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=False)
        assert done.returncode == 1
        assert "Traceback (most recent call last)" in done.stderr
        assert "ZeroDivisionError: a bug" in done.stderr
        assert "phasesched: error" not in done.stderr

    def test_a_bad_executor_option_is_one_line(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """`profile --option` without '=' is refused in one line."""
        argv = ["profile", "--executor", "sim", "--option", "oops", "--output", str(tmp_path / "p.csv")]
        assert main(argv) == 1
        assert "--option expects KEY=VALUE" in self.one_line(capsys.readouterr().err)


class TestProfile:
    GRID = ("--prefill-tokens", "0,16", "--prefill-prefix", "0", "--decode-seqs", "0,1", "--decode-context", "16")

    def test_torch_executor(self, tmp_path: Path) -> None:
        """`profile --executor torch` writes a CSV with metadata that ProfiledCostModel reads."""
        pytest.importorskip("torch")
        pytest.importorskip("phasesched_torch")
        path = tmp_path / "torch.csv"
        assert (
            main(
                [
                    "profile",
                    "--executor",
                    "torch",
                    "--model",
                    "tiny",
                    "--device",
                    "cpu",
                    *self.GRID,
                    "--repeats",
                    "1",
                    "--warmup",
                    "0",
                    "--quiet",
                    "--output",
                    str(path),
                ]
            )
            == 0
        )
        points, metadata = read_profile_csv(path)
        assert len(points) == 4
        assert metadata["executor"] == "torch"
        assert metadata["model"] == "tiny"
        assert metadata["device"] == "cpu"
        assert metadata["hardware"] == "cpu"  # the executor's device_name (a GPU's own name on CUDA)
        assert all(p.step_time_s > 0 for p in points if p.prefill_tokens or p.decode_seqs)
        ProfiledCostModel.from_csv(path)

    def test_torch_executor_passes_and_decode_batching(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """`profile --passes 2` records the torch decode batching and the run-to-run spread; from_csv reads them."""
        pytest.importorskip("torch")
        from phasesched_torch._attention import DECODE_BATCHING  # noqa: PLC0415

        path = tmp_path / "torch.csv"
        argv = ["profile", "--executor", "torch", "--model", "tiny", "--device", "cpu", *self.GRID]
        assert main([*argv, "--passes", "2", "--repeats", "1", "--warmup", "0", "--quiet", "--output", str(path)]) == 0
        assert "declares no decode batching" not in capsys.readouterr().out
        points, metadata = read_profile_csv(path)
        assert len(points) == 4
        assert metadata["passes"] == "2"
        assert metadata["decode_batching"] == DECODE_BATCHING.to_metadata()
        assert metadata["decode_batching_declared"] == "yes"
        assert metadata["statistic"] == "median of 2 to 4 runs a point over 2 pass(es)"  # decode-only steps revisited
        assert float(metadata["run_to_run_spread"]) >= 0
        assert ProfiledCostModel.from_csv(path).decode_batching == DECODE_BATCHING

    def test_old_profile_is_named_in_the_bench_source(self, tmp_path: Path) -> None:
        """A profile without decode_batching still prices steps; the run says it reads decodes at their mean context."""
        table = tmp_path / "old.csv"
        grid = [
            ProfilePoint(p, 0, d, c, 1e-3 + 1e-6 * p + 1e-5 * d) for p in (0, 4096) for d in (0, 8) for c in (16, 4096)
        ]
        write_profile_csv(table, grid, {"executor": "sim"})
        out = tmp_path / "bench"
        argv = [
            "bench",
            "prefill",
            "--quick",
            "--no-plots",
            "--quiet",
            "--cost-model",
            str(table),
            "--output",
            str(out),
        ]
        assert main(argv) == 0
        source = results(out)["deployment"]["cost_model_source"]
        assert (
            source == f"profiled table {table} (it records no decode_batching: decodes are read at their mean context)"
        )

    def test_simulated_executor_matches_its_roofline(self, tmp_path: Path) -> None:
        """Profiling the sim executor measures exactly its roofline's step times."""
        path = tmp_path / "sim.csv"
        assert (
            main(
                [
                    "profile",
                    "--executor",
                    "sim",
                    "--model",
                    "llama-3-8b",
                    *self.GRID,
                    "--repeats",
                    "1",
                    "--quiet",
                    "--output",
                    str(path),
                ]
            )
            == 0
        )
        points, metadata = read_profile_csv(path)
        assert metadata["executor"] == "sim"
        roofline = RooflineCostModel.from_names("H200", "llama-3-8b")
        lone_decode = next(p for p in points if p.decode_seqs == 1 and p.prefill_tokens == 0)
        assert lone_decode.step_time_s == pytest.approx(roofline.step_time(np.array([1]), np.array([16])))

    def test_option_the_executor_does_not_take(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """An option the factory does not accept is refused, naming what it does take."""
        assert main(["profile", "--executor", "sim", "--device", "cuda", "--output", str(tmp_path / "x.csv")]) == 1
        err = capsys.readouterr().err
        assert "does not take device" in err
        assert "hardware" in err

    def test_executor_without_timing(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """The deterministic executor makes no timing claim, so it cannot be profiled."""
        assert main(["profile", "--executor", "deterministic", "--output", str(tmp_path / "x.csv")]) == 1
        assert "duration_s=None" in capsys.readouterr().err

    def test_unknown_executor(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """An unknown executor lists the registered ones."""
        assert main(["profile", "--executor", "nope", "--output", str(tmp_path / "x.csv")]) == 1
        assert "known:" in capsys.readouterr().err


def test_policies_lists_the_presets(capsys: pytest.CaptureFixture[str]) -> None:
    """`phasesched policies` prints every registered name with its summary."""
    assert main(["policies"]) == 0
    out = capsys.readouterr().out
    for name in POLICIES.names():
        assert name in out
    assert "`" not in out  # docstring markup (":func:`orca`", "``sjf``") is shown as plain text
    assert ":func:" not in out
    assert "Alias of orca" in out


class TestBenchWithoutExtras:
    def test_without_matplotlib_or_rich_warns_and_writes_results(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Without the [bench] extra, bench warns, draws no figures, and still writes results.json and tables."""
        for module in ("matplotlib", "matplotlib.figure", "rich", "rich.console"):
            monkeypatch.setitem(sys.modules, module, None)  # importing them now raises ImportError
        assert main(["bench", "mixed", "--quick", "--output", str(tmp_path)]) == 0
        captured = capsys.readouterr()
        assert "warning" in captured.err
        assert "matplotlib" in captured.err
        data = results(tmp_path)
        assert data["figures"] == []
        assert data["experiments"]["mixed_load"]["rows"]
        assert not list(tmp_path.glob("*.png"))
        assert "Mixed load" in captured.out  # the plain-text table
        assert "Verdict:" in captured.out


MOONCAKE = TRACES / "conversation_trace.jsonl"


@pytest.mark.skipif(not MOONCAKE.is_file(), reason="data/traces is absent")
class TestReplayOfMooncake:
    ARGV = (
        *("bench", "replay", "--hardware", "H100-SXM", "--model", "llama-3-70b", "--tp", "2"),
        *("--trace", str(MOONCAKE), "--limit", "30", "--policy", "vllm", "--no-plots", "--quiet"),
    )

    def test_unservable_requests_fail_and_the_replay_goes_on(self, tmp_path: Path) -> None:
        """Prompts too big for 2 x H100's KV are counted as failed, with the reason; the rest complete."""
        assert main([*self.ARGV, "--output", str(tmp_path)]) == 0
        row = results(tmp_path)["experiments"]["replay"]["rows"][0]
        assert row["failed"] > 0
        assert row["completed"] > 0
        assert row["completed"] + row["failed"] == 30
        assert "rejected" in row["errors"][0]

    def test_spread_ticks(self, tmp_path: Path) -> None:
        """--spread-ticks spreads Mooncake's shared timestamps: recorded in settings, and the latencies change."""
        assert main([*self.ARGV, "--output", str(tmp_path / "together")]) == 0
        assert main([*self.ARGV, "--spread-ticks", "--output", str(tmp_path / "spread")]) == 0
        together, spread = results(tmp_path / "together"), results(tmp_path / "spread")
        assert (together["settings"]["spread_ticks"], spread["settings"]["spread_ticks"]) == (False, True)
        ttft = [r["experiments"]["replay"]["rows"][0]["mean_ttft_ms"] for r in (together, spread)]
        assert ttft[0] != ttft[1]


@pytest.mark.slow
@needs_plots
def test_plain_bench_runs_the_seed_suite(tmp_path: Path) -> None:
    """Plain `phasesched bench` (full sizes) ends with its verdict; `benchmarks/speed_checks.py --suite` times it."""
    done = command("bench", "--output", str(tmp_path), timeout=900)
    assert done.returncode == 0, done.stderr
    data = results(tmp_path)
    assert data["settings"]["quick"] is False
    grid = data["experiments"]["grid"]["rows"]
    assert len(grid) == 36 * len(REPRESENTATIVE_POLICIES)  # 3 prompts x 3 outputs x 4 concurrencies each
    assert {row["policy"] for row in grid} == set(REPRESENTATIVE_POLICIES)
    assert data["verdict"]["winner"]["prefill_vs_baseline"] >= 0.9
    assert "Verdict:" in done.stdout


@pytest.mark.skipif(not MOONCAKE.is_file(), reason="data/traces is absent")
def test_bench_prefix_cache_end_to_end(tmp_path: Path) -> None:
    """`bench prefix-cache --quick` serves the chats and the shipped Mooncake trace: table, best chunk, JSON."""
    done = command("bench", "prefix-cache", "--quick", "--limit", "8", "--no-plots", "--output", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "best chunk" in done.stdout
    assert "mooncake-conversation" in done.stdout
    experiment = results(tmp_path)["experiments"]["prefix_cache"]
    rows = experiment["rows"]
    assert {r["cache"] for r in rows} == {"on", "off"}
    assert any(r["workload"].startswith("shared-prefix") for r in rows)
    assert all(r["best_chunk"] == experiment["best_chunk"][f"{r['workload']}/vllm/{r['cache']}"] for r in rows)
    assert any(r["hit_rate"] > 0 for r in rows if r["workload"] == "mooncake-conversation" and r["cache"] == "on")
