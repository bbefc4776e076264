"""Request traces: load real arrival/length traces as :class:`~phasesched.sim.Workload` values, and write them.

Four formats are read, each detected from the file's first line (the extension is not trusted):

``azure``
    The Azure LLM inference trace 2023 (Splitwise, ISCA 2024): CSV with the header
    ``TIMESTAMP,ContextTokens,GeneratedTokens``. Timestamps are naive wall-clock times with
    seven fractional digits (``2023-11-16 18:17:03.9799600``); they are parsed exactly, to the
    nanosecond, and made relative to the earliest row.
``mooncake``
    The Mooncake / Kimi FAST'25 traces: JSON Lines with ``timestamp`` (milliseconds from the
    start of the trace), ``input_length`` and ``output_length``; ``hash_ids`` (one id per
    512-token block of the prompt), when every row has them, become the workload's ``blocks``, so
    a policy with prefix caching replays the trace's cache hits; other keys are ignored. Times
    are kept as given (already relative). **Mooncake timestamps fall on a ~3 s grid** (about
    ten requests share each tick), so by default each tick's requests are sent as one batch, as
    recorded; ``spread_ticks=True`` spreads them evenly within their tick instead.
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

Every row is checked, and the first bad one raises
:class:`~phasesched.sim.trace_format.TraceFormatError` naming the file and its 1-based line number
(the header is line 1): a missing field, a length that is not an integer or is below 1, a time
that is not a finite number ``>= 0``, or a time earlier than the row before.

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

This module holds the two entry points and the rules above. Each format's parser is in the
private ``_trace_parsers`` module; :class:`~phasesched.sim.trace_format.TraceFormat` and
:class:`~phasesched.sim.trace_format.TraceFormatError` are in :mod:`~phasesched.sim.trace_format`
so that those parsers can raise the error without importing this module. Statistics over a
trace are in :mod:`~phasesched.sim.trace_stats`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import attrs
import numpy as np
from numpy.typing import NDArray

from phasesched.errors import InvalidArgumentError
from phasesched.sim._trace_parsers import (
    GENERIC_COLUMNS,
    GENERIC_KEYS,
    JSONL_SUFFIXES,
    MOONCAKE_KEYS,
    Rows,
    detect,
    parse_azure,
    parse_generic_csv,
    parse_jsonl,
)
from phasesched.sim.block_hashes import BlockHashes
from phasesched.sim.trace_format import TraceFormat, TraceFormatError
from phasesched.sim.workload import Workload

__all__ = ["load_trace", "write_trace"]

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]
ZeroOutput = Literal["reject", "clamp", "drop"]

# Times may step back this much (seconds) before a row counts as out of order: logging jitter.
BACKSTEP_TOLERANCE_S = 1e-6
_CHUNK = 4096
_ZERO_OUTPUT_RULES = frozenset({"reject", "clamp", "drop"})


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
        format: One of :class:`~phasesched.sim.trace_format.TraceFormat` (or its value); by default
            detected from the first line.
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
        raise InvalidArgumentError(msg)
    requested = None if format is None else _format(format)  # a bad name fails before the file is read
    path = Path(path)
    text = _read_text(path)
    lines = text.replace("\r\n", "\n").split("\n")
    first = next((i for i, line in enumerate(lines) if line.strip()), None)
    fmt = detect(lines, first, path) if requested is None else requested
    if first is None and fmt in {TraceFormat.AZURE, TraceFormat.CSV}:
        raise TraceFormatError(path, None, "the file is empty; a CSV trace needs at least its header")
    if fmt is TraceFormat.AZURE:
        rows = parse_azure(lines, first or 0, path)
    elif fmt is TraceFormat.CSV:
        rows = parse_generic_csv(lines, first or 0, path)
    else:
        rows = parse_jsonl(lines, path, MOONCAKE_KEYS if fmt is TraceFormat.MOONCAKE else GENERIC_KEYS)
    rows = _checked(rows, path, zero_output=zero_output, sort=sort)
    arrival_s = _spread_ties(rows.arrival_s) if spread_ticks else rows.arrival_s
    blocks = None
    if rows.hash_ids is not None and fmt is TraceFormat.MOONCAKE:
        blocks = BlockHashes.from_lists(MOONCAKE_KEYS.block_size, rows.hash_ids)
    return Workload(name or path.stem, arrival_s, rows.prompt_len, rows.output_len, rows.priority, blocks)


# --------------------------------------------------------------------------------------------
# Checks shared by every format
# --------------------------------------------------------------------------------------------


def _format(value: TraceFormat | str) -> TraceFormat:
    """``value`` as a :class:`TraceFormat`; an unknown name is an :class:`~phasesched.errors.InvalidArgumentError`."""
    try:
        return TraceFormat(value)
    except ValueError:
        known = ", ".join(f.value for f in TraceFormat)
        msg = f"unknown trace format {value!r}; known formats: {known}"
        raise InvalidArgumentError(msg) from None


def _read_text(path: Path) -> str:
    """The file's text; a file that is not UTF-8 (a binary, a compressed trace) is a :class:`TraceFormatError`."""
    try:
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as error:
        reason = f"not a text trace: byte {error.object[error.start]:#04x} at offset {error.start} is not UTF-8"
        raise TraceFormatError(path, None, reason) from None


