"""Report writing: tables, results.json, PNG figures, the terminal UI and the optional-dependency errors."""

from __future__ import annotations

import io
import json
import math
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from phasesched.experiments import (
    Column,
    DecodeCurveConfig,
    ExperimentContext,
    ExperimentResult,
    MixedLoadConfig,
    PhaseSplitConfig,
    PrefillCurveConfig,
    ReplayConfig,
    ReplayResult,
    run_decode_curve,
    run_mixed_load,
    run_phase_split,
    run_prefill_curve,
    run_replay,
)
from phasesched.report import (
    MissingExtraError,
    TerminalUI,
    _tables,
    format_cell,
    format_table,
    loss_note,
    print_table,
    require_plotting,
    write_figures,
    write_results_json,
)
from phasesched.report import _plots as plots_module
from phasesched.sim import Deployment, Workload, fixed

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk (which must come first)."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


@pytest.fixture(scope="module")
def results() -> list[ExperimentResult]:
    context = ExperimentContext()
    return [
        run_prefill_curve(context, PrefillCurveConfig.quick()),
        run_decode_curve(context, DecodeCurveConfig.quick()),
        run_mixed_load(context, MixedLoadConfig.quick()),
        run_phase_split(context, PhaseSplitConfig.quick()),
        run_replay(ExperimentContext(policies=("vllm", "sarathi")), ReplayConfig(fixed(6, 256, 8, rate=10.0))),
    ]


class TestTables:
    def test_cells(self) -> None:
        """Numbers follow the column's spec; missing values are '-'; whole floats fit integer specs."""
        assert format_cell(1234.5678, Column("k", "h")) == "1,234.6"
        assert format_cell(None, Column("k", "h")) == "-"
        assert format_cell(math.nan, Column("k", "h")) == "-"
        assert format_cell(300.0, Column("k", "h", ",d")) == "300"
        assert format_cell(0.915, Column("k", "h", ".1%")) == "91.5%"
        assert format_cell("sarathi", Column("k", "h")) == "sarathi"

    def test_plain_table(self, results: list[ExperimentResult]) -> None:
        """Title, headers, a rule and one aligned line per row: text left, numbers right."""
        mixed = results[2]
        lines = format_table(mixed).splitlines()
        assert lines[0] == mixed.title
        assert lines[1].split()[:2] == ["config", "GPUs"]
        assert set(lines[2]) <= {"-", " "}
        assert len(lines) == 3 + len(mixed.rows)
        assert lines[3].startswith("no-chunk ")
        widths = {len(line) for line in lines[1:]}
        assert len(widths) == 1  # right-aligned numbers end every line in the same column

    def test_print_table_without_rich(self, results: list[ExperimentResult], monkeypatch: pytest.MonkeyPatch) -> None:
        """Without rich installed the table is printed as plain text."""
        monkeypatch.setattr(_tables, "rich_available", lambda: False)
        out = io.StringIO()
        print_table(results[0], file=out)
        assert out.getvalue().startswith(format_table(results[0]))

    def test_print_table_with_rich(self, results: list[ExperimentResult]) -> None:
        """With rich, every row's label and the title appear."""
        pytest.importorskip("rich")
        out = io.StringIO()
        print_table(results[2], file=out)
        text = out.getvalue()
        assert "Mixed load" in text
        for row in results[2].rows:
            assert row["label"][:5] in text


class TestResultsJson:
    def test_strict_json_with_nulls(self, tmp_path: Path) -> None:
        """NaN and infinities become null, numpy values plain numbers, tuples lists; the file is strict JSON."""
        payload = {"a": math.nan, "b": np.float64(2.5), "c": (1, np.int64(2)), "d": {"e": np.array([1.0, np.inf])}}
        path = write_results_json(tmp_path / "results.json", payload)

        def refuse(constant: str) -> None:
            raise AssertionError(constant)

        data = json.loads(path.read_text(), parse_constant=refuse)
        assert data == {"a": None, "b": 2.5, "c": [1, 2], "d": {"e": [1.0, None]}}

    def test_experiment_dicts_serialize(self, results: list[ExperimentResult], tmp_path: Path) -> None:
        """Every experiment's to_dict() writes and reads back with its rows."""
        payload = {r.name: r.to_dict() for r in results}
        data = json.loads(write_results_json(tmp_path / "r.json", payload).read_text())
        assert set(data) == {"prefill_curve", "decode_curve", "mixed_load", "phase_split", "replay"}
        for result in results:
            assert len(data[result.name]["rows"]) == len(result.rows)


