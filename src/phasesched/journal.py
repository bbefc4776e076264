"""An undo log, so that ``schedule()`` and ``update()`` are atomic.

The scheduler checks a selection before it commits it, but a commit still takes several steps
(preempt, grow, admit, build the plan), and anything can raise part-way: a bug, a value no check
foresaw, a ``MemoryError``. Each step that changes state records how to undo itself here; if a
later step raises, :meth:`Journal.rollback` undoes them newest first and the scheduler is as it
was before the call. Recording costs one closure per step, so the hot path stays flat: no copy
of the scheduler's arrays is ever taken.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["Journal"]


class Journal:
    """Undo actions of one call, undone newest first on failure.

    >>> journal, state = Journal(), [1]
    >>> state.append(2)
    >>> journal.record(state.pop)
    >>> journal.rollback()
    >>> state
    [1]
    """

    def __init__(self) -> None:
        self._undo: list[Callable[[], object]] = []

    def record(self, undo: Callable[[], object]) -> None:
        """Remember ``undo``, which reverses a change just made."""
        self._undo.append(undo)

    def rollback(self) -> None:
        """Undo every recorded change, newest first, and forget them."""
        while self._undo:
            self._undo.pop()()
