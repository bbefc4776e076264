"""A decode-first step worked out from the scheduler's state, without building it in a ``BatchBuilder``.

For exactly :class:`~phasesched.policies.priority.DecodeFirst` with a chunk sizer that never
reads the batch (``BATCH_BLIND_CHUNKERS``: whole prompts, fixed chunks, vLLM's thresholds), a
preemption policy that never preempts for waiting requests and a queue order that does not
re-rank, the policy's step is fixed by the scheduler's state: every decode, then each ongoing
prefill's chunk in admission order, then waiting requests in queue order while a seat, a token
and room for the whole prefill remain (the builder's rules, which :func:`decode_first_selection`
follows step for step). The chunk sizer itself sizes every slice. When the decodes' pages do
not all fit and the victims go by :class:`~phasesched.policies.preemption.LatestArrival`
(vLLM's), the preemptions are fixed by the state too: decodes are taken in order while they
fit, and for each that does not the latest arrival is preempted (``add_running``'s loop); the
step then admits nobody, as the builder's ``admit`` refuses once running requests were
preempted for KV.

Working the step out here costs about half the calls of filling a builder with its view and
candidates (about 100 against 200 for a simulated admission step), the larger part of a general
step's planning when a handful of requests run (a simulation's arrivals, a small engine's
admissions; and preemptions, a simulation's usual general step once its KV runs short). When an
ongoing prefill's chunk would preempt, the answer is ``None`` and the scheduler asks the policy.
``tests/test_mixed_fast_path.py`` holds every plan to the policy's own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
from numpy.typing import NDArray

from phasesched.policies.builder import checked_chunk
from phasesched.policies.chunking import ChunkContext, ChunkSizer, PrefillCandidate
from phasesched.selection import Selection

if TYPE_CHECKING:
    from phasesched.request import Request
    from phasesched.waiting import WaitingCandidate

__all__ = ["RunningState", "StepRoom", "Victims", "decode_first_selection", "selection_after_decodes"]

Int32Array = NDArray[np.int32]
_NO_BATCH: NDArray[np.int64] = np.zeros(0, dtype=np.int64)
"""A chunk context's batch arrays for a batch-blind sizer, which reads no batch."""
_NO_BATCH.flags.writeable = False
_NO_SLOTS = np.zeros(0, dtype=np.int32)
_NO_SLOTS.flags.writeable = False


class Victims(NamedTuple):
    """What preempting by :class:`~phasesched.policies.preemption.LatestArrival` reads."""

    decode_growth: NDArray[np.int64]
    """Pages each decode takes this step, in :attr:`RunningState.decodes`' order."""
    ranked: Int32Array
    """Every running slot, best victim first (``LatestArrival.rank``): the k-th victim is the k-th here."""
    freed_by: Callable[[Int32Array], int]
    """Pages that preempting these slots would return to the pool (shared pages counted once)."""


class RunningState(NamedTuple):
    """The running requests as :func:`decode_first_selection` reads them, in running order."""

    decodes: Int32Array
    """Slots decoding one token."""
    decode_pages: int
    """Pages the decodes take this step, together."""
    prefills: list[tuple[int, Request, int, int, int]]
    """Each slot with prefill work left, with its request, computed and known tokens, and pages held."""
    victims: Victims | None = None
    """How to preempt when the decodes' pages do not fit (``None``: the policy is asked then)."""


class StepRoom(NamedTuple):
    """What the step can still hold, and the constants of decode-first's rules."""

    tokens: int
    """Tokens the budget leaves."""
    seats: int
    """Sequence seats free (the cap less the running requests)."""
    pages: int
    """Free KV pages."""
    watermark_pages: int
    """Pages admissions must leave free."""
    page_size: int
    """Tokens per page."""
    max_declined: int
    """:class:`~phasesched.policies.priority.DecodeFirst`'s bound on candidates the chunk sizer declines."""

    def less(self, *, tokens: int, pages: int) -> StepRoom:
        """The room once part of the step is in: ``tokens`` and ``pages`` left (``_replace``, in one call)."""
        return StepRoom(tokens, self.seats, pages, self.watermark_pages, self.page_size, self.max_declined)


def decode_first_selection(
    running: RunningState, candidates: Iterable[WaitingCandidate], chunker: ChunkSizer, room: StepRoom
) -> Selection | None:
    """Decode-first's selection for the step, or ``None`` when the policy must be asked.

    That is when the decodes exceed the token budget, when their pages bind and ``running``
    has no :class:`Victims`, or when an ongoing prefill's chunk would preempt.

    Args:
        running: The running requests.
        candidates: The waiting requests in queue order, lazily (as the policy's view gives them).
        chunker: The policy's chunk sizer (batch-blind).
        room: The whole step's room: the token budget, the free pages.
    """
    decodes, prefills = running.decodes, running.prefills
    preempted: tuple[int, ...] = ()
    tokens, pages = room.tokens - len(decodes), room.pages - running.decode_pages
    if tokens < 0:
        return None  # the decodes do not all fit the budget: the builder takes some
    if pages < 0:  # nor the free pages: the builder takes them in order, preempting for them
        if running.victims is None:
            return None
        decodes, preempted, tokens, pages = _decodes_preempting(decodes, running.victims, room.tokens, room.pages)
        prefills = [prefill for prefill in prefills if prefill[0] not in preempted]
        candidates = ()  # once running requests were preempted for KV, the builder admits nobody
        # (so the seats the victims free, which room.seats leaves out, are never read)
    rest = _after_decodes(prefills, candidates, chunker, room.less(tokens=tokens, pages=pages))
    if rest is None:
        return None
    slots, sizes, admitted, admitted_tokens = rest
    if slots:
        decodes = np.concatenate([decodes, np.array(slots, dtype=np.int32)])
    num_new = np.ones(len(decodes), dtype=np.int32)
    num_new[len(num_new) - len(sizes) :] = sizes
    return Selection.built(decodes, num_new, admitted, admitted_tokens, preempted)


def _decodes_preempting(
    decodes: Int32Array, victims: Victims, tokens_left: int, pages_left: int
) -> tuple[Int32Array, tuple[int, ...], int, int]:
    """``BatchBuilder.add_decodes`` when the decodes' pages bind and the budget holds them all.

    Decodes are taken in order while they fit; for the first that does not, the best victim
    still running is preempted: taken out of the step if it was in it, its pages returned,
    then the rest are taken again, and so on.

    Returns:
        The decodes taken, in order; the victims, in the order preempted; and the tokens and
        pages left.
    """
    taken: list[Int32Array] = []
    growth, ranked = victims.decode_growth, victims.ranked
    slots, pages = decodes, growth
    count = freed = 0  # victims so far, and the pages they free
    while True:
        fit = int(np.searchsorted(pages.cumsum(), pages_left, side="right"))  # tokens never bind here
        taken.append(slots[:fit])
        pages_left -= int(pages[:fit].sum())
        tokens_left -= fit
        if fit == len(slots):
            break
        victim = int(ranked[count])  # it exists: the decode that did not fit is running, not yet preempted
        count += 1
        if any(np.count_nonzero(part == victim) for part in taken):  # already in the step:
            tokens_left += 1  # it gives its token and its pages back
            pages_left += int(growth[decodes == victim][0])
            taken = [part[part != victim] for part in taken]
        before, freed = freed, victims.freed_by(ranked[:count])
        pages_left += freed - before  # pages shared with earlier victims free only now
        keep = slots[fit:] != victim
        slots, pages = slots[fit:][keep], pages[fit:][keep]
    return np.concatenate(taken), tuple(ranked[:count].tolist()), tokens_left, pages_left


