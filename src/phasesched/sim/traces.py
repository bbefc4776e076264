"""Request traces: load real arrival/length traces as :class:`~phasesched.sim.Workload` values, and describe them.

Four formats are read, each detected from the file's first line (the extension is not trusted):

``azure``
    The Azure LLM inference trace 2023 (Splitwise, ISCA 2024): CSV with the header
    ``TIMESTAMP,ContextTokens,GeneratedTokens``. Timestamps are naive wall-clock times with
    seven fractional digits (``2023-11-16 18:17:03.9799600``); they are parsed exactly, to the
    nanosecond, and made relative to the earliest row.
``mooncake``
    The Mooncake / Kimi FAST'25 traces: JSON Lines with ``timestamp`` (milliseconds from the
    start of the trace), ``input_length`` and ``output_length``; other keys (``hash_ids``) are
    ignored. Times are kept as given (already relative). **Mooncake timestamps fall on a ~3 s
    grid** (about ten requests share each tick), so by default each tick's requests are sent as
    one batch, as recorded; ``spread_ticks=True`` spreads them evenly within their tick instead.
``csv``
    phasesched's generic format, written by :func:`write_trace`: a header naming the columns
    ``arrival_s`` (seconds, ``>= 0``), ``prompt_len``, ``output_len`` and optionally
    ``priority`` (in any order; other columns are ignored), then one row per request::

        arrival_s,prompt_len,output_len
        0.0,512,128
        0.25,2048,16
``jsonl``
    The same, as JSON Lines: ``{"arrival_s": 0.0, "prompt_len": 512, "output_len": 128}``;
    ``priority`` must be on every row or on none; other keys are ignored.

Every row is checked, and the first bad one raises :class:`TraceFormatError` naming the file and
its 1-based line number (the header is line 1): a missing field, a length that is not an integer
or is below 1, a time that is not a finite number ``>= 0``, or a time earlier than the row before.

Decisions, so replay results can be reproduced and compared:

* **Order.** Rows must already be in arrival order (all staged traces are). Times that step
  back by at most 1 µs (clock jitter) are raised to the previous row's time; a larger step back
  is rejected, since it more likely means concatenated or corrupted files than a shuffle. Pass
  ``sort=True`` to sort such a file (stably) instead.
* **Zero-length outputs.** A request that generates nothing cannot be a
  :class:`~phasesched.Request` (``max_new_tokens >= 1``). None of the staged traces has one
  (their smallest outputs are 6, 7 and 1 tokens), so by default such a row is rejected like any
  other bad length. ``zero_output="clamp"`` replays it as a 1-token output (the prefill samples
  that token anyway, so it costs the same prefill), ``"drop"`` skips it.
* **Blank lines** are skipped; a final newline is optional. A file with no rows is an empty
  workload (a ``.jsonl`` file may be completely empty; a CSV file needs its header).
"""

from __future__ import annotations

import enum
import json
import math
import os
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

import attrs
import numpy as np
from numpy.typing import NDArray

from phasesched.errors import PhaseschedError
from phasesched.sim.workload import Workload

__all__ = [
    "LengthStats",
    "TraceFormat",
    "TraceFormatError",
    "TraceStats",
    "load_trace",
    "trace_stats",
    "write_trace",
]

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]
ZeroOutput = Literal["reject", "clamp", "drop"]

AZURE_HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
# Times may step back this much (seconds) before a row counts as out of order: logging jitter.
BACKSTEP_TOLERANCE_S = 1e-6
_CHUNK = 4096
_ZERO_OUTPUT_RULES = frozenset({"reject", "clamp", "drop"})
_JSONL_SUFFIXES = frozenset({".jsonl", ".ndjson"})
_T = TypeVar("_T")


class TraceFormatError(PhaseschedError, ValueError):
    """A trace file that cannot be read as requests; the message is ``"FILE:LINE: reason"``.

    Attributes:
        path: The file.
        line: 1-based line number of the offending row (the header is line 1), or ``None`` when
            the problem is the file as a whole.
        reason: What is wrong with it.

    >>> str(TraceFormatError("t.csv", 3, "prompt_len is not an integer: 'x'"))
    "t.csv:3: prompt_len is not an integer: 'x'"

    """

    def __init__(self, path: str | os.PathLike[str], line: int | None, reason: str) -> None:
        where = f"{path}:{line}" if line is not None else f"{path}"
        super().__init__(f"{where}: {reason}")
        self.path = Path(path)
        self.line = line
        self.reason = reason


