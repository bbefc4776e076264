"""Trace loading, writing and statistics, on the staged real traces and on small hand-made files."""

from __future__ import annotations

import json
import math
import tempfile
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phasesched import PhaseschedError
from phasesched.sim import (
    Gamma,
    LogNormal,
    TraceFormat,
    TraceFormatError,
    Uniform,
    Workload,
    _trace_parsers,
    load_trace,
    synthetic,
    trace_stats,
    write_trace,
)

REPO = Path(__file__).resolve().parents[2]
# The repository carries copies of the shared traces; a checkout beside ../shared can use those.
TRACES = next(
    (p for p in (REPO / "data" / "traces", REPO.parent / "shared" / "traces") if p.is_dir()), REPO / "data" / "traces"
)
AZURE_CODE = "AzureLLMInferenceTrace_code.csv"
AZURE_CONV = "AzureLLMInferenceTrace_conv.csv"
MOONCAKE = "conversation_trace.jsonl"

# From shared/traces/README.md: rows, mean rate, inter-arrival CV, per-second and per-minute count CV,
# then (mean, p50, p90, p99, max) of input and of output tokens, at the README's printed precision.
README = {
    AZURE_CODE: (
        8_819,
        2.566,
        13.15,
        2.27,
        1.04,
        (2_047.8, 1_469, 5_187.6, 7_436, 7_437),
        (27.9, 13, 55, 251.5, 1_899),
    ),
    AZURE_CONV: (
        19_366,
        5.530,
        1.09,
        0.50,
        0.22,
        (1_154.7, 1_020, 2_734.5, 4_142, 14_050),
        (211.1, 129, 424, 601, 1_000),
    ),
    MOONCAKE: (
        12_031,
        3.401,
        3.03,
        None,
        0.12,
        (12_035.1, 6_909, 27_367, 85_400.4, 126_195),
        (342.6, 350, 597, 1_118.5, 2_000),
    ),
}


def shared(name: str) -> Path:
    path = TRACES / name
    if not path.exists():
        pytest.skip(f"shared trace {path} is not staged")
    return path


@pytest.fixture(scope="module")
def loaded() -> dict[str, Workload]:
    """Each staged trace, loaded once per module."""
    return {name: load_trace(shared(name)) for name in README}


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def assert_same_rows(a: Workload, b: Workload) -> None:
    for column in ("arrival_s", "prompt_len", "output_len", "priority"):
        np.testing.assert_array_equal(getattr(a, column), getattr(b, column))


