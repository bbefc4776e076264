"""The simulation fast path: many identical pure-decode steps taken in one computation.

Between two events (an arrival, a finish, a page-boundary crossing that could fail) a batch of
pure decodes keeps its composition and only its contexts grow. A simulator asks the scheduler for
that run (:meth:`DecodeRuns.decode_run`), prices its steps in one vectorized call, and commits
as many as happen before its next event (:meth:`DecodeRuns.advance`). The result is exactly
what stepping one by one gives; a property test holds the two against each other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs
import numpy as np
from numpy.typing import NDArray

from phasesched.errors import InvalidPlanError
from phasesched.request import FinishReason
from phasesched.selection import CheckedSelection, Selection

if TYPE_CHECKING:
    from phasesched.kv import PagedKVManager
    from phasesched.plan import StepPlan
    from phasesched.policies.policy import SchedulingPolicy
    from phasesched.running import RunningArrays
    from phasesched.scheduler import FinishedRequest
    from phasesched.waiting import WaitingQueue

__all__ = ["DecodeRun", "DecodeRuns"]

Int32Array = NDArray[np.int32]


@attrs.frozen(eq=False)
class DecodeRun:
    """Identical pure-decode steps the scheduler is certain to take next (see :meth:`DecodeRuns.decode_run`).

    Attributes:
        request_ids: The running requests, in batch order.
        slots: int32 ``[B]``: their slots.
        kv_len: int32 ``[B]``: each one's context after the *first* of the steps.
        max_steps: Steps that can be taken at once without running out of KV pages; the last
            of them may finish requests (the first finish ends the run).
    """

    request_ids: tuple[str, ...]
    slots: Int32Array
    kv_len: Int32Array
    max_steps: int
    _version: int = attrs.field(repr=False)


class DecodeRuns:
    """The scheduler's fast path for simulators (mixed into :class:`~phasesched.Scheduler`)."""

    policy: SchedulingPolicy
    kv: PagedKVManager
    _arrays: RunningArrays
    _running: Int32Array
    _waiting: WaitingQueue
    _in_flight: StepPlan | None
    _next_step: int
    _version: int

    def _finish(self, slots: Int32Array, reasons: list[FinishReason]) -> tuple[FinishedRequest, ...]:
        raise NotImplementedError

    def decode_run(self, max_steps: int) -> DecodeRun | None:
        """The next steps, if they are certain to be identical pure-decode steps.

        A simulator uses this to advance many steps in one vectorized computation. It applies
        when no plan is in flight, nothing waits, every running request is decoding, carries
        no token ids, EOS or stop tokens (its tokens are synthetic), the token budget holds
        them all, and the policy's phase priority declares ``schedules_every_decode``: then
        each step until the first finish schedules exactly the same requests, one token each.

        Returns:
            The run, capped at ``max_steps``, or ``None`` when it does not apply.
        """
        if max_steps < 1 or not self._steady():
            return None
        arrays, running = self._arrays, self._running
        computed, known = arrays.computed[running], arrays.known[running]
        if np.count_nonzero(known - computed - 1):  # someone is still prefilling
            return None
        steps = min(max_steps, int((arrays.max_known[running] - known).min()))  # up to the first finish
        steps = self._steps_that_fit(computed, steps)
        if steps < 1:
            return None
        ids = tuple(arrays.ids[running].tolist())
        return DecodeRun(ids, running.copy(), computed + 1, steps, self._version)

    def advance(self, run: DecodeRun, num_steps: int) -> tuple[FinishedRequest, ...]:
        """Take ``num_steps`` of ``run``'s steps at once: every request computes and samples ``num_steps`` tokens.

        Returns:
            The requests that finished in the last of the steps (for length).

        Raises:
            InvalidPlanError: The run is stale (the scheduler changed since it was made) or
                ``num_steps`` is outside ``[1, run.max_steps]``; nothing changed.
        """
        if run._version != self._version:  # noqa: SLF001 -- the run's own token
            msg = "this DecodeRun is stale: the scheduler changed after decode_run()"
            raise InvalidPlanError(msg)
        if not 1 <= num_steps <= run.max_steps:
            msg = f"num_steps must be in [1, {run.max_steps}], got {num_steps}"
            raise InvalidPlanError(msg)
        arrays, slots = self._arrays, run.slots
        arrays.computed[slots] += num_steps
        known = arrays.known[slots] + num_steps
        arrays.known[slots] = known
        self.kv.grow_many(slots, arrays.computed[slots])
        self._next_step += num_steps
        self._version += 1
        done = slots[known >= arrays.max_known[slots]]
        return self._finish(done, [FinishReason.LENGTH] * len(done)) if len(done) else ()

    def _steady(self) -> bool:
        """Whether the batch is fixed until something finishes or arrives, with tokens nobody reads."""
        return self._steady_composition() and not self._arrays.num_with_tokens  # ids, EOS or stop tokens matter

    def _steady_composition(self) -> bool:
        """Whether the policy is certain to schedule every running request, as it would with nothing waiting."""
        if self._in_flight is not None or len(self._waiting) or not len(self._running):
            return False
        if not getattr(self.policy.priority, "schedules_every_decode", False):
            return False
        return len(self._running) <= self.policy.budget.max_num_batched_tokens

    def _steady_step(self) -> CheckedSelection | None:
        """The next step, when it is certain to be every running request decoding one token.

        Then the policy's answer is known without asking it, and since the selection is built
        here from the scheduler's own state there is nothing to check: the steady decode step
        costs only the plan's arrays. ``None`` when that is not certain (a prefill under way,
        someone waiting, KV too short for the step).
        """
        if not self._steady_composition():
            return None
        arrays, running, size = self._arrays, self._running, self.kv.page_size
        start, known = arrays.computed[running], arrays.known[running]
        if np.count_nonzero(known - start - 1):
            return None
        new_pages = ((start + size) // size - self.kv.page_counts[running]).astype(np.int64)
        if int(new_pages.sum()) > self.kv.num_free_pages:
            return None  # the policy would preempt: let it
        selection = Selection(running, np.ones(len(running), dtype=np.int32))
        return CheckedSelection(selection, start, known, new_pages)

    def _steps_that_fit(self, computed: Int32Array, steps: int) -> int:
        """The most steps (up to ``steps``) whose page growth the free pages cover."""
        size, held, free = self.kv.page_size, int(self.kv.page_counts[self._running].sum()), self.kv.num_free_pages

        def fits(k: int) -> bool:
            return int(((computed + (k + size - 1)) // size).sum()) - held <= free

        if steps < 1 or fits(steps):
            return steps
        lo, hi = 0, steps  # fits(lo) holds, fits(hi) does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo
