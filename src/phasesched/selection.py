"""A policy's proposal for one step, and the checks it must pass before the scheduler commits it.

Policies are plugins and may be wrong. Whatever a phase-priority policy returns is checked here,
vectorized, against the scheduler's state: a request appears at most once, token counts fit what
each request has left, the step fits the token budget and sequence cap, and the KV pages it needs
exist once the proposed preemptions free theirs: this step's pages, and for each admission the
pages of its *whole* prefill, as the batch builder's admission rule requires (an admission whose
later chunks could not fit would only run by preempting others). Only then does the scheduler
change anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs
import numpy as np
from numpy.typing import NDArray

from phasesched.errors import InvalidPlanError
from phasesched.kv import PagedKVManager
from phasesched.validators import is_int

if TYPE_CHECKING:
    from phasesched.policies.budget import TokenBudget  # the policies package imports this module
from phasesched.running import RunningArrays
from phasesched.waiting import WaitingQueue

__all__ = ["CheckedSelection", "Selection", "check_selection"]

Int32Array = NDArray[np.int32]


def _int32(values: Sequence[int] | NDArray[np.integer]) -> Int32Array:
    array = np.asarray(values)
    if array.ndim != 1 or (array.dtype.kind not in "iu" and len(array)):
        msg = f"expected a 1-D array of ints, got shape {array.shape} and dtype {array.dtype}"
        raise InvalidPlanError(msg)
    if array.dtype != np.int32:
        if len(array) and int(array.max()) > np.iinfo(np.int32).max:
            msg = "slots and token counts must fit in int32"
            raise InvalidPlanError(msg)
        array = array.astype(np.int32)
    out: Int32Array = array.view()
    out.flags.writeable = False
    return out


def _ids(values: Sequence[str]) -> tuple[str, ...]:
    ids = tuple(values)
    if not all(isinstance(i, str) for i in ids):
        msg = f"admitted must name requests by their str ids, got {ids!r}"
        raise InvalidPlanError(msg)
    return ids


def _ints(values: Sequence[int]) -> tuple[int, ...]:
    ints = tuple(values)
    if not all(is_int(i) for i in ints):
        msg = f"expected ints, got {ints!r}"
        raise InvalidPlanError(msg)
    return ints


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

    @classmethod
    def built(
        cls,
        running_slots: Int32Array,
        running_tokens: Int32Array,
        admitted: tuple[str, ...],
        admitted_tokens: tuple[int, ...],
        preempted: tuple[int, ...] = (),
    ) -> Selection:
        """A selection of values already in the form the converters give (a batch builder's: internal).

        Skips the conversions and their checks, which cost a general step about 20 calls; the
        arrays are still made read-only views.
        """
        selection = object.__new__(cls)
        values = (_read_only(running_slots), _read_only(running_tokens), admitted, admitted_tokens, preempted)
        for name, value in zip(_SELECTION_FIELDS, values, strict=True):
            object.__setattr__(selection, name, value)
        return selection

    @property
    def num_tokens(self) -> int:
        """Tokens the step computes."""
        return int(self.running_tokens.sum()) + sum(self.admitted_tokens)


_SELECTION_FIELDS = tuple(field.name for field in attrs.fields(Selection))


def _read_only(array: Int32Array) -> Int32Array:
    view: Int32Array = array.view()
    view.flags.writeable = False
    return view


@attrs.frozen(eq=False)
class CheckedSelection:
    """A selection that passed :func:`check_selection`, with the per-slot facts it looked up.

    The commit reuses them rather than gathering the same arrays again.

    Attributes:
        selection: The checked selection.
        start: int32 ``[R]``: tokens in each scheduled running request's cache.
        known: int32 ``[R]``: tokens known for each of them.
        new_pages: int64 ``[R]``: KV pages each of them needs for this step.
        admitted_cached: Cached prefix pages each admission claims (prefix caching; else 0s).

    """

    selection: Selection
    start: Int32Array
    known: Int32Array
    new_pages: NDArray[np.int64]
    admitted_cached: tuple[int, ...] = ()


def check_selection(  # noqa: PLR0913 -- the state a proposal is checked against, passed explicitly
    selection: Selection,
    *,
    arrays: RunningArrays,
    running: Int32Array,
    waiting: WaitingQueue,
    kv: PagedKVManager,
    budget: TokenBudget,
    trusted: bool = False,
) -> CheckedSelection:
    """Raise :class:`~phasesched.errors.InvalidPlanError` unless ``selection`` can be committed as it stands.

    Args:
        selection: The policy's proposal.
        arrays: The scheduler's per-slot running state (``[S]`` arrays).
        running: int32 ``[n]``: slots of every running request.
        waiting: The waiting queue the admissions must come from.
        kv: The KV manager whose free pages the step must fit.
        budget: The token and sequence caps.
        trusted: The selection is a built-in priority's batch builder's (which keeps every rule
            below as it builds): only the admissions are looked up, for their cached prefixes.
            The equivalence tests hold this, by running the same priorities behind a plugin
            wrapper, which is checked in full.

    Returns:
        The selection with the int32 ``[R]`` ``start`` and ``known`` and the int64 ``[R]``
        ``new_pages`` of its running slices, for the commit to reuse.
    """
    slots, tokens = selection.running_slots, selection.running_tokens
    if trusted:
        start = arrays.computed[slots]
        if not selection.admitted:
            cached: tuple[int, ...] = ()
        elif kv.prefix_caching:
            cached = _cached_prefixes(selection.admitted, waiting, kv)
        else:  # nothing cached to look up
            cached = (0,) * len(selection.admitted)
        return CheckedSelection(selection, start, arrays.known[slots], kv.pages_to_grow(slots, start + tokens), cached)
    _require(len(slots) == len(tokens), "running_slots and running_tokens differ in length")
    _require(len(selection.admitted) == len(selection.admitted_tokens), "admitted and admitted_tokens differ in length")
    _check_slots(slots, selection.preempted, arrays)
    start, known = arrays.computed[slots], arrays.known[slots]
    if len(tokens):
        _require(int(tokens.min()) > 0, "every scheduled request must compute at least one token")
        _require(
            not np.count_nonzero(tokens > known - start), "a request is given more tokens than it has left to compute"
        )
    admitted_pages, whole_pages, cached = _check_admitted(selection, waiting, kv) if selection.admitted else (0, 0, ())
    num_running = len(running) - len(selection.preempted) + len(selection.admitted)
    _require(
        num_running <= budget.max_num_seqs, f"{num_running} running sequences exceed max_num_seqs={budget.max_num_seqs}"
    )
    total = selection.num_tokens
    _require(
        total <= budget.max_num_batched_tokens,
        f"{total} tokens exceed max_num_batched_tokens={budget.max_num_batched_tokens}",
    )
    new_pages = kv.pages_to_grow(slots, start + tokens)
    _check_pages(int(new_pages.sum()), admitted_pages, whole_pages, selection, kv)
    return CheckedSelection(selection, start, known, new_pages, cached)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidPlanError(message)


def _check_slots(slots: Int32Array, preempted: tuple[int, ...], arrays: RunningArrays) -> None:
    everyone = np.concatenate([slots, np.asarray(preempted, dtype=np.int32)]) if preempted else slots
    if not len(everyone):
        return
    size = len(arrays.running)
    _require(
        int(everyone.min()) >= 0 and int(everyone.max()) < size and bool(arrays.running[everyone].all()),
        "a slot in the selection holds no running request",
    )
    seen = np.zeros(size, dtype=bool)
    seen[everyone] = True
    _require(np.count_nonzero(seen) == len(everyone), "a running request is scheduled or preempted twice")


def _check_admitted(
    selection: Selection, waiting: WaitingQueue, kv: PagedKVManager
) -> tuple[int, int, tuple[int, ...]]:
    """Check the admissions; return the pages they take now, those their whole prefills need, and their cached ones.

    The page counts include precomputed (transferred) and cached tokens: a cached page claimed
    from the idle cache is one fewer free page, and counting a shared one too only errs safe.
    """
    _require(len(set(selection.admitted)) == len(selection.admitted), "a waiting request is admitted twice")
    pages = whole = 0
    cached: list[int] = []
    for request_id, num in zip(selection.admitted, selection.admitted_tokens, strict=True):
        seq = waiting.get(request_id)
        _require(seq is not None, f"admitted request {request_id!r} is not waiting")
        assert seq is not None
        hits = seq.cached_pages(kv)
        start = max(seq.precomputed, hits * kv.page_size)
        left = seq.num_tokens - start
        _require(
            isinstance(num, (int, np.integer)) and 0 < num <= left,
            f"admitted request {request_id!r} given {num} tokens of {left}",
        )
        pages += kv.pages_for(start + int(num))
        whole += kv.pages_for(seq.num_tokens)
        cached.append(hits)
    return pages, whole, tuple(cached)


def _cached_prefixes(admitted: tuple[str, ...], waiting: WaitingQueue, kv: PagedKVManager) -> tuple[int, ...]:
    """The cached pages each admission claims (a trusted selection's: its admissions are waiting)."""
    cached = []
    for request_id in admitted:
        seq = waiting.get(request_id)
        assert seq is not None, f"a trusted selection admits {request_id!r}, which is not waiting"
        cached.append(seq.cached_pages(kv))
    return tuple(cached)


def _check_pages(growth: int, admitted: int, whole: int, selection: Selection, kv: PagedKVManager) -> None:
    """Running requests may grow into every free page; admissions' whole prefills must fit beside the watermark.

    Args:
        growth: Pages the running requests take this step.
        admitted: Pages the admissions take this step (their first chunks).
        whole: Pages the admissions' whole prefills need.
        selection: The proposal (its preemptions free pages).
        kv: The KV manager.
    """
    need, reserve = growth + admitted, kv.watermark_pages if admitted else 0
    if need <= kv.num_free_pages and whole + reserve <= kv.num_free_pages:
        return
    available = kv.num_free_pages + kv.freed_by_freeing(np.asarray(selection.preempted, dtype=np.int32))
    _require(need <= available, f"the step needs {need} KV pages, {available} would be free")
    _require(
        whole + reserve <= available,
        f"admitted prefills need {whole} KV pages in all, of {available} free, but {reserve} are the watermark's",
    )