class TraceFormat(enum.Enum):
    """The trace file formats :func:`load_trace` reads (see the module docstring)."""

    AZURE = "azure"
    MOONCAKE = "mooncake"
    CSV = "csv"
    JSONL = "jsonl"


@attrs.frozen(eq=False)
class _Rows:
    """Parsed columns before the checks every format shares; ``lines`` are 1-based line numbers."""

    arrival_s: FloatArray
    prompt_len: IntArray
    output_len: IntArray
    priority: IntArray | None
    lines: IntArray


@attrs.frozen
class _JsonKeys:
    """Where a JSON Lines format keeps each field, and what divides its time into seconds."""

    time: str
    time_divisor: float
    prompt: str
    output: str
    priority: str | None


_MOONCAKE_KEYS = _JsonKeys("timestamp", 1000.0, "input_length", "output_length", None)
_GENERIC_KEYS = _JsonKeys("arrival_s", 1.0, "prompt_len", "output_len", "priority")
_GENERIC_COLUMNS = ("arrival_s", "prompt_len", "output_len")


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def load_trace(  # noqa: PLR0913 -- the file plus one keyword per documented replay decision
    path: str | os.PathLike[str],
    *,
    format: TraceFormat | str | None = None,  # noqa: A002 -- the natural name; mirrors the CLI's --format
    spread_ticks: bool = False,
    zero_output: ZeroOutput = "reject",
    sort: bool = False,
    name: str | None = None,
) -> Workload:
    """Read a request trace as a workload (see the module docstring for the formats and rules).

    Args:
        path: The trace file (UTF-8).
        format: One of :class:`TraceFormat` (or its value); by default detected from the first line.
        spread_ticks: Spread requests that share an arrival time evenly over the gap to the next
            distinct time (capped at the median such gap, which the last tick also uses). Meant
            for Mooncake's 3 s grid: a tick of ``k`` requests at ``t`` becomes
            ``t, t + 3/k, t + 6/k, ...`` seconds. Default ``False``: they arrive together, as
            recorded.
        zero_output: What to do with a row whose output length is 0: ``"reject"`` (default),
            ``"clamp"`` it to 1, or ``"drop"`` it.
        sort: Sort rows that are out of order instead of rejecting the file.
        name: The workload's name; the file's stem by default.

    Returns:
        The workload, one row per request, in arrival order.

    Raises:
        TraceFormatError: if the format cannot be detected or a row is malformed.
        OSError: if the file cannot be read.

    """
    if zero_output not in _ZERO_OUTPUT_RULES:
        msg = f"zero_output must be 'reject', 'clamp' or 'drop', got {zero_output!r}"
        raise ValueError(msg)
    path = Path(path)
    text = path.read_text(encoding="utf-8-sig")
    lines = text.replace("\r\n", "\n").split("\n")
    first = next((i for i, line in enumerate(lines) if line.strip()), None)
    fmt = _detect(lines, first, path) if format is None else TraceFormat(format)
    if first is None and fmt in {TraceFormat.AZURE, TraceFormat.CSV}:
        raise TraceFormatError(path, None, "the file is empty; a CSV trace needs at least its header")
    if fmt is TraceFormat.AZURE:
        rows = _parse_azure(lines, first or 0, path)
    elif fmt is TraceFormat.CSV:
        rows = _parse_generic_csv(lines, first or 0, path)
    else:
        rows = _parse_jsonl(lines, path, _MOONCAKE_KEYS if fmt is TraceFormat.MOONCAKE else _GENERIC_KEYS)
    rows = _checked(rows, path, zero_output=zero_output, sort=sort)
    arrival_s = _spread_ties(rows.arrival_s) if spread_ticks else rows.arrival_s
    return Workload(name or path.stem, arrival_s, rows.prompt_len, rows.output_len, rows.priority)