def _first_bad(rows: Rows, bad: NDArray[np.bool_], path: Path, reason: str) -> None:
    """Raise ``reason`` for the first row where ``bad`` (bool ``[N]``) holds."""
    if bad.any():
        raise TraceFormatError(path, int(rows.lines[int(np.argmax(bad))]), reason)


def _checked(rows: Rows, path: Path, *, zero_output: ZeroOutput, sort: bool) -> Rows:
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


def _ordered(rows: Rows, path: Path, *, sort: bool) -> Rows:
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


def _take(rows: Rows, index: IntArray) -> Rows:
    priority = None if rows.priority is None else rows.priority[index]
    hash_ids = None if rows.hash_ids is None else [rows.hash_ids[i] for i in index.tolist()]
    return Rows(
        rows.arrival_s[index], rows.prompt_len[index], rows.output_len[index], priority, rows.lines[index], hash_ids
    )


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
        fmt = TraceFormat.JSONL if path.suffix.lower() in JSONL_SUFFIXES else TraceFormat.CSV
    else:
        fmt = _format(format)
    if fmt not in {TraceFormat.CSV, TraceFormat.JSONL}:
        msg = f"write_trace writes the generic csv or jsonl formats, not {fmt.value}"
        raise InvalidArgumentError(msg)
    has_priority = workload.priority is not None
    with path.open("w", encoding="utf-8", newline="\n") as out:
        if fmt is TraceFormat.CSV:
            out.write(",".join([*GENERIC_COLUMNS, "priority"] if has_priority else GENERIC_COLUMNS) + "\n")
        for start in range(0, len(workload), _CHUNK):
            out.writelines(_formatted_rows(workload, slice(start, start + _CHUNK), fmt))


def _formatted_rows(workload: Workload, rows: slice, fmt: TraceFormat) -> list[str]:
    columns = [workload.arrival_s[rows].tolist(), workload.prompt_len[rows].tolist()]
    columns.append(workload.output_len[rows].tolist())
    if workload.priority is not None:
        columns.append(workload.priority[rows].tolist())
    if fmt is TraceFormat.CSV:
        return [",".join(map(repr, row)) + "\n" for row in zip(*columns, strict=True)]
    keys = [*GENERIC_COLUMNS, "priority"]
    return [
        "{" + ", ".join(f'"{k}": {v!r}' for k, v in zip(keys, row, strict=False)) + "}\n"
        for row in zip(*columns, strict=True)
    ]
