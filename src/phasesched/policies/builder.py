"""The batch builder: a scratch accumulator that phase-priority policies fill in their order.

It tracks what the step has left (tokens, sequence room, KV pages), answers each addition with
an :class:`AddResult`, asks the chunk sizer how long a prefill slice should be, and preempts by
the preemption policy when running requests run out of pages. It changes nothing in the
scheduler: :meth:`BatchBuilder.build` returns a :class:`~phasesched.selection.Selection`, which
the scheduler checks before committing.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

from phasesched.errors import InvalidPlanError
from phasesched.policies.chunking import ChunkContext, PrefillCandidate
from phasesched.selection import Selection
from phasesched.state import SchedulerView, WaitingCandidate

if TYPE_CHECKING:
    from phasesched.policies.chunking import ChunkSizer
    from phasesched.policies.preemption import PreemptionPolicy

__all__ = ["AddResult", "BatchBuilder"]

Int32Array = NDArray[np.int32]
Int64Array = NDArray[np.int64]


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


class BatchBuilder:
    """Accumulates one step's selection. See the module docstring.

    Args:
        view: The scheduler's state for this step.
        chunker: Sizes prefill slices.
        preemption: Chooses victims and says whether waiting requests may preempt.

    """

    def __init__(self, view: SchedulerView, chunker: ChunkSizer, preemption: PreemptionPolicy) -> None:
        self.view = view
        self.chunker = chunker
        self.preemption = preemption
        self.tokens_left = view.budget.max_num_batched_tokens
        self.seq_room = view.budget.max_num_seqs - len(view.running)
        self.pages_left = view.free_pages
        self._taken = np.zeros(len(view.num_computed), dtype=bool)  # scheduled or preempted
        self._slots: list[Int32Array] = []
        self._tokens: list[Int64Array] = []
        self._preempted: list[int] = []
        self._admitted: list[tuple[WaitingCandidate, int]] = []
        running = view.running
        remaining = view.num_tokens[running] - view.num_computed[running]
        in_prefill = remaining > 1
        # Unfinished prefills after this step, by slot (running) or id (admitted): remaining tokens.
        self._partial: dict[int | str, int] = dict(
            zip(running[in_prefill].tolist(), remaining[in_prefill].tolist(), strict=True)
        )

    # ---------------------------------------------------------------- candidates
    def running_decodes(self) -> Int32Array:
        """Running requests not yet in the step with exactly one token to compute, in admission order."""
        running = self._untaken_running()
        return running[self.view.num_tokens[running] - self.view.num_computed[running] == 1]

    def running_prefills(self) -> Int32Array:
        """Running requests not yet in the step with a prefill under way, in admission order."""
        running = self._untaken_running()
        return running[self.view.num_tokens[running] - self.view.num_computed[running] > 1]

    @property
    def has_prefill(self) -> bool:
        """Whether the step carries any prefill slice so far."""
        if self._admitted:
            return True
        computed, prompt = self.view.num_computed, self.view.prompt_len
        return any(bool(np.any((t > 1) | (computed[s] < prompt[s]))) for s, t in zip(self._slots, self._tokens, strict=True))

    @property
    def num_scheduled(self) -> int:
        """Requests in the step so far."""
        return sum(len(s) for s in self._slots) + len(self._admitted)

    # ---------------------------------------------------------------- additions
    def add_decodes(self) -> int:
        """Add every decode-ready running request that fits, in admission order; return how many."""
        slots = self.running_decodes()
        return self.add_running(slots, np.ones(len(slots), dtype=np.int64))

    def add_running(self, slots: Int32Array, num_new: NDArray[np.integer]) -> int:
        """Add running requests in order while the budget allows; preempt when pages bind.

        Returns:
            How many of ``slots`` were added (a prefix, less any preempted on the way).

        """
        slots, num_new = np.asarray(slots, dtype=np.int32), np.asarray(num_new, dtype=np.int64)
        added = 0
        while len(slots):
            pages = self.view.pages_to_grow(slots, num_new)
            fit_tokens = int(np.searchsorted(np.cumsum(num_new), self.tokens_left, side="right"))
            fit_pages = int(np.searchsorted(np.cumsum(pages), self.pages_left, side="right"))
            k = min(fit_tokens, fit_pages)
            self._take(slots[:k], num_new[:k], int(pages[:k].sum()))
            added += k
            if k == len(slots) or fit_tokens <= fit_pages:
                break
            victim = self._victim(self._untaken_running())
            if victim is None:
                break
            self.preempt(victim)
            keep = slots[k:] != victim
            slots, num_new = slots[k:][keep], num_new[k:][keep]
        return added

    def add_prefill_chunk(self, slot: int) -> AddResult:
        """Add the next chunk of a running request's prefill, sized by the chunk sizer."""
        view = self.view
        candidate = PrefillCandidate(view.request(slot), int(view.num_computed[slot]),
                                     int(view.num_tokens[slot]), ongoing=True)
        size = self._chunk(candidate, exclude=slot)
        if size == 0:
            return AddResult.NO_TOKENS if self.tokens_left == 0 else AddResult.DECLINED
        added = self.add_running(np.array([slot], np.int32), np.array([size], np.int64))
        return AddResult.ADDED if added else AddResult.NO_PAGES

    def admit(self, candidate: WaitingCandidate, num_new: int | None = None) -> AddResult:
        """Admit a waiting request with its first slice (sized by the chunk sizer unless given)."""
        if self.tokens_left <= 0:
            return AddResult.NO_TOKENS
        if self.seq_room <= 0 and not self._preempt_for(candidate):
            return AddResult.NO_SEQS
        prefill = PrefillCandidate(candidate.request, 0, candidate.num_tokens, ongoing=False)
        size = self._chunk(prefill, exclude=candidate.request_id) if num_new is None else num_new
        if size == 0:
            return AddResult.DECLINED
        if not 0 < size <= min(candidate.num_tokens, self.tokens_left):
            msg = f"cannot admit {candidate.request_id!r} with {size} tokens"
            raise InvalidPlanError(msg)
        pages = self.view.pages_for(size)
        while pages > self.pages_left - self.view.watermark_pages:
            if not self._preempt_for(candidate):
                return AddResult.NO_PAGES
        self._admitted.append((candidate, size))
        self.tokens_left -= size
        self.seq_room -= 1
        self.pages_left -= pages
        if size < candidate.num_tokens:
            self._partial[candidate.request_id] = candidate.num_tokens
        return AddResult.ADDED

    def preempt(self, slot: int) -> None:
        """Evict a running request not yet in the step, returning its pages and sequence room."""
        if self._taken[slot] or not np.any(self.view.running == slot):
            msg = f"slot {slot} is not a running request outside the step"
            raise InvalidPlanError(msg)
        self._taken[slot] = True
        self._preempted.append(slot)
        self.pages_left += self.view.freed_by_preempting(np.array([slot], np.int32))
        self.seq_room += 1
        self._partial.pop(slot, None)

    def make_room_for_waiting(self) -> int:
        """Preempt running requests that the best waiting ones outrank, before anything is scheduled.

        Looks at waiting requests in queue order, as many as this step's token budget could
        admit, and preempts victims they outrank (by the victim order) until they would fit the
        sequence cap and KV memory. Does nothing unless the preemption policy allows waiting
        requests to preempt. Returns the number of preemptions.
        """
        if not self.preemption.preempt_for_waiting:
            return 0
        count = tokens = seats = pages = 0
        for candidate in self.view.waiting():
            if tokens >= self.tokens_left:
                break
            first = min(candidate.num_tokens, self.tokens_left - tokens)
            tokens, seats, pages = tokens + first, seats + 1, pages + self.view.pages_for(first)
            while self.seq_room < seats or self.pages_left - self.view.watermark_pages < pages:
                if not self._preempt_for(candidate):
                    return count
                count += 1
        return count

    def build(self) -> Selection:
        """The selection accumulated so far."""
        slots = np.concatenate(self._slots) if self._slots else np.empty(0, np.int32)
        tokens = np.concatenate(self._tokens) if self._tokens else np.empty(0, np.int64)
        return Selection(
            running_slots=slots,
            running_tokens=tokens,
            admitted=tuple(c.request_id for c, _ in self._admitted),
            admitted_tokens=tuple(n for _, n in self._admitted),
            preempted=tuple(self._preempted),
        )

    # ---------------------------------------------------------------- internals
    def _take(self, slots: Int32Array, num_new: Int64Array, pages: int) -> None:
        if not len(slots):
            return
        self._slots.append(slots)
        self._tokens.append(num_new)
        self._taken[slots] = True
        self.tokens_left -= int(num_new.sum())
        self.pages_left -= pages
        if self._partial:
            for slot, n in zip(slots.tolist(), num_new.tolist(), strict=True):
                if slot in self._partial and n >= self._partial[slot]:
                    del self._partial[slot]

    def _untaken_running(self) -> Int32Array:
        running = self.view.running
        return running[~self._taken[running]]

    def _victim(self, candidates: Int32Array) -> int | None:
        if not len(candidates):
            return None
        return int(self.preemption.victims.order(self.view, candidates)[0])

    def _preempt_for(self, candidate: WaitingCandidate) -> bool:
        if not self.preemption.preempt_for_waiting:
            return False
        running = self._untaken_running()
        outranked = running[self.view.priority[running] > candidate.request.priority]
        victim = self._victim(outranked)
        if victim is None:
            return False
        self.preempt(victim)
        return True

    def _chunk(self, candidate: PrefillCandidate, exclude: int | str) -> int:
        context = ChunkContext(
            tokens_left=self.tokens_left,
            partial_prefills=tuple(n for key, n in self._partial.items() if key != exclude),
            batch_num_new=self._batch_num_new(),
            batch_kv_len=self._batch_kv_len(),
        )
        size = self.chunker.chunk(candidate, context)
        if not isinstance(size, (int, np.integer)) or not 0 <= size <= min(candidate.remaining, self.tokens_left):
            msg = (f"chunk sizer {type(self.chunker).__name__} returned {size!r} for a prefill with "
                   f"{candidate.remaining} tokens left and {self.tokens_left} in the budget")
            raise InvalidPlanError(msg)
        return int(size)

    def _batch_num_new(self) -> Int64Array:
        admitted = np.array([n for _, n in self._admitted], dtype=np.int64)
        return np.concatenate([*self._tokens, admitted])

    def _batch_kv_len(self) -> Int64Array:
        running = [self.view.num_computed[s].astype(np.int64) + t for s, t in zip(self._slots, self._tokens, strict=True)]
        admitted = np.array([n for _, n in self._admitted], dtype=np.int64)
        return np.concatenate([*running, admitted])