class TestSharedTraces:
    @pytest.mark.parametrize("name", list(README))
    def test_row_counts_and_dtypes(self, loaded: dict[str, Workload], name: str) -> None:
        """Every row of each staged file is loaded, from time 0, with int64 lengths."""
        w = loaded[name]
        assert len(w) == README[name][0]
        assert w.arrival_s[0] == 0.0
        assert w.prompt_len.dtype == np.int64
        assert w.name == Path(name).stem

    @pytest.mark.parametrize("name", list(README))
    def test_stats_match_the_readme(self, loaded: dict[str, Workload], name: str) -> None:
        """Rates, burstiness and length percentiles agree with the README's table to its precision."""
        rows, rate, cv, per_second, per_minute, prompt, output = README[name]
        s = trace_stats(loaded[name])
        assert s.rows == rows
        assert round(s.mean_rate, 3) == rate
        assert round(s.interarrival_cv, 2) == cv
        if per_second is not None:
            assert round(s.per_second_cv, 2) == per_second
        assert round(s.per_minute_cv, 2) == per_minute
        for stats, expected in ((s.prompt, prompt), (s.output, output)):
            assert (round(stats.mean, 1), stats.p50, round(stats.p90, 1), round(stats.p99, 1), stats.max) == expected

    def test_azure_details(self, loaded: dict[str, Workload]) -> None:
        """Code-trace extremes from the README: 217.2 s longest gap, 67 requests in one second, min lengths."""
        s = trace_stats(loaded[AZURE_CODE])
        assert round(s.max_gap_s, 1) == 217.2
        assert round(s.median_gap_s, 3) == 0.064
        assert s.max_per_second == 67
        assert (s.prompt.min, s.output.min) == (3, 6)
        assert round(s.span_s, 1) == 3_435.9
        conv = trace_stats(loaded[AZURE_CONV])
        assert (conv.max_per_second, round(conv.span_s, 1), conv.output.min) == (16, 3_501.7, 7)

    def test_azure_timestamps_are_exact(self, loaded: dict[str, Workload]) -> None:
        """Seven-digit timestamps survive exactly (differences of whole 100 ns ticks)."""
        code = loaded[AZURE_CODE]
        assert code.arrival_s[1] == 0.052  # 18:17:04.0319600 - 18:17:03.9799600
        assert code.arrival_s[-1] == 3_435.948056  # 19:14:19.9280160 - 18:17:03.9799600

    def test_mooncake_grid(self, loaded: dict[str, Workload]) -> None:
        """Mooncake arrivals sit on 1,180 ticks about 3 s apart, sent as batches by default."""
        w = loaded[MOONCAKE]
        s = trace_stats(w)
        assert s.distinct_arrivals == 1_180
        assert (s.output.min, s.prompt.min) == (1, 891)
        ticks = np.unique(w.arrival_s)
        assert np.all((np.diff(ticks) >= 2.997 - 1e-9) & (np.diff(ticks) <= 3.003 + 1e-9))

    def test_mooncake_spread_ticks(self, loaded: dict[str, Workload]) -> None:
        """``spread_ticks`` spreads each tick's requests evenly inside the tick, keeping order and lengths."""
        batched = loaded[MOONCAKE]
        spread = load_trace(shared(MOONCAKE), spread_ticks=True)
        assert np.all(np.diff(spread.arrival_s) > 0)
        assert np.all(spread.arrival_s >= batched.arrival_s)
        assert np.all(spread.arrival_s - batched.arrival_s < 3.0)
        np.testing.assert_array_equal(spread.prompt_len, batched.prompt_len)
        first_tick = spread.arrival_s[batched.arrival_s == 0.0]
        np.testing.assert_allclose(first_tick, np.arange(first_tick.size) * 3.0 / first_tick.size)
        assert trace_stats(spread).interarrival_cv < 0.5

    def test_azure_conv_loads_column_by_column(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """The 19k-row Azure trace is parsed a column at a time, never row by row, in memory linear in its rows.

        The row-by-row pass only runs to name a bad row; how fast loading is depends on the
        machine, so ``benchmarks/speed_checks.py`` times it.
        """
        calls: list[str] = []

        def spy(parse: object, text: str) -> bool:
            calls.append(text)
            return True

        monkeypatch.setattr(_trace_parsers, "_parses", spy)
        tracemalloc.start()
        try:
            w = load_trace(shared(AZURE_CONV))
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert len(w) == 19_366
        assert calls == []
        assert peak < 1_500 * len(w)  # about 600 bytes a row: the text, its lines and the columns

    def test_loading_is_deterministic(self, loaded: dict[str, Workload]) -> None:
        """Loading a file twice gives identical arrays."""
        assert_same_rows(load_trace(shared(AZURE_CONV)), loaded[AZURE_CONV])

    @pytest.mark.parametrize("target", [1.0, 5.0, 20.0])
    def test_replay_at_a_target_rate(self, loaded: dict[str, Workload], target: float) -> None:
        """Rescaled, the conversation trace has the target mean rate and its own burstiness."""
        w = loaded[AZURE_CONV].scaled_to_rate(target)
        s = trace_stats(w)
        assert s.mean_rate == pytest.approx(target, rel=1e-12)
        assert s.interarrival_cv == pytest.approx(trace_stats(loaded[AZURE_CONV]).interarrival_cv, rel=1e-9)
        assert w.duration_s == pytest.approx((len(w) - 1) / target)

    def test_explicit_format(self) -> None:
        """Passing the format skips detection and gives the same result."""
        w = load_trace(shared(AZURE_CODE), format="azure")
        assert len(w) == 8_819
        with pytest.raises(TraceFormatError, match="header must name arrival_s"):
            load_trace(shared(AZURE_CODE), format=TraceFormat.CSV)


class TestGenericFormat:
    @pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
    @given(seed=st.integers(0, 2**32), n=st.integers(0, 60), priority=st.booleans())
    @settings(max_examples=15, deadline=None)
    def test_write_then_load_round_trips(self, suffix: str, seed: int, n: int, priority: bool) -> None:
        """``write_trace`` then ``load_trace`` gives bit-identical columns, priorities included."""
        w = synthetic(n, Gamma(7.0, 2.5), LogNormal(900, 1.2), Uniform(1, 2000), seed=seed)
        if priority:
            w = Workload(w.name, w.arrival_s, w.prompt_len, w.output_len, np.arange(n) % 3 - 1)
        with tempfile.TemporaryDirectory() as directory:
            path = Path(directory) / f"trace{suffix}"
            write_trace(w, path)
            assert_same_rows(load_trace(path), w)

    def test_round_trips_a_real_trace(self, loaded: dict[str, Workload], tmp_path: Path) -> None:
        """The Azure conversation trace survives the generic CSV and JSONL formats exactly."""
        for suffix in (".csv", ".jsonl"):
            path = tmp_path / f"conv{suffix}"
            write_trace(loaded[AZURE_CONV], path)
            assert_same_rows(load_trace(path), loaded[AZURE_CONV])

    def test_written_csv_looks_as_documented(self, tmp_path: Path) -> None:
        """The CSV has the documented header and one plain row per request."""
        path = tmp_path / "w.csv"
        write_trace(Workload("w", [0.0, 0.25], [512, 2048], [128, 16]), path)
        assert path.read_text() == "arrival_s,prompt_len,output_len\n0.0,512,128\n0.25,2048,16\n"

    def test_written_jsonl_is_json(self, tmp_path: Path) -> None:
        """Each JSONL line is an object with the documented keys."""
        path = tmp_path / "w.jsonl"
        write_trace(Workload("w", [1.5], [7], [3], priority=[2]), path)
        assert json.loads(path.read_text()) == {"arrival_s": 1.5, "prompt_len": 7, "output_len": 3, "priority": 2}

    def test_explicit_write_format(self, tmp_path: Path) -> None:
        """``format=`` overrides the suffix; the vendor formats are not written."""
        path = tmp_path / "w.txt"
        write_trace(Workload("w", [0.0], [1], [1]), path, format="jsonl")
        assert path.read_text().startswith("{")
        with pytest.raises(ValueError, match="generic"):
            write_trace(Workload("w", [0.0], [1], [1]), path, format="azure")

    def test_columns_in_any_order_and_extras_ignored(self, tmp_path: Path) -> None:
        """Generic CSV columns are found by name; unknown columns and JSON keys are ignored."""
        path = write(tmp_path, "t.csv", "output_len,note,arrival_s,prompt_len\n5,hi,0.5,40\n6,yo,1.5,41\n")
        w = load_trace(path)
        assert (w.arrival_s.tolist(), w.prompt_len.tolist(), w.output_len.tolist()) == ([0.5, 1.5], [40, 41], [5, 6])
        jsonl = write(tmp_path, "t.jsonl", '{"arrival_s": 2, "prompt_len": 9.0, "output_len": 1, "id": "x"}\n')
        assert load_trace(jsonl).prompt_len.tolist() == [9]

    def test_generic_times_are_kept(self, tmp_path: Path) -> None:
        """Generic times are already relative: they are not moved to start at 0."""
        w = load_trace(write(tmp_path, "t.csv", "arrival_s,prompt_len,output_len\n10.0,1,1\n12.0,1,1\n"))
        assert w.arrival_s.tolist() == [10.0, 12.0]

    def test_blank_lines_crlf_and_bom(self, tmp_path: Path) -> None:
        """Blank lines are skipped, Windows line ends and a byte-order mark are accepted."""
        text = "\ufeffarrival_s,prompt_len,output_len\r\n\r\n0,1,1\r\n1,2,2\r\n\r\n"
        path = tmp_path / "t.csv"
        path.write_bytes(text.encode("utf-8"))
        assert load_trace(path).prompt_len.tolist() == [1, 2]

    def test_header_only_is_an_empty_workload(self, tmp_path: Path) -> None:
        """A header with no rows is an empty workload (what write_trace writes for one)."""
        assert len(load_trace(write(tmp_path, "t.csv", "arrival_s,prompt_len,output_len\n"))) == 0

    def test_name_option(self, tmp_path: Path) -> None:
        """``name=`` overrides the file stem."""
        path = write(tmp_path, "t.csv", "arrival_s,prompt_len,output_len\n0,1,1\n")
        assert load_trace(path, name="mine").name == "mine"


AZURE_HEAD = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
GOOD_AZURE_ROW = "2023-11-16 18:17:03.9799600,10,5\n"
CSV_HEAD = "arrival_s,prompt_len,output_len\n"
MOONCAKE_ROW = '{"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [0]}\n'
JSONL_ROW = '{"arrival_s": 0.0, "prompt_len": 10, "output_len": 5}\n'

MALFORMED = [
    # (file name, contents, line of the first bad row, message fragment)
    ("a.csv", AZURE_HEAD + GOOD_AZURE_ROW + "2023-11-16 18:17:04.0000000,10\n", 3, "expected 3 comma-separated fields"),
    ("a.csv", AZURE_HEAD + GOOD_AZURE_ROW * 2 + "2023-11-16 18:17:04.0,ten,5\n", 4, "ContextTokens is not an integer"),
    ("a.csv", AZURE_HEAD + GOOD_AZURE_ROW + "2023-11-16 18:17:04.0,10,2.5\n", 3, "GeneratedTokens is not an integer"),
    ("a.csv", AZURE_HEAD + GOOD_AZURE_ROW + "2023-13-16 18:17:04.0,10,5\n", 3, "TIMESTAMP is not a naive date"),
    ("a.csv", AZURE_HEAD + GOOD_AZURE_ROW + "NaT,10,5\n", 3, "TIMESTAMP"),
    ("a.csv", AZURE_HEAD + GOOD_AZURE_ROW + "2023-11-16 18:17:04.0+01:00,10,5\n", 3, "TIMESTAMP"),
    ("a.csv", AZURE_HEAD + GOOD_AZURE_ROW + "2023-11-16 18:17:04.0,0,5\n", 3, "prompt length must be at least 1"),
    ("a.csv", AZURE_HEAD + GOOD_AZURE_ROW + "2023-11-16 18:17:04.0,10,0\n", 3, "output length is 0"),
    ("a.csv", AZURE_HEAD + GOOD_AZURE_ROW + "2023-11-16 18:17:02.0,10,5\n", 3, "earlier than the previous row"),
    ("g.csv", CSV_HEAD + "0,1,1\n\n\n1,x,1\n", 5, "prompt_len is not an integer: 'x'"),
    ("g.csv", CSV_HEAD + "0,1,1\nnan,1,1\n", 3, "arrival time must be a finite number >= 0"),
    ("g.csv", CSV_HEAD + "0,1,1\ninf,1,1\n", 3, "finite"),
    ("g.csv", CSV_HEAD + "0,1,1\n-1,1,1\n", 3, ">= 0"),
    ("g.csv", CSV_HEAD + "0,1,1\nsoon,1,1\n", 3, "arrival_s is not a number: 'soon'"),
    ("g.csv", CSV_HEAD + "0,1,1\n1,1,-3\n", 3, "output length must be at least 1"),
    ("g.csv", CSV_HEAD + "0,1,1\n2,1,1\n1,1,1\n", 4, "earlier than the previous row's 2 s"),
    ("g.csv", CSV_HEAD + "0,1,99999999999999999999\n", 2, "output_len is not an integer"),
    ("g.csv", "arrival_s,prompt_len,output_len,prompt_len\n0,1,1,1\n", 1, "once each"),
    ("m.jsonl", MOONCAKE_ROW + '{"timestamp": 3000, "input_length": 10}\n', 2, "missing key 'output_length'"),
    ("m.jsonl", MOONCAKE_ROW + '{"timestamp": 3000, "input_length": 1.5, "output_length": 1}\n', 2, "not an integer"),
    ("m.jsonl", MOONCAKE_ROW + '{"timestamp": 3000, "input_length": true, "output_length": 1}\n', 2, "not a number"),
    ("m.jsonl", MOONCAKE_ROW + '{"timestamp": "3000", "input_length": 1, "output_length": 1}\n', 2, "not a number"),
    ("m.jsonl", MOONCAKE_ROW + '{"timestamp": 3000, "input_length": 1, "output_length": 0}\n', 2, "output length is 0"),
    ("m.jsonl", MOONCAKE_ROW + '{"timestamp": 3000, "input_length": 10,\n', 2, "not valid JSON"),
    ("m.jsonl", MOONCAKE_ROW + "[1, 2, 3]\n", 2, "expected a JSON object, got list"),
    (
        "m.jsonl",
        MOONCAKE_ROW + '{"timestamp": 3000, "input_length": 1, "output_length": 1}\n' + MOONCAKE_ROW,
        3,
        "earlier than the previous row",
    ),
    ("g.jsonl", JSONL_ROW + '{"arrival_s": 1, "prompt_len": 0, "output_len": 1}\n', 2, "prompt length must be"),
    ("g.jsonl", JSONL_ROW + '{"arrival_s": NaN, "prompt_len": 1, "output_len": 1}\n', 2, "finite"),
    (
        "g.jsonl",
        JSONL_ROW + '{"arrival_s": 1, "prompt_len": 1, "output_len": 1, "priority": 2}\n',
        2,
        "'priority' must be given on every row or on none",
    ),
    ("x.csv", "time,input,output\n0,1,1\n", 1, "cannot tell the trace format"),
    ("x.jsonl", '\n\n{"ts": 0}\n', 3, "cannot tell the trace format"),
    ("x.jsonl", '{"ts": \n', 1, "not valid JSON"),
]


class TestMalformedRows:
    @pytest.mark.parametrize(("name", "text", "line", "message"), MALFORMED)
    def test_names_the_file_and_line(self, tmp_path: Path, name: str, text: str, line: int, message: str) -> None:
        """The first bad row raises TraceFormatError naming the file and its 1-based line."""
        path = write(tmp_path, name, text)
        with pytest.raises(TraceFormatError, match=message) as caught:
            load_trace(path)
        assert caught.value.line == line
        assert str(caught.value).startswith(f"{path}:{line}: ")
        assert caught.value.path == path

    def test_error_is_a_phasesched_value_error(self) -> None:
        """TraceFormatError belongs to both PhaseschedError and ValueError."""
        assert issubclass(TraceFormatError, PhaseschedError)
        assert issubclass(TraceFormatError, ValueError)

    def test_empty_file(self, tmp_path: Path) -> None:
        """An empty CSV (no header) is an error about the whole file; an empty .jsonl has no requests."""
        for name in ("e.csv", "e.txt"):
            with pytest.raises(TraceFormatError, match="empty") as caught:
                load_trace(write(tmp_path, name, "\n\n"))
            assert caught.value.line is None
        with pytest.raises(TraceFormatError, match="needs at least its header"):
            load_trace(write(tmp_path, "e.jsonl", ""), format="csv")
        assert len(load_trace(write(tmp_path, "e.jsonl", ""))) == 0
        assert len(load_trace(write(tmp_path, "e.log", "\n"), format="mooncake")) == 0

    def test_missing_file(self, tmp_path: Path) -> None:
        """A missing file is an OSError, not a format error."""
        with pytest.raises(FileNotFoundError):
            load_trace(tmp_path / "absent.csv")

    def test_sort_option_sorts_stably(self, tmp_path: Path) -> None:
        """With ``sort=True`` an out-of-order file is sorted by time, ties kept in file order."""
        path = write(tmp_path, "g.csv", CSV_HEAD + "2,1,1\n0,2,1\n2,3,1\n1,4,1\n")
        w = load_trace(path, sort=True)
        assert (w.arrival_s.tolist(), w.prompt_len.tolist()) == ([0.0, 1.0, 2.0, 2.0], [2, 4, 1, 3])

    def test_azure_times_are_relative_to_the_earliest_row(self, tmp_path: Path) -> None:
        """A sorted Azure file starts at 0 even when its first row was not the earliest."""
        text = AZURE_HEAD + "2023-11-16 18:17:05.0,1,1\n2023-11-16 18:17:04.5,2,1\n"
        w = load_trace(write(tmp_path, "a.csv", text), sort=True)
        assert w.arrival_s.tolist() == [0.0, 0.5]

    def test_jitter_within_tolerance_is_held(self, tmp_path: Path) -> None:
        """A sub-microsecond step back is clock jitter: the time is held at the previous row's."""
        w = load_trace(write(tmp_path, "g.csv", CSV_HEAD + "1.0,1,1\n0.9999999999,1,1\n2,1,1\n"))
        assert w.arrival_s.tolist() == [1.0, 1.0, 2.0]

    def test_zero_output_rules(self, tmp_path: Path) -> None:
        """Zero-length outputs can be clamped to 1 or dropped instead of rejected."""
        path = write(tmp_path, "g.csv", CSV_HEAD + "0,5,3\n1,6,0\n2,7,2\n")
        clamped = load_trace(path, zero_output="clamp")
        assert clamped.output_len.tolist() == [3, 1, 2]
        dropped = load_trace(path, zero_output="drop")
        assert (dropped.prompt_len.tolist(), dropped.arrival_s.tolist()) == ([5, 7], [0.0, 2.0])
        with pytest.raises(ValueError, match="zero_output"):
            load_trace(path, zero_output="ignore")  # type: ignore[arg-type]

    def test_unknown_format_name(self, tmp_path: Path) -> None:
        """An unknown format name is a ValueError."""
        with pytest.raises(ValueError, match="parquet"):
            load_trace(write(tmp_path, "g.csv", CSV_HEAD), format="parquet")


class TestTraceStats:
    def test_small_example(self) -> None:
        """Statistics of a hand-checked workload."""
        w = Workload("w", [0.0, 0.5, 1.0, 4.0], [10, 20, 30, 40], [1, 1, 2, 8])
        s = trace_stats(w)
        assert (s.rows, s.span_s, s.mean_rate, s.distinct_arrivals) == (4, 4.0, 0.75, 4)
        gaps = np.array([0.5, 0.5, 3.0])
        assert s.interarrival_cv == pytest.approx(gaps.std() / gaps.mean())
        assert (s.median_gap_s, s.max_gap_s) == (0.5, 3.0)
        counts = np.array([2, 1, 0, 0])  # full 1 s buckets; the one holding t = 4.0 is partial
        assert s.per_second_cv == pytest.approx(counts.std() / counts.mean())
        assert s.max_per_second == 2
        assert math.isnan(s.per_minute_cv)
        assert (s.prompt.min, s.prompt.mean, s.prompt.p50, s.prompt.max) == (10, 25.0, 25.0, 40)
        assert s.output.p90 == pytest.approx(np.percentile([1, 1, 2, 8], 90))

    def test_single_request(self) -> None:
        """One request has no gaps: the rate and CVs are nan, not errors."""
        s = trace_stats(Workload("one", [0.0], [5], [5]))
        assert s.rows == 1
        assert math.isnan(s.mean_rate)
        assert math.isnan(s.interarrival_cv)

    def test_empty_workload_is_refused(self) -> None:
        """There is nothing to describe in an empty workload."""
        with pytest.raises(ValueError, match="empty"):
            trace_stats(Workload("none", [], [], []))

    def test_to_dict_is_json_ready(self, loaded: dict[str, Workload]) -> None:
        """``to_dict`` nests the length summaries and serialises to JSON."""
        d = trace_stats(loaded[AZURE_CODE]).to_dict()
        assert d["rows"] == 8_819
        assert d["prompt"]["p50"] == 1_469
        assert json.loads(json.dumps(d))["output"]["max"] == 1_899

    def test_format_table(self, loaded: dict[str, Workload]) -> None:
        """The plain-text table shows the README's numbers."""
        table = trace_stats(loaded[AZURE_CODE]).format_table()
        assert table.startswith("AzureLLMInferenceTrace_code: 8,819 requests over 3,435.9 s")
        for fragment in ("2.566 req/s", "CV 13.15", "CV 2.27", "(at most 67)", "5,187.6", "251.5", "1,899"):
            assert fragment in table
        assert "\t" not in table


class TestTraceStatsMemory:
    """Statistics take memory in proportion to the rows, not to the span of time they cover."""

    THREE_YEARS_S = 3 * 365 * 86_400.0

    def peak_bytes(self, workload: Workload) -> int:
        """The most memory ``trace_stats(workload)`` held at once."""
        tracemalloc.start()
        try:
            trace_stats(workload)
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    def test_two_rows_three_years_apart(self) -> None:
        """Two requests three years apart: a few kilobytes, where one counter per second took 1.6 GB."""
        w = Workload("far", [0.0, self.THREE_YEARS_S], [10, 20], [1, 2])
        s = trace_stats(w)
        assert (s.rows, s.span_s, s.max_per_second) == (2, self.THREE_YEARS_S, 1)
        assert s.per_second_cv == pytest.approx(math.sqrt(self.THREE_YEARS_S - 1))  # one 1 among ~9.5e7 zeros
        assert self.peak_bytes(w) < 1_000_000

    @pytest.mark.parametrize("span_s", [1e3, 1e6, 1e9, 1e12])
    def test_peak_memory_does_not_grow_with_the_span(self, span_s: float) -> None:
        """A thousand rows over a span from 17 minutes to 31,000 years peak at the same few hundred kilobytes."""
        w = Workload("w", np.linspace(0.0, span_s, 1000), np.full(1000, 5), np.full(1000, 5))
        assert self.peak_bytes(w) < 1_000_000

    @given(
        gaps=st.lists(st.floats(0.0, 200.0), min_size=1, max_size=60),
        width=st.sampled_from([1.0, 60.0]),
    )
    @settings(max_examples=200)
    def test_bucket_cv_equals_the_dense_count(self, gaps: list[float], width: float) -> None:
        """The CV from occupied buckets only equals numpy's over every full bucket, zeros included."""
        offsets = np.concatenate(([0.0], np.cumsum(gaps)))
        counts = np.bincount((offsets // width).astype(np.int64))
        full = counts[: int(offsets[-1] // width)].astype(np.float64)
        w = Workload("w", offsets, np.ones(offsets.size, dtype=np.int64), np.ones(offsets.size, dtype=np.int64))
        s = trace_stats(w)
        cv = s.per_second_cv if width == 1.0 else s.per_minute_cv
        if full.size < 2 or full.mean() == 0:
            assert math.isnan(cv)
        else:
            assert cv == pytest.approx(full.std() / full.mean(), rel=1e-9, abs=1e-12)
        if width == 1.0:
            assert s.max_per_second == counts.max()
