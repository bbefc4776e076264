"""Trace formats, and the error a trace file that cannot be read raises.

These two names are shared by the loader and writer (:mod:`~phasesched.sim.traces`) and by the
per-format parsers behind them; they live apart so the parsers can raise
:class:`TraceFormatError` without importing the loader that calls them.
"""

from __future__ import annotations

import enum
import os
from pathlib import Path

from phasesched.errors import PhaseschedError

__all__ = ["TraceFormat", "TraceFormatError"]


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
    """The trace file formats :func:`~phasesched.sim.traces.load_trace` reads (see :mod:`~phasesched.sim.traces`)."""

    AZURE = "azure"
    MOONCAKE = "mooncake"
    CSV = "csv"
    JSONL = "jsonl"