def selection_after_decodes(
    prefills: list[tuple[int, Request, int, int, int]],
    candidates: Iterable[WaitingCandidate],
    chunker: ChunkSizer,
    room: StepRoom,
) -> Selection | None:
    """What decode-first adds once every decode is in: ongoing chunks, then admissions (``None``: it would preempt).

    The mixed-step fast path keeps the decodes from step to step and asks only this.
    ``prefills`` are :attr:`RunningState.prefills`; ``room`` is what the decodes leave.
    """
    rest = _after_decodes(prefills, candidates, chunker, room)
    if rest is None:
        return None
    slots, sizes, admitted, admitted_tokens = rest
    return Selection.built(
        np.array(slots, dtype=np.int32) if slots else _NO_SLOTS,
        np.array(sizes, dtype=np.int32) if sizes else _NO_SLOTS,
        admitted,
        admitted_tokens,
    )


def _after_decodes(
    prefills: list[tuple[int, Request, int, int, int]],
    candidates: Iterable[WaitingCandidate],
    chunker: ChunkSizer,
    room: StepRoom,
) -> tuple[list[int], list[int], tuple[str, ...], tuple[int, ...]] | None:
    """:func:`selection_after_decodes` as plain lists: the chunks' slots and sizes, the admissions."""
    page_size, tokens_left, pages_left = room.page_size, room.tokens, room.pages
    # Unfinished prefills (by slot, or id once admitted): tokens left before the step, and the
    # pages they still need, which admissions must leave them (the builder's _partial, _reserve).
    partial: dict[int | str, int] = {}
    reserve: dict[int, int] = {}
    for slot, _, computed, known, held in prefills:
        partial[slot] = known - computed
        reserve[slot] = -(-known // page_size) - held
    slots: list[int] = []
    sizes: list[int] = []
    for slot, request, computed, known, held in prefills:
        others = tuple(n for key, n in partial.items() if key != slot)
        context = ChunkContext(tokens_left, others, _NO_BATCH, _NO_BATCH)
        size = checked_chunk(chunker, PrefillCandidate(request, computed, known, ongoing=True), context)
        if size == 0:
            if tokens_left == 0:
                break
            continue
        pages = max(-(-(computed + size) // page_size) - held, 0)
        if pages > pages_left:
            return None  # the builder preempts for it, or gives it nothing
        slots.append(slot)
        sizes.append(size)
        tokens_left -= size
        pages_left -= pages
        reserve[slot] -= pages
        if size >= partial[slot]:
            del partial[slot], reserve[slot]
    # Admissions may use the free pages beyond the watermark and what ongoing prefills still need.
    after = room.less(tokens=tokens_left, pages=pages_left - room.watermark_pages - sum(reserve.values()))
    admitted, admitted_tokens = _admissions(candidates, chunker, partial, after)
    return slots, sizes, admitted, admitted_tokens


def _admissions(
    candidates: Iterable[WaitingCandidate], chunker: ChunkSizer, partial: dict[int | str, int], room: StepRoom
) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The admissions, in queue order, as ``BatchBuilder.admit`` makes them when nobody may be preempted.

    ``room.pages`` is the free pages admissions may use (beyond the watermark and what
    unfinished prefills still need); admissions stop at the first candidate short of a seat, a
    token or room for its whole prefill.
    """
    tokens_left, seats, pages_left, page_size = room.tokens, room.seats, room.pages, room.page_size
    admitted: list[str] = []
    admitted_tokens: list[int] = []
    declined = 0
    for candidate in candidates:
        if tokens_left <= 0:
            break
        first = PrefillCandidate(candidate.request, candidate.num_computed, candidate.num_tokens, ongoing=False)
        context = ChunkContext(tokens_left, tuple(partial.values()), _NO_BATCH, _NO_BATCH)
        size = checked_chunk(chunker, first, context)
        if size == 0:
            declined += 1
            if declined > room.max_declined:
                break
            continue
        whole = -(-candidate.num_tokens // page_size)
        if seats < 1 or whole > pages_left:
            break
        pages = -(-(candidate.num_computed + size) // page_size)
        admitted.append(candidate.request_id)
        admitted_tokens.append(size)
        tokens_left -= size
        seats -= 1
        pages_left -= pages
        if size < candidate.remaining:
            partial[candidate.request_id] = candidate.remaining
            pages_left -= whole - pages  # reserved for its later chunks
    return tuple(admitted), tuple(admitted_tokens)