class TestFigures:
    def test_subtitle_names_what_was_simulated(
        self, results: list[ExperimentResult], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The subtitle given to write_figures is drawn on every figure (as the figure's suptitle)."""
        pytest.importorskip("matplotlib")
        seen = []
        original = plots_module._save

        def spy(figure: Any, path: Path, subtitle: str = "") -> Any:
            seen.append(subtitle)
            return original(figure, path, subtitle)

        monkeypatch.setattr(plots_module, "_save", spy)
        write_figures(results, tmp_path, subtitle="H200 x 1 (TP1) serving llama-3-8b; cost model: roofline")
        assert seen
        assert set(seen) == {"H200 x 1 (TP1) serving llama-3-8b; cost model: roofline"}

    def test_every_figure_is_a_png(self, results: list[ExperimentResult], tmp_path: Path) -> None:
        """write_figures draws each supported figure as a real PNG of a sensible size."""
        pytest.importorskip("matplotlib")
        paths = write_figures(results, tmp_path)
        assert [p.name for p in paths] == [
            "prefill_curve.png",
            "decode_curve.png",
            "mixed_load_gap_cdf.png",
            "mixed_load_budget.png",
            "phase_split_budget.png",
            "phase_split_latency.png",
            "replay_cdf.png",
        ]
        for path in paths:
            width, height = png_size(path)
            assert 300 < width < 3000
            assert 150 < height < 2000

    def test_missing_matplotlib_says_how_to_install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Without matplotlib the error names the extra to install."""
        for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
            monkeypatch.delitem(sys.modules, name)
        monkeypatch.setitem(sys.modules, "matplotlib", None)
        monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
        with pytest.raises(MissingExtraError, match=r'pip install "phasesched\[bench\]"'):
            require_plotting()


class TestTerminalUI:
    def test_quiet_shows_only_what_must_be_shown(self, results: list[ExperimentResult]) -> None:
        """Quiet: no tables, no ordinary messages; `always` messages still appear."""
        out = io.StringIO()
        with TerminalUI(quiet=True, stream=out) as ui:
            ui("task", 1, 2)
            ui.table(results[0])
            ui.message("hidden")
            ui.message("shown", always=True)
        assert out.getvalue() == "shown\n"

    def test_not_a_terminal_gets_plain_text(self, results: list[ExperimentResult]) -> None:
        """Writing to a file: plain tables and messages, no progress bar."""
        out = io.StringIO()
        with TerminalUI(stream=out) as ui:
            ui("task", 1, 2)
            ui.table(results[1])
            ui.message("done")
        assert out.getvalue() == format_table(results[1]) + "\n\ndone\n"

    def test_a_long_task_logs_its_progress_every_half_minute(self) -> None:
        """Without a bar, a task running past 30 s prints where it is, then its end; short tasks print nothing."""
        times = iter([0.0, 10.0, 31.0, 45.0, 62.0, 3725.0, 100.0, 101.0])
        out = io.StringIO()
        with TerminalUI(stream=out, clock=lambda: next(times)) as ui:
            for done in range(6):  # the clock reads 0, 10, 31, 45, 62 and 3725 s
                ui("capacity search", done, 5)
            ui("quick", 0, 1)  # 100 s
            ui("quick", 1, 1)  # 101 s: a second in, nothing to say
        assert out.getvalue().splitlines() == [
            "capacity search: 2/5 (31s)",
            "capacity search: 4/5 (1m02s)",
            "capacity search: 5/5 (1h02m05s)",
        ]


@pytest.fixture(scope="module")
def cut() -> ReplayResult:
    """A replay where two requests ask for more output than a 4,096-token context leaves."""
    context = ExperimentContext(Deployment(max_model_len=4096), policies=("vllm", "sarathi"))
    return run_replay(context, ReplayConfig(Workload("long", [0.0, 0.1], [4000, 10], [200, 4100])))


class TestLossNote:
    """Outputs cut short by the context limit are named under the table, even when quiet."""

    def test_the_note_names_requests_and_tokens_per_row(self, cut: ReplayResult) -> None:
        """Each policy's row is named with its cut requests and lost tokens."""
        note = loss_note(cut)
        assert note == (
            "Outputs cut short to fit max_model_len (vllm: 2 requests, 118 tokens; sarathi: 2 requests, 118 tokens)"
        )

    @pytest.mark.parametrize("quiet", [False, True])
    def test_the_terminal_shows_it_quiet_or_not(self, cut: ReplayResult, quiet: bool) -> None:
        """The note follows the table, and stays when quiet hides the table."""
        out = io.StringIO()
        with TerminalUI(quiet=quiet, stream=out) as ui:
            ui.table(cut)
        table = "" if quiet else format_table(cut) + "\n\n"
        assert out.getvalue() == f"{table}Note: {loss_note(cut)}\n"

    def test_no_note_when_nothing_was_cut(self, results: list[ExperimentResult]) -> None:
        """Experiments that lose nothing print no note."""
        assert [loss_note(r) for r in results] == [None] * len(results)


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class TestTerminalUIOnATerminal:
    def test_progress_bars_come_and_go(self, results: list[ExperimentResult]) -> None:
        """On a terminal a bar per task appears and is removed once the task completes; tables use rich."""
        pytest.importorskip("rich")
        out = FakeTerminal()
        with TerminalUI(stream=out) as ui:
            ui("mixed load", 1, 3)
            assert list(ui._tasks) == ["mixed load"]
            ui("mixed load", 3, 3)
            assert ui._tasks == {}
            ui.table(results[2])
            ui.message("done")
        text = out.getvalue()
        assert "Mixed load" in text
        assert "no-chunk on 1P:1D" in text
        assert "done" in text


def test_import_stays_light() -> None:
    """Importing phasesched, its experiments, report and CLI loads neither matplotlib nor rich."""
    code = (
        "import sys, phasesched, phasesched.experiments, phasesched.report, phasesched.cli; "
        "print(sorted(m for m in ('matplotlib', 'rich', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
