"""The simulation fast path: many identical pure-decode steps taken in one computation.

Between two events (an arrival, a finish, a page-boundary crossing that could fail) a batch of
pure decodes keeps its composition and only its contexts grow. A simulator asks the scheduler for
that run (:meth:`phasesched.scheduler.Scheduler.decode_run`), prices its steps in one vectorized call, and
commits as many as happen before its next event (:meth:`phasesched.scheduler.Scheduler.advance`). The
result is exactly what stepping one by one gives; a property test holds the two against each
other. This module holds the run's value type and the page arithmetic behind it.

When nothing waits, a finish changes nothing but the batch's size: the requests left keep
decoding, one token each, and nobody is admitted in its place. A run may then pass finishes
(``passes_finishes``): it is a few *segments*, each a run of identical steps of the requests not yet
finished, and it still costs one call to plan, price and commit rather than one per finish.
"""

from __future__ import annotations

import attrs
import numpy as np
from numpy.typing import NDArray

__all__ = ["DecodeRun", "segment_bounds", "steps_that_fit"]

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
            of them may finish requests (unless the run passes finishes, the first finish ends it).
        ignores_later_arrivals: Requests queued while the run lasts cannot change its steps,
            provided they arrive no earlier than every waiting request: the queue is first come,
            first served and its head, which the policy starts but finds no room for, stops
            every admission until something finishes.
        finish_at: int32 ``[B]``: the step (counted from 1) whose end finishes each request, if
            the run reaches it; a request decodes in every step up to it and in none after.
        passes_finishes: Some request finishes before the run's last step, and the batch
            shrinks there (only when nothing waits).
    """

    request_ids: tuple[str, ...]
    slots: Int32Array
    kv_len: Int32Array
    max_steps: int
    _version: int = attrs.field(repr=False)
    ignores_later_arrivals: bool = False
    finish_at: Int32Array = attrs.field(kw_only=True)
    passes_finishes: bool = attrs.field(default=False, kw_only=True)

    def steps_of(self, num_steps: int) -> Int32Array:
        """int32 ``[B]``: steps each request takes among the first ``num_steps`` of the run."""
        return np.minimum(self.finish_at, num_steps)


def segment_bounds(finish_at: Int32Array, num_steps: int) -> list[int]:
    """Where the batch changes within the first ``num_steps`` steps: after each finishing step, then at the end.

    Segment ``k`` covers steps ``bounds[k - 1] .. bounds[k] - 1`` (from 0), whose batch is the
    requests with ``finish_at > bounds[k - 1]``.
    """
    inner: list[int] = np.unique(finish_at[finish_at < num_steps]).tolist()
    return [*inner, num_steps]


def steps_that_fit(  # noqa: PLR0913 -- the batch, its pages, and where each one stops growing
    computed: Int32Array,
    held_pages: int,
    free_pages: int,
    page_size: int,
    steps: int,
    *,
    finish_at: Int32Array | None = None,
) -> int:
    """The most decode steps, up to ``steps``, whose page growth the free pages cover.

    Pages a finish frees are not counted on: a run that would need them stops before, and the
    steps after are planned anew.

    Args:
        computed: int32 ``[B]``: tokens in each sequence's cache now.
        held_pages: Pages the ``B`` sequences hold now.
        free_pages: Free pages.
        page_size: Tokens per page.
        steps: The most steps wanted.
        finish_at: int32 ``[B]``: the step after which each sequence stops growing (its finish),
            when the run passes finishes.
    """

    def fits(k: int) -> bool:
        grown = computed + (k if finish_at is None else np.minimum(finish_at, k))
        return int(((grown + (page_size - 1)) // page_size).sum()) - held_pages <= free_pages

    if steps < 1 or fits(steps):
        return steps
    lo, hi = 0, steps  # fits(lo) holds, fits(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