def _detect(lines: Sequence[str], first: int | None, path: Path) -> TraceFormat:
    """The format whose header (CSV) or keys (JSON Lines) the first non-blank line shows.

    A file with no such line is empty JSON Lines (no requests) if its name ends in ``.jsonl`` or
    ``.ndjson``, and an error otherwise: a CSV trace always has its header.
    """
    if first is None:
        if path.suffix.lower() in _JSONL_SUFFIXES:
            return TraceFormat.JSONL
        raise TraceFormatError(path, None, "the file is empty")
    text, lineno = lines[first].strip(), first + 1
    if text.startswith("{"):
        try:
            record = json.loads(text)
        except json.JSONDecodeError as error:
            raise TraceFormatError(path, lineno, f"not valid JSON ({error.msg})") from None
        if isinstance(record, dict) and {"timestamp", "input_length"} <= record.keys():
            return TraceFormat.MOONCAKE
        if isinstance(record, dict) and "arrival_s" in record:
            return TraceFormat.JSONL
    else:
        header = tuple(column.strip() for column in text.split(","))
        if header == AZURE_HEADER:
            return TraceFormat.AZURE
        if set(_GENERIC_COLUMNS) <= set(header):
            return TraceFormat.CSV
    reason = (
        f"cannot tell the trace format from {text[:80]!r}; expected an Azure or generic CSV header "
        "or a Mooncake or generic JSON object (or pass format=)"
    )
    raise TraceFormatError(path, lineno, reason)


def _split_csv(lines: Sequence[str], header: int, path: Path) -> tuple[list[str], list[list[str]], list[int]]:
    """The header's column names, then each non-blank row's fields and 1-based line number."""
    names = [column.strip() for column in lines[header].split(",")]
    rows: list[list[str]] = []
    numbers: list[int] = []
    for lineno, line in enumerate(lines[header + 1 :], header + 2):
        if not line.strip():
            continue
        fields = line.split(",")
        if len(fields) != len(names):
            raise TraceFormatError(path, lineno, f"expected {len(names)} comma-separated fields, got {len(fields)}")
        rows.append(fields)
        numbers.append(lineno)
    return names, rows, numbers


def _parse_azure(lines: Sequence[str], header: int, path: Path) -> _Rows:
    names, rows, numbers = _split_csv(lines, header, path)
    if tuple(names) != AZURE_HEADER:
        raise TraceFormatError(path, header + 1, f"expected the header {','.join(AZURE_HEADER)}, got {names}")
    stamps, prompts, outputs = zip(*rows, strict=True) if rows else ((), (), ())
    nanos = _timestamps_ns(stamps, numbers, path)
    relative = nanos - nanos.min() if nanos.size else nanos
    return _Rows(
        arrival_s=relative / 1e9,  # exact int64 nanoseconds, one correctly rounded division
        prompt_len=_int_strings(prompts, numbers, "ContextTokens", path),
        output_len=_int_strings(outputs, numbers, "GeneratedTokens", path),
        priority=None,
        lines=np.asarray(numbers, dtype=np.int64),
    )


def _parse_generic_csv(lines: Sequence[str], header: int, path: Path) -> _Rows:
    names, rows, numbers = _split_csv(lines, header, path)
    missing = [column for column in _GENERIC_COLUMNS if column not in names]
    if missing or len(set(names)) != len(names):
        reason = f"the header must name arrival_s, prompt_len and output_len once each, got {names}"
        raise TraceFormatError(path, header + 1, reason)
    transposed = list(zip(*rows, strict=True)) if rows else [()] * len(names)
    columns = dict(zip(names, transposed, strict=True))
    times = _parsed(columns["arrival_s"], numbers, float, "arrival_s is not a number", path)
    return _Rows(
        arrival_s=np.asarray(times, dtype=np.float64),
        prompt_len=_int_strings(columns["prompt_len"], numbers, "prompt_len", path),
        output_len=_int_strings(columns["output_len"], numbers, "output_len", path),
        priority=_int_strings(columns["priority"], numbers, "priority", path) if "priority" in columns else None,
        lines=np.asarray(numbers, dtype=np.int64),
    )


def _int64(text: str) -> int:
    value = int(text)
    if not -(2**63) <= value < 2**63:
        msg = "out of the int64 range"
        raise ValueError(msg)
    return value


