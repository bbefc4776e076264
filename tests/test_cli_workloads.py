"""``bench`` expresses any workload and deployment from the command line, as ``tune`` does (issue #15, item 7)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from phasesched.cli import main
from phasesched.experiments.context import ExperimentContext, jsonable
from phasesched.experiments.replay import ReplayConfig, run_replay
from phasesched.sim import synthetic, write_trace
from phasesched.sim.arrivals import Gamma, Poisson
from phasesched.sim.deployment import Deployment
from phasesched.sim.lengths import Empirical, LogNormal, Uniform

SYNTHETIC = (
    "bench", "replay", "--arrivals", "gamma", "--cv", "3", "--rate", "6", "--requests", "40",
    "--prompt-len", "lognormal:768:0.8:16:4096", "--output-len", "uniform:8:64", "--seed", "3",
    "--policy", "vllm,sarathi", "--no-plots", "--quiet",
)  # fmt: skip


def results(folder: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((folder / "results.json").read_text())
    return data


def json_rows(values: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
    """Rows as results.json stores them (tuples as lists, nan as None)."""
    out: list[dict[str, Any]] = jsonable(values)
    return out


def rows(folder: Path) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = results(folder)["experiments"]["replay"]["rows"]
    return [{k: v for k, v in r.items() if k != "sim_wall_s"} for r in out]


class TestSyntheticWorkloads:
    def test_the_cli_serves_what_the_api_builds(self, tmp_path: Path) -> None:
        """Gamma arrivals at a rate, log-normal prompts, uniform outputs, N requests: the Python API's rows."""
        deployed = ["--tp", "2", "--replicas", "2", "--gpu-memory-utilization", "0.8", "--watermark", "0.02"]
        knobs = ["--chunk-size", "1024", "--token-budget", "2048", "--max-num-seqs", "32"]
        assert main([*SYNTHETIC, *deployed, *knobs, "--output", str(tmp_path)]) == 0
        data = results(tmp_path)
        workload = synthetic(40, Gamma(6.0, 3.0), LogNormal(768, 0.8, 16, 4096), Uniform(8, 64), seed=3)
        deployment = Deployment(tensor_parallel=2, gpu_memory_utilization=0.8, watermark=0.02)
        options = {"chunk_size": 1024, "max_num_batched_tokens": 2048, "max_num_seqs": 32}
        context = ExperimentContext(deployment, ("vllm", "sarathi"), 3, policy_options=options)
        expected = run_replay(context, ReplayConfig(workload, rate=6.0, limit=40, replicas=2)).rows
        assert rows(tmp_path) == [{k: v for k, v in r.items() if k != "sim_wall_s"} for r in json_rows(expected)]
        assert {r["gpus"] for r in rows(tmp_path)} == {4}
        assert data["settings"]["policy_options"] == options
        assert data["settings"]["replicas"] == 2
        assert data["settings"]["synthetic"]["arrivals"] == "gamma"
        assert data["settings"]["synthetic"]["requests"] == 40
        assert data["settings"]["kv_pages"] == deployment.kv_pages()
        assert data["deployment"]["tensor_parallel"] == 2

    def test_poisson_at_a_rate(self, tmp_path: Path) -> None:
        """Poisson arrivals with fixed lengths: N requests served at the rate asked for."""
        argv = [
            "bench", "replay", "--arrivals", "poisson", "--rate", "20", "--requests", "25", "--prompt-len", "256",
            "--output-len", "fixed:16", "--policy", "vllm", "--no-plots", "--quiet", "--output", str(tmp_path),
        ]  # fmt: skip
        assert main(argv) == 0
        replay = results(tmp_path)["experiments"]["replay"]
        assert replay["served_rate"] == pytest.approx(20.0)
        assert replay["rows"][0]["completed"] == 25
        assert replay["rows"][0]["total_input_tokens"] == 25 * 256
        assert replay["rows"][0]["total_output_tokens"] == 25 * 16

    def test_lengths_sampled_from_a_trace(self, tmp_path: Path) -> None:
        """trace:FILE:prompt and trace:FILE:output draw lengths from a trace's, with synthetic arrivals."""
        trace = tmp_path / "t.csv"
        source = synthetic(30, Poisson(5.0), Uniform(100, 900), Uniform(5, 40), seed=2)
        write_trace(source, trace)
        argv = [
            "bench", "replay", "--arrivals", "poisson", "--rate", "4", "--requests", "20",
            "--prompt-len", f"trace:{trace}:prompt", "--output-len", f"trace:{trace}:output",
            "--policy", "vllm", "--no-plots", "--quiet", "--output", str(tmp_path / "out"),
        ]  # fmt: skip
        assert main(argv) == 0
        expected = synthetic(20, Poisson(4.0), Empirical(source.prompt_len), Empirical(source.output_len), seed=0)
        row = results(tmp_path / "out")["experiments"]["replay"]["rows"][0]
        assert row["total_input_tokens"] == int(expected.prompt_len.sum())
        assert row["total_output_tokens"] == int(expected.output_len.sum())

    def test_the_suite_adds_a_replay_of_the_synthetic_workload(self, tmp_path: Path) -> None:
        """Plain bench with a synthetic workload runs the suite and then replays it, as it does a trace."""
        argv = [
            "bench", "--quick", "--arrivals", "poisson", "--rate", "8", "--requests", "12", "--policy", "vllm",
            "--no-plots", "--quiet", "--output", str(tmp_path),
        ]  # fmt: skip
        assert main(argv) == 0
        assert list(results(tmp_path)["experiments"])[-1] == "replay"


