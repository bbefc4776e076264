"""The executor seam: what runs a plan, and what it must hand back.

An executor receives a :class:`~phasesched.plan.StepPlan` and returns a :class:`StepResult`:
one token per slice that samples, optional finish flags, and the step's duration if it can
vouch for one. It never reads the scheduler's internals; the plan is all it gets. Per-request
state (sampling generators, for instance) may be created from ``plan.new_requests`` and dropped
on ``plan.released``.
"""

from __future__ import annotations

import math
from typing import Protocol, runtime_checkable

import attrs
import numpy as np
from numpy.typing import NDArray

from phasesched.errors import InvalidResultError
from phasesched.plan import StepPlan

__all__ = ["DeterministicExecutor", "Executor", "StepResult"]

_INT32 = np.iinfo(np.int32)


def _int32_array(value: object) -> NDArray[np.int32]:
    array = np.asarray(value)
    if array.dtype.kind not in "iu":
        msg = f"token_ids must be integers, got dtype {array.dtype}"
        raise InvalidResultError(msg)
    if array.dtype != np.int32 and array.size and (int(array.max()) > _INT32.max or int(array.min()) < _INT32.min):
        msg = f"token_ids must fit in int32 (a token id is at most {_INT32.max}), got {int(array.max())}"
        raise InvalidResultError(msg)
    out: NDArray[np.int32] = array.astype(np.int32)  # a copy, which the result then owns
    out.flags.writeable = False
    return out


def _bool_array_or_none(value: object) -> NDArray[np.bool_] | None:
    if value is None:
        return None
    array = np.asarray(value)
    if array.dtype != np.bool_:
        msg = f"finished must be booleans, got dtype {array.dtype}"
        raise InvalidResultError(msg)
    flags: NDArray[np.bool_] = array.copy()
    flags.flags.writeable = False
    return flags


@attrs.frozen(eq=False)
class StepResult:
    """What an executor returns for one plan.

    Attributes:
        step_id: The ``step_id`` of the plan this answers.
        token_ids: int32 ``[B]``: the sampled token of each slice whose ``plan.samples`` is
            set; entries of other slices are ignored (by convention -1).
        finished: bool ``[B]`` or ``None``: slices the executor declares finished after this
            step (a simulator that knows output lengths, a stop string matched).
        duration_s: Seconds the step took (measured or simulated), or ``None`` when the
            executor makes no timing claim.

    """

    step_id: int
    token_ids: NDArray[np.int32] = attrs.field(converter=_int32_array)
    finished: NDArray[np.bool_] | None = attrs.field(default=None, converter=_bool_array_or_none)
    duration_s: float | None = None

    def check_against(self, plan: StepPlan) -> None:
        """Raise :class:`InvalidResultError` unless this result can answer ``plan``."""
        if self.step_id != plan.step_id:
            msg = f"result for step {self.step_id} does not answer plan {plan.step_id}"
            raise InvalidResultError(msg)
        if self.token_ids.shape != (plan.batch_size,):
            msg = f"token_ids has shape {self.token_ids.shape}, the plan has {plan.batch_size} slices"
            raise InvalidResultError(msg)
        if self.finished is not None and self.finished.shape != (plan.batch_size,):
            msg = f"finished has shape {self.finished.shape}, the plan has {plan.batch_size} slices"
            raise InvalidResultError(msg)
        if np.count_nonzero(self.token_ids[plan.samples] < 0):
            msg = "a slice that samples was given a negative token id"
            raise InvalidResultError(msg)
        if self.duration_s is not None and not (math.isfinite(self.duration_s) and self.duration_s >= 0):
            msg = f"duration_s must be a finite non-negative number, got {self.duration_s}"
            raise InvalidResultError(msg)


@runtime_checkable
class Executor(Protocol):
    """Runs one plan and reports what it produced."""

    def execute(self, plan: StepPlan) -> StepResult:
        """Run ``plan``'s slices (write their KV, attend, sample) and return the result."""
        ...


@attrs.define
class DeterministicExecutor:
    """A test executor: the token sampled at position ``p`` is ``(p + 1) % vocab_size``.

    It computes nothing and makes no timing claim (``duration_s`` is ``None``), so tests can
    predict every token a request receives.

    >>> from phasesched import Request, Scheduler, SchedulerConfig
    >>> scheduler = Scheduler(SchedulerConfig(num_pages=16, page_size=4))
    >>> scheduler.add_request(Request("r", prompt_token_ids=[5, 6, 7], max_new_tokens=2))
    >>> executor = DeterministicExecutor()
    >>> plan = scheduler.schedule(now=0.0)
    >>> outcome = scheduler.update(plan, executor.execute(plan))
    >>> outcome.new_token_ids.tolist()  # sampled at position 2
    [3]
    """

    vocab_size: int = 32000

    def execute(self, plan: StepPlan) -> StepResult:
        """Emit the position-derived token for every slice that samples."""
        last_position = plan.start + plan.num_new - 1
        tokens = np.where(plan.samples, (last_position + 1) % self.vocab_size, -1)
        return StepResult(step_id=plan.step_id, token_ids=tokens)
