"""A policy's proposal for one step, and the checks it must pass before the scheduler commits it.

Policies are plugins and may be wrong. Whatever a phase-priority policy returns is checked here,
vectorized, against the scheduler's state: a request appears at most once, token counts fit what
each request has left, the step fits the token budget and sequence cap, and the KV pages it needs
exist once the proposed preemptions free theirs. Only then does the scheduler change anything.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np
from numpy.typing import NDArray

from phasesched.errors import InvalidPlanError
from phasesched.kv import PagedKVManager
from phasesched.policies.budget import TokenBudget
from phasesched.state import RunningArrays, WaitingQueue

__all__ = ["Selection", "check_selection"]

Int32Array = NDArray[np.int32]


def _int32(values: Sequence[int] | NDArray[np.integer]) -> Int32Array:
    array = np.asarray(values, dtype=np.int64)
    if array.ndim != 1:
        msg = f"expected a 1-D array of ints, got shape {array.shape}"
        raise InvalidPlanError(msg)
    if len(array) and (array.min() < 0 or array.max() > np.iinfo(np.int32).max):
        msg = "slots and token counts must be non-negative int32 values"
        raise InvalidPlanError(msg)
    out = array.astype(np.int32)
    out.flags.writeable = False
    return out


def _ids(values: Sequence[str]) -> tuple[str, ...]:
    return tuple(values)


def _ints(values: Sequence[int]) -> tuple[int, ...]:
    return tuple(values)


@attrs.frozen(eq=False)
class Selection:
    """Which requests run in a step and how many tokens each computes.

    Attributes:
        running_slots: int32 ``[R]``: running requests scheduled, by slot.
        running_tokens: int32 ``[R]``: tokens each of them computes.
        admitted: Waiting requests admitted this step, by id, in order.
        admitted_tokens: Tokens each admitted request computes.
        preempted: Running slots to preempt (by recompute) before the step.

    """

    running_slots: Int32Array = attrs.field(converter=_int32)
    running_tokens: Int32Array = attrs.field(converter=_int32)
    admitted: tuple[str, ...] = attrs.field(default=(), converter=_ids)
    admitted_tokens: tuple[int, ...] = attrs.field(default=(), converter=_ints)
    preempted: tuple[int, ...] = attrs.field(default=(), converter=_ints)

    @classmethod
    def empty(cls) -> Selection:
        """An idle step."""
        return cls(np.empty(0, np.int32), np.empty(0, np.int32))

    @property
    def num_tokens(self) -> int:
        """Tokens the step computes."""
        return int(self.running_tokens.sum()) + sum(self.admitted_tokens)


def check_selection(  # noqa: PLR0913 -- the state a proposal is checked against, passed explicitly
    selection: Selection,
    *,
    arrays: RunningArrays,
    running: Int32Array,
    waiting: WaitingQueue,
    kv: PagedKVManager,
    budget: TokenBudget,
) -> None:
    """Raise :class:`InvalidPlanError` unless ``selection`` can be committed as it stands."""
    slots, tokens = selection.running_slots, selection.running_tokens
    preempted = np.asarray(selection.preempted, dtype=np.int64)
    _require(len(slots) == len(tokens), "running_slots and running_tokens differ in length")
    _require(len(selection.admitted) == len(selection.admitted_tokens), "admitted and admitted_tokens differ in length")
    _check_running(slots, tokens, preempted, arrays)
    _check_admitted(selection, waiting)
    num_running = len(running) - len(preempted) + len(selection.admitted)
    _require(
        num_running <= budget.max_num_seqs, f"{num_running} running sequences exceed max_num_seqs={budget.max_num_seqs}"
    )
    total = selection.num_tokens
    _require(
        total <= budget.max_num_batched_tokens,
        f"{total} tokens exceed max_num_batched_tokens={budget.max_num_batched_tokens}",
    )
    _check_pages(selection, preempted.astype(np.int32), arrays, kv)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidPlanError(message)


def _check_running(slots: Int32Array, tokens: Int32Array, preempted: NDArray[np.int64], arrays: RunningArrays) -> None:
    size = len(arrays.running)
    everyone = np.concatenate([slots, preempted]).astype(np.int64)
    _require(
        bool(np.all(everyone < size)) and bool(np.all(arrays.running[everyone])),
        "a slot in the selection holds no running request",
    )
    _require(len(np.unique(everyone)) == len(everyone), "a running request is scheduled or preempted twice")
    _require(bool(np.all(tokens > 0)), "every scheduled request must compute at least one token")
    left = arrays.known[slots] - arrays.computed[slots]
    _require(bool(np.all(tokens <= left)), "a request is given more tokens than it has left to compute")


def _check_admitted(selection: Selection, waiting: WaitingQueue) -> None:
    _require(len(set(selection.admitted)) == len(selection.admitted), "a waiting request is admitted twice")
    for request_id, num in zip(selection.admitted, selection.admitted_tokens, strict=True):
        seq = waiting.get(request_id)
        _require(seq is not None, f"admitted request {request_id!r} is not waiting")
        assert seq is not None
        _require(
            isinstance(num, (int, np.integer)) and 0 < num <= seq.num_tokens,
            f"admitted request {request_id!r} given {num} tokens of {seq.num_tokens}",
        )


def _check_pages(selection: Selection, preempted: Int32Array, arrays: RunningArrays, kv: PagedKVManager) -> None:
    slots = selection.running_slots
    after = arrays.computed[slots].astype(np.int64) + selection.running_tokens
    grow = np.maximum(-(-after // kv.page_size) - kv.page_counts[slots], 0)
    admit = sum(kv.pages_for(int(n)) for n in selection.admitted_tokens)
    need = int(grow.sum()) + admit
    available = kv.num_free_pages + kv.freed_by_closing(preempted)
    _require(need <= available, f"the step needs {need} KV pages, {available} would be free")
