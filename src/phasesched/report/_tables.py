"""Terminal tables: rich when it is installed, aligned plain text otherwise."""

from __future__ import annotations

import math
import sys
from typing import Any, TextIO

from phasesched.experiments.context import Column, ExperimentResult

__all__ = ["format_cell", "format_table", "loss_note", "print_table", "rich_available"]


def rich_available() -> bool:
    """Whether ``rich`` can be imported (it is in the ``[bench]`` extra, not a core dependency)."""
    try:
        import rich  # noqa: F401, PLC0415 -- an availability probe; rich stays out of `import phasesched`
    except ImportError:
        return False
    return True


def format_cell(value: Any, column: Column) -> str:
    """One cell: numbers by the column's format spec, ``-`` for a missing value, strings as they are."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, str):
        return value
    if column.fmt.endswith("d") and isinstance(value, float) and value.is_integer():
        value = int(value)
    try:
        return format(value, column.fmt)
    except (TypeError, ValueError):
        return str(value)


def loss_note(result: ExperimentResult) -> str | None:
    """A line naming the rows whose outputs the context limit cut short, or ``None`` if none were.

    Rows carry ``truncated_outputs`` and ``truncated_output_tokens``
    (:func:`~phasesched.experiments.context.output_losses`); a table may not show them, so the
    note says it under every table where something was lost.
    """
    cut = [row for row in result.rows if row.get("truncated_outputs")]
    if not cut:
        return None
    parts = []
    for row in cut:
        name = row.get("label") or row.get("policy") or "?"
        parts.append(f"{name}: {row['truncated_outputs']:,} requests, {row['truncated_output_tokens']:,} tokens")
    return "Outputs cut short to fit max_model_len (" + "; ".join(parts) + ")"


def _cells(result: ExperimentResult) -> list[list[str]]:
    return [[format_cell(row.get(c.key), c) for c in result.columns] for row in result.rows]


def _numeric(result: ExperimentResult) -> list[bool]:
    """Per column, whether it holds numbers (right-aligned)."""
    return [any(isinstance(row.get(c.key), (int, float)) for row in result.rows) for c in result.columns]


def format_table(result: ExperimentResult) -> str:
    """The result as plain text: its title, then the columns aligned (text left, numbers right)."""
    headers = [c.header for c in result.columns]
    body = _cells(result)
    widths = [max(len(cell) for cell in column) for column in zip(headers, *body, strict=True)]
    numeric = _numeric(result)

    def line(cells: list[str]) -> str:
        parts = [c.rjust(w) if num else c.ljust(w) for c, w, num in zip(cells, widths, numeric, strict=True)]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([result.title, line(headers), rule, *(line(cells) for cells in body)])


def _rich_table(result: ExperimentResult) -> Any:
    from rich import box  # noqa: PLC0415 -- optional dependency, imported when used
    from rich.table import Table  # noqa: PLC0415

    # No vertical rules: ten columns of numbers then fit an 80-column terminal.
    table = Table(
        title=result.title,
        title_justify="left",
        header_style="bold",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        collapse_padding=True,
    )
    body = _cells(result)
    for i, (column, numeric) in enumerate(zip(result.columns, _numeric(result), strict=True)):
        # On a narrow terminal rich shrinks columns: let headers wrap, never cut a value.
        widest = max((len(cells[i]) for cells in body), default=1)
        table.add_column(column.header, justify="right" if numeric else "left", min_width=widest, overflow="fold")
    for cells in body:
        table.add_row(*cells)
    return table


def print_table(result: ExperimentResult, *, console: Any = None, file: TextIO | None = None) -> None:
    """Print ``result``'s table: on ``console`` (a rich Console) if given, else rich or plain text on ``file``.

    Args:
        result: Any experiment result.
        console: A ``rich.console.Console`` to print on (the CLI passes its progress display's,
            so tables appear above the bar).
        file: Where plain text (or a new rich console) writes; standard output by default.
    """
    if console is not None:
        console.print(_rich_table(result), crop=False)
        return
    out = file if file is not None else sys.stdout
    if rich_available():
        from rich.console import Console  # noqa: PLC0415 -- optional dependency, imported when used

        Console(file=out).print(_rich_table(result), crop=False)
        return
    print(format_table(result), file=out, end="\n\n")