class TestDeploymentAndPolicyFlags:
    def test_flags_equal_policy_options(self, tmp_path: Path) -> None:
        """--chunk-size/--token-budget/--max-num-seqs are the PolicyOptions fields --policy-option sets."""
        flags = ["--chunk-size", "256", "--token-budget", "512", "--max-num-seqs", "8"]
        pairs = ["--policy-option", "chunk_size=256", "--policy-option", "max_num_batched_tokens=512"]
        pairs += ["--policy-option", "max_num_seqs=8"]
        assert main([*SYNTHETIC, *flags, "--output", str(tmp_path / "flags")]) == 0
        assert main([*SYNTHETIC, *pairs, "--output", str(tmp_path / "pairs")]) == 0
        assert main([*SYNTHETIC, "--output", str(tmp_path / "plain")]) == 0
        assert rows(tmp_path / "flags") == rows(tmp_path / "pairs")
        assert rows(tmp_path / "flags") != rows(tmp_path / "plain")

    def test_a_flag_and_an_option_that_disagree(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """One field set to two values is refused in one line, before any run."""
        argv = [*SYNTHETIC, "--chunk-size", "256", "--policy-option", "chunk_size=512", "--output", str(tmp_path)]
        assert main(argv) == 1
        assert "--chunk-size 256 and --policy-option chunk_size=512 disagree" in capsys.readouterr().err

    def test_more_replicas_shorten_the_queue(self, tmp_path: Path) -> None:
        """At a rate one worker cannot keep up with, two replicas cut the p99 TTFT, on twice the GPUs."""
        base = [
            "bench", "replay", "--arrivals", "poisson", "--rate", "40", "--requests", "60",
            "--prompt-len", "4096", "--output-len", "8", "--policy", "vllm", "--no-plots", "--quiet",
        ]  # fmt: skip
        assert main([*base, "--output", str(tmp_path / "one")]) == 0
        assert main([*base, "--replicas", "2", "--output", str(tmp_path / "two")]) == 0
        (one,), (two,) = rows(tmp_path / "one"), rows(tmp_path / "two")
        assert (one["gpus"], two["gpus"]) == (1, 2)
        assert two["p99_ttft_ms"] < one["p99_ttft_ms"] / 2

    def test_explicit_kv_pages(self, tmp_path: Path) -> None:
        """--num-pages sets the KV capacity every worker has, recorded in results.json."""
        argv = [*SYNTHETIC, "--num-pages", "900", "--page-size", "32", "--output", str(tmp_path)]
        assert main(argv) == 0
        settings = results(tmp_path)["settings"]
        assert (settings["kv_pages"], settings["page_size"]) == (900, 32)


class TestUsage:
    @pytest.mark.parametrize(
        ("argv", "says"),
        [
            (["bench", "replay", "--arrivals", "poisson"], "needs --rate"),
            (["bench", "replay", "--trace", "t.csv", "--arrivals", "poisson", "--rate", "1"], "not both"),
            (["bench", "replay"], "--trace FILE or a synthetic workload"),
            (["bench", "--requests", "0"], "positive int"),
            (["bench", "--replicas", "0"], "positive int"),
            (["bench", "--prompt-len", "zipf:3"], "unknown length distribution"),
            (["tune", "--gpus", "2", "--limit", "0"], "positive int"),
        ],
    )
    def test_exit_2(self, argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
        """A workload the options cannot describe is a usage error that says why."""
        assert main(argv) == 2
        assert says in capsys.readouterr().err
