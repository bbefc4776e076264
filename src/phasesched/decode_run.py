"""The simulation fast path: many identical pure-decode steps taken in one computation.

Between two events (an arrival, a finish, a page-boundary crossing that could fail) a batch of
pure decodes keeps its composition and only its contexts grow. A simulator asks the scheduler for
that run (:meth:`phasesched.scheduler.Scheduler.decode_run`), prices its steps in one vectorized call, and
commits as many as happen before its next event (:meth:`phasesched.scheduler.Scheduler.advance`). The
result is exactly what stepping one by one gives; a property test holds the two against each
other. This module holds the run's value type and the page arithmetic behind it.
"""

from __future__ import annotations

import attrs
import numpy as np
from numpy.typing import NDArray

__all__ = ["DecodeRun", "steps_that_fit"]

Int32Array = NDArray[np.int32]


@attrs.frozen(eq=False)
class DecodeRun:
    """Identical pure-decode steps the scheduler is certain to take next.

    See :meth:`phasesched.scheduler.Scheduler.decode_run`.

    Attributes:
        request_ids: The running requests, in batch order.
        slots: int32 ``[B]``: their slots.
        kv_len: int32 ``[B]``: each one's context after the *first* of the steps.
        max_steps: Steps that can be taken at once without running out of KV pages; the last
            of them may finish requests (the first finish ends the run).
        ignores_later_arrivals: Requests queued while the run lasts cannot change its steps,
            provided they arrive no earlier than every waiting request: the queue is first come,
            first served and its head, which the policy starts but finds no room for, stops
            every admission until something finishes.
    """

    request_ids: tuple[str, ...]
    slots: Int32Array
    kv_len: Int32Array
    max_steps: int
    _version: int = attrs.field(repr=False)
    ignores_later_arrivals: bool = False


def steps_that_fit(computed: Int32Array, held_pages: int, free_pages: int, page_size: int, steps: int) -> int:
    """The most decode steps, up to ``steps``, whose page growth the free pages cover.

    Args:
        computed: int32 ``[B]``: tokens in each sequence's cache now.
        held_pages: Pages the ``B`` sequences hold now.
        free_pages: Free pages.
        page_size: Tokens per page.
        steps: The most steps wanted.
    """

    def fits(k: int) -> bool:
        return int(((computed + (k + page_size - 1)) // page_size).sum()) - held_pages <= free_pages

    if steps < 1 or fits(steps):
        return steps
    lo, hi = 0, steps  # fits(lo) holds, fits(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