def _int_strings(texts: Sequence[str], numbers: Sequence[int], what: str, path: Path) -> IntArray:
    """int64 ``[len(texts)]`` from decimal strings; a bad one is reported with its line."""
    return np.asarray(_parsed(texts, numbers, _int64, f"{what} is not an integer", path), dtype=np.int64)


def _parsed(
    texts: Sequence[str],
    numbers: Sequence[int],
    parse: Callable[[str], _T],
    problem: str,
    path: Path,
) -> list[_T]:
    """``parse`` applied to every text; the first that raises ``ValueError`` is reported with its line."""
    try:
        return [parse(text) for text in texts]
    except ValueError:
        pass  # convert again, one by one, to name the first offending row
    for text, lineno in zip(texts, numbers, strict=True):
        if not _parses(parse, text):
            raise TraceFormatError(path, lineno, f"{problem}: {text.strip()!r}")
    raise AssertionError("a column failed to parse as a whole but parsed row by row")  # pragma: no cover


def _parses(parse: Callable[[str], object], text: str) -> bool:
    try:
        parse(text)
    except ValueError:
        return False
    return True


def _timestamps_ns(texts: Sequence[str], numbers: Sequence[int], path: Path) -> IntArray:
    """Naive ISO timestamps as int64 ``[N]`` nanoseconds since the epoch, exactly."""
    stamps = [text.strip() for text in texts]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy warns, then converts, on a time-zone suffix
        try:
            parsed = np.asarray(stamps, dtype="datetime64[ns]")
        except (ValueError, Warning):
            parsed = None
    if parsed is None or np.isnat(parsed).any():
        _report_bad_timestamp(stamps, numbers, path)
    assert parsed is not None
    return parsed.astype(np.int64)


def _report_bad_timestamp(stamps: Sequence[str], numbers: Sequence[int], path: Path) -> None:
    for stamp, lineno in zip(stamps, numbers, strict=True):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            try:
                bad = bool(np.isnat(np.datetime64(stamp, "ns")))
            except (ValueError, Warning):
                bad = True
        if bad:
            reason = f"TIMESTAMP is not a naive date and time like 2023-11-16 18:17:03.9799600: {stamp!r}"
            raise TraceFormatError(path, lineno, reason)


def _parse_jsonl(lines: Sequence[str], path: Path, keys: _JsonKeys) -> _Rows:
    times: list[float] = []
    prompts: list[int] = []
    outputs: list[int] = []
    priorities: list[int | None] = []
    numbers: list[int] = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        record = _json_record(line, path, lineno)
        times.append(_json_number(record, keys.time, path, lineno) / keys.time_divisor)
        prompts.append(_json_int(record, keys.prompt, path, lineno))
        outputs.append(_json_int(record, keys.output, path, lineno))
        priority = keys.priority
        priorities.append(_json_int(record, priority, path, lineno) if priority and priority in record else None)
        numbers.append(lineno)
    return _Rows(
        arrival_s=np.asarray(times, dtype=np.float64),
        prompt_len=np.asarray(prompts, dtype=np.int64),
        output_len=np.asarray(outputs, dtype=np.int64),
        priority=_all_or_none(priorities, numbers, path),
        lines=np.asarray(numbers, dtype=np.int64),
    )


def _json_record(line: str, path: Path, lineno: int) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise TraceFormatError(path, lineno, f"not valid JSON ({error.msg})") from None
    if not isinstance(record, dict):
        raise TraceFormatError(path, lineno, f"expected a JSON object, got {type(record).__name__}")
    return record


