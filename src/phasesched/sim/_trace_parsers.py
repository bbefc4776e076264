"""Trace parsers: one per file format, each turning a file's lines into columns of raw values.

:func:`detect` tells the format from the first non-blank line; :func:`parse_azure`,
:func:`parse_generic_csv` and :func:`parse_jsonl` (Mooncake and generic JSON Lines) return
:class:`Rows` with each row's 1-based line number, and raise
:class:`~phasesched.sim.trace_format.TraceFormatError` for a row they cannot parse. The checks
every format shares (value ranges, zero outputs, order) are applied afterwards by
:func:`~phasesched.sim.traces.load_trace`, which documents the formats and rules.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import attrs
import numpy as np
from numpy.typing import NDArray

from phasesched.sim.trace_format import TraceFormat, TraceFormatError

__all__ = [
    "AZURE_HEADER",
    "GENERIC_COLUMNS",
    "GENERIC_KEYS",
    "JSONL_SUFFIXES",
    "MOONCAKE_KEYS",
    "JsonKeys",
    "Rows",
    "detect",
    "parse_azure",
    "parse_generic_csv",
    "parse_jsonl",
]

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]

AZURE_HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
JSONL_SUFFIXES = frozenset({".jsonl", ".ndjson"})
_T = TypeVar("_T")


@attrs.frozen(eq=False)
class Rows:
    """Parsed columns before the checks every format shares; ``lines`` are 1-based line numbers."""

    arrival_s: FloatArray
    prompt_len: IntArray
    output_len: IntArray
    priority: IntArray | None
    lines: IntArray
    hash_ids: list[list[int]] | None = None


@attrs.frozen
class JsonKeys:
    """Where a JSON Lines format keeps each field, and what divides its time into seconds.

    ``blocks`` names the optional list of block hash ids, of ``block_size`` tokens each.
    """

    time: str
    time_divisor: float
    prompt: str
    output: str
    priority: str | None
    blocks: str | None = None
    block_size: int = 0


MOONCAKE_KEYS = JsonKeys("timestamp", 1000.0, "input_length", "output_length", None, "hash_ids", 512)
GENERIC_KEYS = JsonKeys("arrival_s", 1.0, "prompt_len", "output_len", "priority")
GENERIC_COLUMNS = ("arrival_s", "prompt_len", "output_len")


def detect(lines: Sequence[str], first: int | None, path: Path) -> TraceFormat:
    """The format whose header (CSV) or keys (JSON Lines) the first non-blank line shows.

    A file with no such line is empty JSON Lines (no requests) if its name ends in ``.jsonl`` or
    ``.ndjson``, and an error otherwise: a CSV trace always has its header.
    """
    if first is None:
        if path.suffix.lower() in JSONL_SUFFIXES:
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
        if set(GENERIC_COLUMNS) <= set(header):
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


def parse_azure(lines: Sequence[str], header: int, path: Path) -> Rows:
    """The Azure CSV rows after the header at index ``header``; times relative to the earliest row."""
    names, rows, numbers = _split_csv(lines, header, path)
    if tuple(names) != AZURE_HEADER:
        raise TraceFormatError(path, header + 1, f"expected the header {','.join(AZURE_HEADER)}, got {names}")
    stamps, prompts, outputs = zip(*rows, strict=True) if rows else ((), (), ())
    nanos = _timestamps_ns(stamps, numbers, path)
    relative = nanos - nanos.min() if nanos.size else nanos
    return Rows(
        arrival_s=relative / 1e9,  # exact int64 nanoseconds, one correctly rounded division
        prompt_len=_int_strings(prompts, numbers, "ContextTokens", path),
        output_len=_int_strings(outputs, numbers, "GeneratedTokens", path),
        priority=None,
        lines=np.asarray(numbers, dtype=np.int64),
    )


def parse_generic_csv(lines: Sequence[str], header: int, path: Path) -> Rows:
    """The generic CSV rows after the header at index ``header``, whose columns may come in any order."""
    names, rows, numbers = _split_csv(lines, header, path)
    missing = [column for column in GENERIC_COLUMNS if column not in names]
    if missing or len(set(names)) != len(names):
        reason = f"the header must name arrival_s, prompt_len and output_len once each, got {names}"
        raise TraceFormatError(path, header + 1, reason)
    transposed = list(zip(*rows, strict=True)) if rows else [()] * len(names)
    columns = dict(zip(names, transposed, strict=True))
    times = _parsed(columns["arrival_s"], numbers, float, "arrival_s is not a number", path)
    return Rows(
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


def parse_jsonl(lines: Sequence[str], path: Path, keys: JsonKeys) -> Rows:
    """Every non-blank line as a JSON object whose fields ``keys`` names (Mooncake or generic)."""
    times: list[float] = []
    prompts: list[int] = []
    outputs: list[int] = []
    priorities: list[int | None] = []
    numbers: list[int] = []
    hash_ids: list[list[int]] | None = [] if keys.blocks else None
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        record = _json_record(line, path, lineno)
        if hash_ids is not None and keys.blocks:
            hash_ids = _block_ids(record, keys.blocks, hash_ids, path, lineno)
        times.append(_json_number(record, keys.time, path, lineno) / keys.time_divisor)
        prompts.append(_json_int(record, keys.prompt, path, lineno))
        outputs.append(_json_int(record, keys.output, path, lineno))
        priority = keys.priority
        priorities.append(_json_int(record, priority, path, lineno) if priority and priority in record else None)
        numbers.append(lineno)
    return Rows(
        arrival_s=np.asarray(times, dtype=np.float64),
        prompt_len=np.asarray(prompts, dtype=np.int64),
        output_len=np.asarray(outputs, dtype=np.int64),
        priority=_all_or_none(priorities, numbers, path),
        lines=np.asarray(numbers, dtype=np.int64),
        hash_ids=hash_ids,
    )


def _block_ids(
    record: dict[str, Any], key: str, so_far: list[list[int]], path: Path, lineno: int
) -> list[list[int]] | None:
    """``so_far`` plus this row's block ids; ``None`` (no blocks for the file) once a row lacks them."""
    if key not in record:
        return None
    ids = record[key]
    if not isinstance(ids, list) or not all(type(i) is int for i in ids):
        raise TraceFormatError(path, lineno, f"{key} must be a list of ints")
    so_far.append(ids)
    return so_far


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
