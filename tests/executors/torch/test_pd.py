"""Disaggregated prefill and decode as real processes: tokens as aggregated, and faults with nothing lost.

Each test launches a small job (tiny Llama, gloo on CPU, 2-3 processes) through
:func:`phasesched_torch.pd.launch`, which kills whatever outlives its timeout, and checks what
the router and every rank reported.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from phasesched.pd import Faults
from phasesched_torch._pd import run_aggregated
from phasesched_torch.pd import PDRunConfig, PDRunResult, RequestSpec, launch

PROMPTS = (5, 17, 33, 48, 9, 26)


def _config(**overrides: Any) -> PDRunConfig:
    base: dict[str, Any] = {
        "requests": tuple(RequestSpec(p, 10, 0.05 * i) for i, p in enumerate(PROMPTS)),
        "chunk_size": 8,
        "decode_pages": 24,
        "transfer_timeout_s": 1.5,
        "peer_timeout_s": 4.0,  # well above a pull's timeout: a loaded CI machine starves processes
        "run_timeout_s": 40.0,
    }
    base.update(overrides)
    return PDRunConfig(**base)


def _check_nothing_lost(
    result: PDRunResult,
    config: PDRunConfig,
    *,
    killed: tuple[int, ...] = (),
    silent: tuple[int, ...] = (),
    failed: tuple[str, ...] = (),
) -> None:
    """Every request but ``failed`` finished with the aggregated run's tokens; no page leaked; live ranks exited 0."""
    reference = run_aggregated(config)
    for request_id, record in result.requests.items():
        if request_id in failed:
            assert record["state"] == "failed", record
            assert record["output_token_ids"] is None
            continue
        assert record["state"] == "finished", (request_id, record["errors"])
        assert tuple(record["output_token_ids"]) == reference[request_id], request_id
    assert set(result.workers) == set(range(config.world_size)) - set(killed)
    for rank, report in result.workers.items():
        assert report["invariant_error"] is None, (rank, report)
        assert report["leaked_pages"] == 0, (rank, report)
        if rank not in silent:  # a worker declared dead may be left with work it was given
            assert (report["unfinished"], report["held"]) == (0, 0), (rank, report)
    assert set(killed) <= set(result.dead) <= set(killed + silent)  # a silent one may wake before it is declared dead
    for rank, code in result.exit_codes.items():
        assert code == (-9 if rank in killed else 0), result.exit_codes


class TestDisaggregatedRun:
    @pytest.mark.parametrize("eager_send", [True, False])
    def test_tokens_match_the_aggregated_run(self, eager_send: bool) -> None:
        """1P:1D with chunked prefill and decode-side preemption gives the aggregated run's greedy tokens."""
        specs = tuple(RequestSpec(p, 16) for p in PROMPTS)  # all at once: the decode side must preempt
        config = _config(requests=specs, decode_pages=20, eager_send=eager_send)
        result = launch(config)
        _check_nothing_lost(result, config)
        assert sum(r["num_preemptions"] for r in result.requests.values()) > 0  # decode-side preemption
        assert all(r["attempt"] == 0 for r in result.requests.values())
        decode = result.workers[1]["transfers"]
        assert sorted(t["request_id"] for t in decode) == sorted(result.requests)
        assert all(t["nbytes"] == result.requests[t["request_id"]]["nbytes"] for t in decode)


class TestFaults:
    def test_killed_decode_worker(self) -> None:
        """1P:2D: a decode worker killed mid-run loses nothing; its requests are re-prefilled and served elsewhere."""
        config = _config(num_decode=2, faults=Faults(kill_rank=1, kill_after_steps=6), peer_timeout_s=3.0)
        result = launch(config)
        _check_nothing_lost(result, config, killed=(1,))
        assert any("decode worker 1" in " ".join(r["errors"]) for r in result.requests.values())

    def test_dropped_and_corrupted_transfers(self) -> None:
        """A dropped transfer (timeout) and a corrupted one (checksum) are each re-prefilled; nothing leaks."""
        config = _config(faults=Faults(drop_transfer={"r1"}, corrupt_transfer={"r3"}))
        result = launch(config)
        _check_nothing_lost(result, config)
        r1, r3 = result.requests["r1"], result.requests["r3"]
        assert r1["attempt"] == 1
        assert "no answer" in r1["errors"][0]
        assert r3["attempt"] == 1
        assert "checksum" in r3["errors"][0]
        assert all(r["attempt"] == 0 for k, r in result.requests.items() if k not in ("r1", "r3"))

    def test_no_attempts_left_fails_with_the_reason(self) -> None:
        """With one attempt allowed, a dropped transfer fails its request with the reason; the rest are served."""
        config = _config(faults=Faults(drop_transfer={"r2"}), max_attempts=1)
        result = launch(config)
        _check_nothing_lost(result, config, failed=("r2",))
        errors = result.requests["r2"]["errors"]
        assert "no answer" in errors[0]
        assert "gave up" in errors[-1]

    def test_silent_prefill_worker(self) -> None:
        """2P:1D: a prefill worker that stops answering is declared dead; its requests are served by the other."""
        stall = Faults(stall_rank=1, stall_after_steps=1, stall_s=6.0)
        specs = tuple(RequestSpec(p, 10) for p in PROMPTS)  # all at once: both prefill workers get some
        config = _config(num_prefill=2, requests=specs, faults=stall, max_attempts=5)
        result = launch(config)
        _check_nothing_lost(result, config, silent=(1,))  # it wakes, hears the shutdown and reports
        errors = " ".join(e for r in result.requests.values() for e in r["errors"])
        assert "prefill worker 1" in errors


class TestPhaseSplitExample:
    def test_example_measures_and_compares(self, tmp_path: Path) -> None:
        """examples/pd_runtime.py runs a real 1P:1D split and reports every TTFT component beside the simulator's."""
        example = Path(__file__).resolve().parents[3] / "examples" / "pd_runtime.py"
        output = tmp_path / "pd.json"
        done = subprocess.run(
            [
                sys.executable,
                str(example),
                "--requests",
                "3",
                "--prompt-lens",
                "16,40",
                "--repeats",
                "2",
                "--output",
                str(output),
            ],
            capture_output=True,
            text=True,
            timeout=240,
            check=False,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        data = json.loads(output.read_text())
        assert [row["component"] for row in data["components"]] == [
            "queue",
            "prefill",
            "transfer",
            "first_decode",
            "ttft",
        ]
        assert len(data["transfers"]) == 3
        assert data["link"]["bandwidth_bytes_per_s"] > 0
