"""Phase priority: in what order a step serves decodes, ongoing prefills and new prompts.

This is where prefill/decode interference is decided. Decode-first (stall-free) gives every
running decode its token before any prompt work, so a long prompt cannot stall generation;
prefill-first runs waiting prompts first, which minimises time-to-first-token but pauses every
decode for the length of the prefill step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

import attrs
import numpy as np

from phasesched.policies.builder import AddResult, BatchBuilder
from phasesched.validators import whole

if TYPE_CHECKING:
    from phasesched.selection import Selection
    from phasesched.view import SchedulerView
    from phasesched.waiting import WaitingCandidate

__all__ = ["EVERY_DECODE_PRIORITIES", "DecodeFirst", "EqualProgress", "PhasePriority", "PrefillFirst"]

_STOP = (AddResult.NO_TOKENS, AddResult.NO_SEQS, AddResult.NO_PAGES)


@runtime_checkable
class PhasePriority(Protocol):
    """Fills one step. Must return a selection the scheduler will accept (it is checked)."""

    def select(self, view: SchedulerView, builder: BatchBuilder) -> Selection:
        """Choose the step's slices, usually by filling ``builder`` and returning ``builder.build()``."""
        ...


def _continue_prefills(builder: BatchBuilder) -> None:
    for slot in builder.running_prefills().tolist():
        if builder.add_prefill_chunk(slot) is AddResult.NO_TOKENS:
            return


def _admit_waiting(view: SchedulerView, builder: BatchBuilder, max_declined: int) -> None:
    """Admit in queue order until a hard limit binds; skip (a bounded number of) declined ones."""
    declined = 0
    for candidate in view.waiting():
        result = builder.admit(candidate)
        if result in _STOP:
            return
        if result is AddResult.DECLINED:
            declined += 1
            if declined > max_declined:
                return


@attrs.frozen
class DecodeFirst:
    """Stall-free batching: running decodes, then ongoing prefill chunks, then new prompts.

    This is vLLM V1's and Sarathi-Serve's order. ``max_declined`` bounds how many waiting
    requests the chunk sizer may turn down (for example beyond a partial-prefill cap) before
    the step stops looking further down the queue.
    """

    max_declined: int = attrs.field(default=8, validator=whole(ge=0))

    def select(self, view: SchedulerView, builder: BatchBuilder) -> Selection:
        """Decodes, then chunks, then admissions."""
        builder.make_room_for_waiting(reserve_decode_pages=True)
        builder.add_decodes()
        self.fill_after_decodes(view, builder)
        return builder.build()

    def fill_after_decodes(self, view: SchedulerView, builder: BatchBuilder) -> None:
        """The step's chunks and admissions, once its decodes are in (the scheduler's mixed-step fast path)."""
        _continue_prefills(builder)
        _admit_waiting(view, builder, self.max_declined)


@attrs.frozen
class PrefillFirst:
    """Prompts before decodes, as SGLang's default and vLLM V0 did.

    Ongoing and new prefills are scheduled first; when any prefill runs, decodes wait for the
    next step unless ``mix_decodes`` lets them fill what budget is left (SGLang's mixed chunk).
    """

    mix_decodes: bool = False
    max_declined: int = attrs.field(default=8, validator=whole(ge=0))

    def select(self, view: SchedulerView, builder: BatchBuilder) -> Selection:
        """Prefills, then decodes only if there were none (or mixing is on)."""
        builder.make_room_for_waiting(reserve_decode_pages=self.mix_decodes)
        _continue_prefills(builder)
        _admit_waiting(view, builder, self.max_declined)
        if self.mix_decodes or not builder.has_prefill:
            builder.add_decodes()
        return builder.build()


@attrs.frozen
class EqualProgress:
    """TensorRT-LLM's equal-progress chunking: prompts share the budget left after decodes.

    After every decode is scheduled, the remaining token budget is dealt out in rounds of
    ``unit`` tokens across ongoing prefills and up to ``max_prompts`` waiting ones, so several
    prompts advance together instead of one finishing first. The chunk sizer is not consulted.
    """

    unit: int = attrs.field(default=64, validator=whole(gt=0))
    max_prompts: int = attrs.field(default=16, validator=whole(gt=0))

    def select(self, view: SchedulerView, builder: BatchBuilder) -> Selection:
        """Decodes, then equal shares of the rest."""
        builder.make_room_for_waiting(reserve_decode_pages=True)
        builder.add_decodes()
        ongoing = builder.running_prefills()[: self.max_prompts]
        waiting = self._waiting(view, builder, self.max_prompts - len(ongoing))
        needs = [int(view.num_tokens[s] - view.num_computed[s]) for s in ongoing.tolist()]
        needs += [c.remaining for c in waiting]
        shares = self._deal(needs, builder.tokens_left)
        for slot, share in zip(ongoing.tolist(), shares, strict=False):
            if share:
                builder.add_running(np.array([slot], np.int32), np.array([share], np.int64))
        for candidate, share in zip(waiting, shares[len(ongoing) :], strict=True):
            if share and builder.admit(candidate, share) in (AddResult.NO_SEQS, AddResult.NO_TOKENS):
                break
        return builder.build()

    def _waiting(self, view: SchedulerView, builder: BatchBuilder, room: int) -> list[WaitingCandidate]:
        chosen: list[WaitingCandidate] = []
        for candidate in view.waiting():
            if len(chosen) >= min(room, builder.seq_room):
                break
            chosen.append(candidate)
        return chosen

    def _deal(self, needs: list[int], budget: int) -> list[int]:
        shares = [0] * len(needs)
        while budget > 0:
            dealt = False
            for i, need in enumerate(needs):
                give = min(self.unit, need - shares[i], budget)
                if give > 0:
                    shares[i] += give
                    budget -= give
                    dealt = True
            if not dealt:
                break
        return shares


EVERY_DECODE_PRIORITIES: frozenset[type] = frozenset({DecodeFirst, PrefillFirst, EqualProgress})
"""The phase priorities whose steps, when nothing waits and every running request decodes
within the budget and KV, schedule every running decode.

The scheduler builds such steps itself, without asking the policy (its steady-decode fast path),
only for these exact classes: their promise is held to the policy's own answer by a property
test (``tests/test_steady_fast_path.py``). Any other priority, a plugin or a subclass of one of
these, is asked every step: a promise the scheduler cannot check is not one it trusts.
"""