def _json_number(record: dict[str, Any], key: str, path: Path, lineno: int) -> int | float:
    if key not in record:
        raise TraceFormatError(path, lineno, f"missing key {key!r}")
    value = record[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TraceFormatError(path, lineno, f"{key} is not a number: {value!r}")
    return value


def _json_int(record: dict[str, Any], key: str, path: Path, lineno: int) -> int:
    """An integer field; a float with no fraction (``512.0``) is accepted, as pandas writes them."""
    value = _json_number(record, key, path, lineno)
    if isinstance(value, float):
        if not value.is_integer():
            raise TraceFormatError(path, lineno, f"{key} is not an integer: {value!r}")
        value = int(value)
    if not -(2**63) <= value < 2**63:
        raise TraceFormatError(path, lineno, f"{key} is out of range: {value}")
    return value


def _all_or_none(priorities: Sequence[int | None], numbers: Sequence[int], path: Path) -> IntArray | None:
    """The priority column if every row has one, ``None`` if none has; a mix is an error."""
    present = [p is not None for p in priorities]
    if not any(present):
        return None
    if not all(present):
        i = present.index(not present[0])
        raise TraceFormatError(path, numbers[i], "'priority' must be given on every row or on none")
    return np.asarray(priorities, dtype=np.int64)


# --------------------------------------------------------------------------------------------
# Checks shared by every format
# --------------------------------------------------------------------------------------------


def _first_bad(rows: _Rows, bad: NDArray[np.bool_], path: Path, reason: str) -> None:
    """Raise ``reason`` for the first row where ``bad`` (bool ``[N]``) holds."""
    if bad.any():
        raise TraceFormatError(path, int(rows.lines[int(np.argmax(bad))]), reason)


def _checked(rows: _Rows, path: Path, *, zero_output: ZeroOutput, sort: bool) -> _Rows:
    """Rows after the value, zero-output and order rules of the module docstring."""
    t, prompt, output = rows.arrival_s, rows.prompt_len, rows.output_len
    _first_bad(rows, ~np.isfinite(t) | (t < 0), path, "arrival time must be a finite number >= 0")
    _first_bad(rows, prompt < 1, path, "prompt length must be at least 1")
    _first_bad(rows, output < 0, path, "output length must be at least 1")
    if zero_output == "reject":
        reason = "output length is 0 (load with zero_output='clamp' or 'drop' to keep or skip such rows)"
        _first_bad(rows, output == 0, path, reason)
    elif zero_output == "clamp":
        rows = attrs.evolve(rows, output_len=np.maximum(output, 1))
    else:  # "drop"
        rows = _take(rows, np.flatnonzero(output > 0))
    return _ordered(rows, path, sort=sort)


def _ordered(rows: _Rows, path: Path, *, sort: bool) -> _Rows:
    steps = np.diff(rows.arrival_s)
    backwards = steps < -BACKSTEP_TOLERANCE_S
    if backwards.any() and sort:
        return _take(rows, np.argsort(rows.arrival_s, kind="stable"))
    if backwards.any():
        i = int(np.argmax(backwards)) + 1
        t = rows.arrival_s
        reason = (
            f"arrival time {t[i]:.9g} s is earlier than the previous row's {t[i - 1]:.9g} s "
            "(rows must be in arrival order; load with sort=True to sort them)"
        )
        raise TraceFormatError(path, int(rows.lines[i]), reason)
    if (steps < 0).any():  # jitter within tolerance: hold each time at the running maximum
        rows = attrs.evolve(rows, arrival_s=np.maximum.accumulate(rows.arrival_s))
    return rows


def _take(rows: _Rows, index: IntArray) -> _Rows:
    priority = None if rows.priority is None else rows.priority[index]
    return _Rows(rows.arrival_s[index], rows.prompt_len[index], rows.output_len[index], priority, rows.lines[index])


def _spread_ties(t: FloatArray) -> FloatArray:
    """Requests sharing a time spread evenly over the gap to the next time (at most the median gap).

    Args:
        t: float64 ``[N]``, sorted.

    Returns:
        float64 ``[N]``: the ``j``-th of ``k`` requests at tick ``t`` moves to ``t + j * w / k``,
        where ``w`` is the tick's width; so each request stays inside its own tick.

    """
    ticks, first, counts = np.unique(t, return_index=True, return_counts=True)
    if ticks.size < 2:
        return t
    gaps = np.diff(ticks)
    typical = float(np.median(gaps))
    width = np.minimum(np.append(gaps, typical), typical)
    rank = np.arange(t.size) - np.repeat(first, counts)
    spread: FloatArray = t + rank * np.repeat(width / counts, counts)
    return spread


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


def write_trace(
    workload: Workload,
    path: str | os.PathLike[str],
    *,
    format: TraceFormat | str | None = None,  # noqa: A002 -- the same keyword as load_trace
) -> None:
    """Write a workload in the generic format, which :func:`load_trace` reads back exactly.

    Times are written as the shortest decimal that round-trips (Python's ``repr``), so a
    written-then-loaded workload has bit-identical arrays. The name is not stored (a loaded
    trace is named after its file).

    Args:
        workload: What to write.
        path: Destination; overwritten.
        format: ``"csv"`` or ``"jsonl"``; by default JSON Lines for a ``.jsonl`` or ``.ndjson``
            path and CSV otherwise.

    """
    path = Path(path)
    if format is None:
        fmt = TraceFormat.JSONL if path.suffix.lower() in _JSONL_SUFFIXES else TraceFormat.CSV
    else:
        fmt = TraceFormat(format)
    if fmt not in {TraceFormat.CSV, TraceFormat.JSONL}:
        msg = f"write_trace writes the generic csv or jsonl formats, not {fmt.value}"
        raise ValueError(msg)
    has_priority = workload.priority is not None
    with path.open("w", encoding="utf-8", newline="\n") as out:
        if fmt is TraceFormat.CSV:
            out.write(",".join([*_GENERIC_COLUMNS, "priority"] if has_priority else _GENERIC_COLUMNS) + "\n")
        for start in range(0, len(workload), _CHUNK):
            out.writelines(_formatted_rows(workload, slice(start, start + _CHUNK), fmt))


def _formatted_rows(workload: Workload, rows: slice, fmt: TraceFormat) -> list[str]:
    columns = [workload.arrival_s[rows].tolist(), workload.prompt_len[rows].tolist()]
    columns.append(workload.output_len[rows].tolist())
    if workload.priority is not None:
        columns.append(workload.priority[rows].tolist())
    if fmt is TraceFormat.CSV:
        return [",".join(map(repr, row)) + "\n" for row in zip(*columns, strict=True)]
    keys = [*_GENERIC_COLUMNS, "priority"]
    return [
        "{" + ", ".join(f'"{k}": {v!r}' for k, v in zip(keys, row, strict=False)) + "}\n"
        for row in zip(*columns, strict=True)
    ]


# --------------------------------------------------------------------------------------------
# Statistics
# --------------------------------------------------------------------------------------------


@attrs.frozen
class LengthStats:
    """Summary of one token-length column; percentiles interpolate linearly (numpy's default)."""

    min: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: int

    @classmethod
    def of(cls, lengths: IntArray) -> LengthStats:
        """The summary of int64 ``[N]`` lengths, ``N >= 1``."""
        p50, p90, p99 = np.percentile(lengths, [50, 90, 99]).tolist()
        return cls(int(lengths.min()), float(lengths.mean()), p50, p90, p99, int(lengths.max()))


@attrs.frozen
class TraceStats:
    """A trace's size, rate, burstiness and length distributions, computed as the staged traces' README does.

    Burstiness is a coefficient of variation (population standard deviation over mean): of the
    gaps between consecutive arrivals (Poisson gives about 1), and of the request counts in
    consecutive 1 s and 60 s buckets from the first arrival, the last partial bucket dropped
    (one long gap can dominate the inter-arrival CV; the bucket CVs show sustained bursts).
    A value that needs more rows (or more full buckets) than the trace has is ``nan``.

    Attributes:
        name: The workload's name.
        rows: Requests.
        span_s: Seconds from the first arrival to the last.
        distinct_arrivals: Distinct arrival times (far below ``rows`` on a tick grid, like Mooncake's).
        mean_rate: ``(rows - 1) / span_s``, requests/s.
        median_gap_s: Median inter-arrival gap.
        max_gap_s: Longest inter-arrival gap.
        interarrival_cv: CV of the inter-arrival gaps.
        per_second_cv: CV of per-second request counts.
        max_per_second: Most requests in one second (any bucket, the partial one included).
        per_minute_cv: CV of per-minute request counts.
        prompt: Prompt-length summary.
        output: Output-length summary.

    """

    name: str
    rows: int
    span_s: float
    distinct_arrivals: int
    mean_rate: float
    median_gap_s: float
    max_gap_s: float
    interarrival_cv: float
    per_second_cv: float
    max_per_second: int
    per_minute_cv: float
    prompt: LengthStats
    output: LengthStats

    def to_dict(self) -> dict[str, Any]:
        """The statistics as plain (JSON-serialisable) values; ``prompt`` and ``output`` nest."""
        return attrs.asdict(self)

    def format_table(self) -> str:
        """A plain-text report for a terminal (``phasesched trace stats FILE``)."""
        lines = [
            f"{self.name}: {self.rows:,} requests over {_num(self.span_s)} s ({self.span_s / 60:,.1f} min)",
            f"  mean rate          {self.mean_rate:,.3f} req/s ({self.distinct_arrivals:,} distinct arrival times)",
            (
                f"  inter-arrival gap  CV {self.interarrival_cv:.2f}"
                f" (median {self.median_gap_s:.3f} s, max {_num(self.max_gap_s)} s)"
            ),
            f"  per-second count   CV {self.per_second_cv:.2f} (at most {self.max_per_second:,})",
            f"  per-minute count   CV {self.per_minute_cv:.2f}",
            "",
        ]
        table = [
            ["tokens", "min", "mean", "p50", "p90", "p99", "max"],
            ["input", *(_num(value) for value in attrs.astuple(self.prompt))],
            ["output", *(_num(value) for value in attrs.astuple(self.output))],
        ]
        return "\n".join(lines + _aligned(table))


def _aligned(table: list[list[str]]) -> list[str]:
    """Rows with the first column left-aligned and the others right-aligned."""
    widths = [max(len(cell) for cell in column) for column in zip(*table, strict=True)]
    lines = []
    for first, *rest in table:
        cells = [cell.rjust(width) for cell, width in zip(rest, widths[1:], strict=True)]
        lines.append("  ".join(["", first.ljust(widths[0]), *cells]))
    return lines


def _num(value: float) -> str:
    """``1,469`` for a whole number, ``5,187.6`` otherwise (the README's style)."""
    if not math.isfinite(value):
        return str(value)
    return f"{int(value):,}" if float(value).is_integer() else f"{value:,.1f}"


def _cv(values: FloatArray) -> float:
    mean = float(values.mean()) if values.size else 0.0
    return float(values.std()) / mean if mean > 0 else math.nan


def _bucket_counts(offsets: FloatArray, width: float) -> tuple[float, int]:
    """CV over the full ``width``-second buckets, and the largest count over all of them."""
    counts = np.bincount((offsets // width).astype(np.int64))
    full = counts[: int(offsets[-1] // width)]
    return (_cv(full.astype(np.float64)) if full.size >= 2 else math.nan), int(counts.max())


def trace_stats(workload: Workload) -> TraceStats:
    """Describe a workload's arrivals and lengths (see :class:`TraceStats` for the method).

    Raises:
        ValueError: if the workload is empty.

    >>> from phasesched.sim import Workload
    >>> s = trace_stats(Workload("w", [0.0, 1.0, 3.0], [10, 20, 30], [1, 2, 3]))
    >>> s.mean_rate, s.prompt.p50, s.output.max
    (0.6666666666666666, 20.0, 3)

    """
    if len(workload) == 0:
        msg = f"workload {workload.name!r} is empty"
        raise ValueError(msg)
    t = workload.arrival_s
    gaps = np.diff(t)
    offsets = t - t[0]
    per_second_cv, max_per_second = _bucket_counts(offsets, 1.0)
    per_minute_cv, _ = _bucket_counts(offsets, 60.0)
    return TraceStats(
        name=workload.name,
        rows=len(workload),
        span_s=workload.duration_s,
        distinct_arrivals=int(np.unique(t).size),
        mean_rate=workload.rate,
        median_gap_s=float(np.median(gaps)) if gaps.size else math.nan,
        max_gap_s=float(gaps.max()) if gaps.size else math.nan,
        interarrival_cv=_cv(gaps),
        per_second_cv=per_second_cv,
        max_per_second=max_per_second,
        per_minute_cv=per_minute_cv,
        prompt=LengthStats.of(workload.prompt_len),
        output=LengthStats.of(workload.output_len),
    )
