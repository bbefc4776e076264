"""The batch builder: a scratch accumulator that phase-priority policies fill in their order.

It tracks what the step has left (tokens, sequence room, KV pages), answers each addition with
an :class:`AddResult`, asks the chunk sizer how long a prefill slice should be, and preempts by
the preemption policy when running requests run out of pages. It changes nothing in the
scheduler: :meth:`BatchBuilder.build` returns a :class:`~phasesched.selection.Selection`, which
the scheduler checks before committing.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from phasesched.errors import InvalidPlanError
from phasesched.policies.chunking import ChunkContext, FixedChunk, LongPrefillThreshold, NoChunking, PrefillCandidate
from phasesched.request import decodes_next
from phasesched.selection import Selection
from phasesched.view import SchedulerView
from phasesched.waiting import WaitingCandidate

if TYPE_CHECKING:
    from phasesched.policies.chunking import ChunkSizer
    from phasesched.policies.preemption import PreemptionPolicy

__all__ = ["BATCH_BLIND_CHUNKERS", "AddResult", "BatchBuilder", "checked_chunk"]

Int32Array = NDArray[np.int32]
Int64Array = NDArray[np.int64]

# Built-in chunk sizers that size a slice from the budget and the partial prefills alone, never
# from the batch's slices: they are given empty arrays for those (exact types: a subclass may read them).
BATCH_BLIND_CHUNKERS: frozenset[type] = frozenset({NoChunking, FixedChunk, LongPrefillThreshold})
_NO_TOKENS: Int64Array = np.empty(0, dtype=np.int64)
_NO_TOKENS.flags.writeable = False


class AddResult(enum.Enum):
    """The answer to one addition."""

    ADDED = "added"
    NO_TOKENS = "no_tokens"
    """The token budget is spent."""
    NO_SEQS = "no_seqs"
    """The sequence cap is reached."""
    NO_PAGES = "no_pages"
    """Too few KV pages, even after the preemptions the policy allows."""
    DECLINED = "declined"
    """The chunk sizer chose not to run this request in this step."""
    UNAVAILABLE = "unavailable"
    """The request is already in the step, or was preempted while building it."""


def checked_chunk(chunker: ChunkSizer, candidate: PrefillCandidate, context: ChunkContext) -> int:
    """Ask ``chunker`` for a slice length and refuse an answer outside ``[0, min(remaining, tokens_left)]``.

    Raises:
        InvalidPlanError: The chunk sizer (a plugin, perhaps) answered out of range.

    """
    size = chunker.chunk(candidate, context)
    if not isinstance(size, (int, np.integer)) or not 0 <= size <= min(candidate.remaining, context.tokens_left):
        msg = (
            f"chunk sizer {type(chunker).__name__} returned {size!r} for a prefill with "
            f"{candidate.remaining} tokens left and {context.tokens_left} in the budget"
        )
        raise InvalidPlanError(msg)
    return int(size)


def _joined(parts: Sequence[NDArray[np.integer[Any]]], dtype: type[np.int32]) -> NDArray[np.int32]:
    if len(parts) == 1:
        return parts[0].astype(dtype, copy=False)
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.empty(0, dtype)


class BatchBuilder:
    """Accumulates one step's selection. See the module docstring.

    Args:
        view: The scheduler's state for this step.
        chunker: Sizes prefill slices.
        preemption: Chooses victims and says whether waiting requests may preempt.

    """

    def __init__(
        self,
        view: SchedulerView,
        chunker: ChunkSizer,
        preemption: PreemptionPolicy,
        *,
        is_decode: NDArray[np.bool_] | None = None,
    ) -> None:
        self.view = view
        self.chunker = chunker
        self.preemption = preemption
        self.tokens_left = view.budget.max_num_batched_tokens
        self.seq_room = view.budget.max_num_seqs - len(view.running)
        self.pages_left = view.free_pages
        self._taken = np.zeros(len(view.num_computed), dtype=bool)  # scheduled or preempted
        self._any_taken = False
        self._memory_bound = False  # running requests were preempted for KV in this step
        self._slots: list[Int32Array] = []
        self._tokens: list[Int64Array] = []
        self._preempted: list[int] = []
        self._admitted: list[tuple[WaitingCandidate, int]] = []
        self._running_batch: tuple[Int64Array, Int64Array] | None = None  # (num_new, kv_len) of _slots, cached
        running = view.running
        if is_decode is None:
            computed = view.num_computed[running]
            # A decode feeds one generated token (phase_of's rule); a prompt's last token is prefill.
            is_decode = decodes_next(computed, view.num_tokens[running], view.prompt_len[running])
        self._is_decode = is_decode  # in running order
        # Unfinished prefills after this step, by slot (running) or id (admitted): tokens left ...
        self._partial: dict[int | str, int] = {}
        # ... and the pages they still need to finish, which admissions must leave them.
        self._reserve: dict[int | str, int] = {}
        if np.count_nonzero(is_decode) < len(running):
            pending = running[~is_decode]
            remaining = view.num_tokens[pending] - view.num_computed[pending]
            outstanding = -(-view.num_tokens[pending] // view.page_size) - view.page_count[pending]
            self._partial = dict(zip(pending.tolist(), remaining.tolist(), strict=True))
            self._reserve = dict(zip(pending.tolist(), outstanding.tolist(), strict=True))

    # ---------------------------------------------------------------- candidates
    def running_decodes(self) -> Int32Array:
        """int32 ``[n]``: slots of running requests not yet in the step that decode, in admission order.

        A decode computes exactly one token that the model generated; a prompt's last token is
        a prefill (see :func:`phasesched.request.phase_of`).
        """
        decodes: Int32Array = self.view.running[self._is_decode]
        return self._untaken(decodes)

    def running_prefills(self) -> Int32Array:
        """int32 ``[n]``: slots of running requests not yet in the step with a prefill under way, in admission order."""
        prefills: Int32Array = self.view.running[~self._is_decode]
        return self._untaken(prefills)

    @property
    def has_prefill(self) -> bool:
        """Whether the step carries any prefill slice so far."""
        if self._admitted:
            return True
        computed, prompt = self.view.num_computed, self.view.prompt_len
        return any(
            bool(np.any((t > 1) | (computed[s] < prompt[s]))) for s, t in zip(self._slots, self._tokens, strict=True)
        )

    @property
    def num_scheduled(self) -> int:
        """Requests in the step so far."""
        return sum(len(s) for s in self._slots) + len(self._admitted)

    # ---------------------------------------------------------------- additions
    def add_decodes(self) -> int:
        """Add every decode-ready running request that fits, in admission order; return how many."""
        slots = self.running_decodes()
        return self.add_running(slots, np.ones(len(slots), dtype=np.int32))

    def add_running(self, slots: Int32Array, num_new: Int64Array) -> int:
        """Add running requests in order while the budget allows; preempt when pages bind.

        Slots already in the step, or preempted while building it, are skipped.

        Args:
            slots: int32 ``[K]``: slots of running requests, in the order to add them.
            num_new: int64 ``[K]``: tokens each computes this step (``>= 1``).

        Returns:
            How many of ``slots`` were added (a prefix, less any preempted on the way).

        """
        slots = np.asarray(slots, dtype=np.int32)
        num_new = np.asarray(num_new, dtype=np.int64)
        if self._any_taken:
            fresh = ~self._taken[slots]
            slots, num_new = slots[fresh], num_new[fresh]
        added = 0
        while len(slots):
            pages = self.view.pages_to_grow(slots, num_new)
            total_tokens, total_pages = int(num_new.sum()), int(pages.sum())
            if total_tokens <= self.tokens_left and total_pages <= self.pages_left:
                self._take(slots, num_new, pages, total_tokens, total_pages)  # all fit: the steady state
                return added + len(slots)
            fit_tokens = int(np.searchsorted(np.cumsum(num_new), self.tokens_left, side="right"))
            fit_pages = int(np.searchsorted(np.cumsum(pages), self.pages_left, side="right"))
            k = min(fit_tokens, fit_pages)
            self._take(slots[:k], num_new[:k], pages[:k], int(num_new[:k].sum()), int(pages[:k].sum()))
            added += k
            if k == len(slots) or fit_tokens <= fit_pages:
                break
            victim = self._victim(self._preemptible())
            if victim is None:
                break
            self._memory_bound = True
            self.preempt(victim)
            keep = slots[k:] != victim
            slots, num_new = slots[k:][keep], num_new[k:][keep]
        return added

    def take_decodes(self, slots: Int32Array, num_pages: int) -> None:
        """Add every running decode at once, as :meth:`add_decodes` does when they all fit (internal).

        The scheduler's mixed-step fast path calls this on a fresh builder with the decodes it
        keeps from step to step (``slots``: :meth:`running_decodes`, in admission order) and the
        pages their step takes (``num_pages``), having checked that the token budget and the
        free pages hold them all; the builder is then as :meth:`add_decodes` would leave it.
        """
        self._slots.append(slots)
        self._tokens.append(np.ones(len(slots), dtype=np.int64))
        self._running_batch = None
        self._taken[slots] = True
        self._any_taken = True
        self.tokens_left -= len(slots)
        self.pages_left -= num_pages

    def build_rest(self) -> Selection | None:
        """The selection of what was added after :meth:`take_decodes`; ``None`` if anyone was preempted (internal)."""
        if self._preempted or self._memory_bound:
            return None
        return Selection.built(
            _joined(self._slots[1:], np.int32),
            _joined(self._tokens[1:], np.int32),
            tuple(c.request_id for c, _ in self._admitted),
            tuple(n for _, n in self._admitted),
        )

    def add_prefill_chunk(self, slot: int) -> AddResult:
        """Add the next chunk of a running request's prefill, sized by the chunk sizer."""
        if self._taken[slot]:
            return AddResult.UNAVAILABLE
        view = self.view
        computed = int(view.num_computed[slot])
        candidate = PrefillCandidate(view.request(slot), computed, int(view.num_tokens[slot]), ongoing=True)
        size = self._chunk(candidate, exclude=slot)
        if size == 0:
            return AddResult.NO_TOKENS if self.tokens_left == 0 else AddResult.DECLINED
        pages = max(view.pages_for(computed + size) - int(view.page_count[slot]), 0)
        if size <= self.tokens_left and pages <= self.pages_left:  # add_running's "all fit", for one slot
            self._take_one(slot, size, pages)
            return AddResult.ADDED
        added = self.add_running(np.array([slot], np.int32), np.array([size], np.int64))
        return AddResult.ADDED if added else AddResult.NO_PAGES

    def admit(self, candidate: WaitingCandidate, num_new: int | None = None) -> AddResult:
        """Admit a waiting request with its first slice (sized by the chunk sizer unless given).

        Pages are allocated chunk by chunk, but admission requires room for the request's
        *whole* prefill beyond the watermark and what ongoing prefills still need (vLLM V0's
        rule). Admitting on the first chunk alone lets a prompt start that can only finish by
        preempting others, which under prefill-first can livelock. Once running requests had to
        be preempted for KV in this step, nobody is admitted (vLLM V1's rule): the pages just
        freed would go to a newcomer the next step might have to preempt in turn.
        """
        if self._memory_bound:
            return AddResult.NO_PAGES
        if self.tokens_left <= 0:
            return AddResult.NO_TOKENS
        size = self._first_chunk(candidate) if num_new is None else num_new
        if size == 0:  # asked before anyone is preempted for it
            return AddResult.DECLINED
        if not 0 < size <= min(candidate.remaining, self.tokens_left):
            msg = f"cannot admit {candidate.request_id!r} with {size} tokens"
            raise InvalidPlanError(msg)
        whole = self._admission_pages(candidate)
        if not self._make_room(candidate, seats=1, pages=whole):
            return AddResult.NO_SEQS if self.seq_room <= 0 else AddResult.NO_PAGES
        pages = self.view.pages_for(candidate.num_computed + size)
        self._admitted.append((candidate, size))
        self.tokens_left -= size
        self.seq_room -= 1
        self.pages_left -= pages
        if size < candidate.remaining:
            self._partial[candidate.request_id] = candidate.remaining
            self._reserve[candidate.request_id] = whole - pages
        return AddResult.ADDED

    def preempt(self, slot: int) -> None:
        """Evict a running request, returning its pages and sequence room.

        A request already added to the step is taken out of it first and its tokens refunded,
        as vLLM does when its victim was scheduled earlier in the same step.
        """
        if slot in self._preempted or not np.any(self.view.running == slot):
            msg = f"slot {slot} is not a running request that can be preempted"
            raise InvalidPlanError(msg)
        if self._taken[slot]:
            self._unschedule(slot)
        self._taken[slot] = True
        self._any_taken = True
        self.pages_left += self._newly_freed([slot])  # pages shared with earlier victims free only now
        self._preempted.append(slot)
        self.seq_room += 1
        self._partial.pop(slot, None)
        self._reserve.pop(slot, None)

    def make_room_for_waiting(self, *, reserve_decode_pages: bool = False) -> int:
        """Preempt running requests that the best waiting ones outrank, before anything is scheduled.

        Looks at waiting requests in queue order, as many as this step's token budget could
        admit, skips those the chunk sizer would not start now, and preempts victims the others
        outrank (by the victim order) until they would pass :meth:`admit`'s seat and page rules.
        ``reserve_decode_pages`` counts the pages the running decodes will take this step as
        spoken for, as they are when a priority schedules decodes before admissions. Does
        nothing unless the preemption policy allows waiting requests to preempt. Returns the
        number of preemptions.
        """
        if not self.preemption.preempt_for_waiting:
            return 0
        pending: dict[int, int] = {}
        if reserve_decode_pages:
            decodes = self.running_decodes()
            growth = self.view.pages_to_grow(decodes, np.ones(len(decodes), np.int64))
            pending = {slot: n for slot, n in zip(decodes.tolist(), growth.tolist(), strict=True) if n}
        before = len(self._preempted)
        tokens = seats = pages = 0
        for candidate in self.view.waiting():
            if tokens >= self.tokens_left:
                break
            first = self._first_chunk(candidate)
            if first == 0:
                continue
            tokens, seats, pages = tokens + first, seats + 1, pages + self._admission_pages(candidate)
            if not self._make_room(candidate, seats=seats, pages=pages, pending=pending):
                break
        return len(self._preempted) - before

    def build(self) -> Selection:
        """The selection accumulated so far."""
        slots = _joined(self._slots, np.int32)
        tokens = _joined(self._tokens, np.int32)
        return Selection.built(
            slots,
            tokens,
            tuple(c.request_id for c, _ in self._admitted),
            tuple(n for _, n in self._admitted),
            tuple(self._preempted),
        )

    # ---------------------------------------------------------------- internals
    def _take(self, slots: Int32Array, num_new: Int64Array, pages: Int64Array, tokens: int, total_pages: int) -> None:
        if not len(slots):
            return
        self._slots.append(slots)
        self._tokens.append(num_new)
        self._running_batch = None
        self._taken[slots] = True
        self._any_taken = True
        self.tokens_left -= tokens
        self.pages_left -= total_pages
        partial = [key for key in self._partial if isinstance(key, int)]  # few: ongoing prefills, by slot
        for slot in partial:
            hit = (slots == slot).nonzero()[0]
            if len(hit):
                self._reserve[slot] -= int(pages[hit[0]])
                if int(num_new[hit[0]]) >= self._partial[slot]:
                    del self._partial[slot], self._reserve[slot]

    def _take_one(self, slot: int, num_new: int, pages: int) -> None:
        """:meth:`_take` for one slot, without arrays."""
        self._slots.append(np.array([slot], dtype=np.int32))
        self._tokens.append(np.array([num_new], dtype=np.int64))
        self._running_batch = None
        self._taken[slot] = True
        self._any_taken = True
        self.tokens_left -= num_new
        self.pages_left -= pages
        if slot in self._partial:
            self._reserve[slot] -= pages
            if num_new >= self._partial[slot]:
                del self._partial[slot], self._reserve[slot]

    def _unschedule(self, slot: int) -> None:
        for i, (slots, tokens) in enumerate(zip(self._slots, self._tokens, strict=True)):
            hit = (slots == slot).nonzero()[0]
            if len(hit):
                num_new = tokens[hit[:1]]
                self.tokens_left += int(num_new[0])
                self.pages_left += int(self.view.pages_to_grow(slots[hit[:1]], num_new)[0])
                self._slots[i], self._tokens[i] = np.delete(slots, hit[0]), np.delete(tokens, hit[0])
                self._running_batch = None
                return

    def _preemptible(self) -> Int32Array:
        running = self.view.running
        if not self._preempted:
            return running
        alive: Int32Array = running[~np.isin(running, self._preempted)]
        return alive

    def _untaken(self, slots: Int32Array) -> Int32Array:
        if not self._any_taken:
            return slots
        untaken: Int32Array = slots[~self._taken[slots]]
        return untaken

    def _victim(self, candidates: Int32Array) -> int | None:
        if not len(candidates):
            return None
        return int(self.preemption.victims.order(self.view, candidates)[0])

    def _first_chunk(self, candidate: WaitingCandidate) -> int:
        prefill = PrefillCandidate(candidate.request, candidate.num_computed, candidate.num_tokens, ongoing=False)
        return self._chunk(prefill, exclude=candidate.request_id)

    def _admission_pages(self, candidate: WaitingCandidate) -> int:
        """Pages an admission must find free: the whole prefill's (precomputed tokens included)."""
        return self.view.pages_for(candidate.num_tokens)

    def _admission_headroom(self) -> int:
        """Free pages an admission may use: beyond the watermark and what ongoing prefills still need."""
        return self.pages_left - self.view.watermark_pages - sum(self._reserve.values())

    def _make_room(
        self, candidate: WaitingCandidate, *, seats: int, pages: int, pending: dict[int, int] | None = None
    ) -> bool:
        """Free ``seats`` sequence seats and ``pages`` admission pages, preempting requests ``candidate`` outranks.

        The victims are chosen first and preempted only if together they make enough room:
        evicting someone for an admission that still cannot happen would only waste its work.
        ``pending`` maps running slots to pages they will still take this step (decodes to be
        scheduled); a victim gives its share back, and preempted victims leave the map.
        """
        pending = {} if pending is None else pending
        seat_gap = seats - self.seq_room
        page_gap = pages + sum(pending.values()) - self._admission_headroom()
        if seat_gap <= 0 and page_gap <= 0:
            return True
        if not self.preemption.preempt_for_waiting:
            return False

        def short(chosen: list[int]) -> bool:
            freed = self._room_freed(chosen) + sum(pending.get(slot, 0) for slot in chosen)
            return seat_gap > len(chosen) or page_gap > freed

        running = self._preemptible()
        outranked = running[self.view.priority[running] > candidate.request.priority]
        order = self.preemption.victims.order(self.view, outranked) if len(outranked) else outranked
        chosen: list[int] = []
        for victim in order.tolist():
            if not short(chosen):
                break
            chosen.append(int(victim))
        if short(chosen):
            return False
        for victim in chosen:
            self.preempt(victim)
            pending.pop(victim, None)
        return seats <= self.seq_room and pages + sum(pending.values()) <= self._admission_headroom()

    def _newly_freed(self, slots: list[int]) -> int:
        """KV pages preempting ``slots`` would free beyond what this step's victims already freed."""
        if not self._preempted:
            return self.view.freed_by_preempting(np.array(slots, np.int32))
        done = np.array(self._preempted, np.int32)
        both = np.concatenate([done, np.array(slots, np.int32)])
        return self.view.freed_by_preempting(both) - self.view.freed_by_preempting(done)

    def _room_freed(self, slots: list[int]) -> int:
        """Admission pages that preempting ``slots`` would free: their pages, this step's growth and reserves."""
        if not slots:
            return 0
        array = np.array(slots, np.int32)
        freed = self._newly_freed(slots) + sum(self._reserve.get(slot, 0) for slot in slots)
        for taken, tokens in zip(self._slots, self._tokens, strict=True):
            hit = np.isin(taken, array)
            if np.any(hit):
                freed += int(self.view.pages_to_grow(taken[hit], tokens[hit]).sum())
        return freed

    def _chunk(self, candidate: PrefillCandidate, exclude: int | str) -> int:
        blind = type(self.chunker) in BATCH_BLIND_CHUNKERS  # it never reads the batch: spare building it
        context = ChunkContext(
            tokens_left=self.tokens_left,
            partial_prefills=tuple(n for key, n in self._partial.items() if key != exclude),
            batch_num_new=_NO_TOKENS if blind else self._batch_num_new(),
            batch_kv_len=_NO_TOKENS if blind else self._batch_kv_len(),
        )
        return checked_chunk(self.chunker, candidate, context)

    def _batch_num_new(self) -> Int64Array:
        admitted = np.array([n for _, n in self._admitted], dtype=np.int64)
        return np.concatenate([self._running_part()[0], admitted])

    def _batch_kv_len(self) -> Int64Array:
        admitted = np.array([c.num_computed + n for c, n in self._admitted], dtype=np.int64)
        return np.concatenate([self._running_part()[1], admitted])

    def _running_part(self) -> tuple[Int64Array, Int64Array]:
        """Tokens and KV lengths of the running requests added so far, kept until the next addition."""
        if self._running_batch is None:
            computed = self.view.num_computed
            num_new = np.concatenate([np.empty(0, np.int64), *self._tokens])
            kv_len = np.concatenate(
                [
                    np.empty(0, np.int64),
                    *(computed[s].astype(np.int64) + t for s, t in zip(self._slots, self._tokens, strict=True)),
                ]
            )
            self._running_batch = (num_new, kv_len)
        return self._running_batch
