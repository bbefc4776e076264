"""The simulation fast path through chunked prefills: the steps a stall-free policy is certain to take.

While prompts are being prefilled chunk by chunk beside running decodes, nothing waits and the
KV pages suffice, a decode-first step is fixed by the scheduler's own state: every decode takes
one token, then each ongoing prefill, in admission order, takes the chunk sizer's slice of what
budget is left (``min(limit, tokens left in its prompt, tokens left in the budget)``). A
simulator asks the scheduler for those steps up to the first that completes a prefill
(:meth:`phasesched.scheduler.Scheduler.chunk_run`), prices them, and commits as many as happen
before its next event (:meth:`phasesched.scheduler.Scheduler.advance_chunks`). The result is
exactly what stepping one by one gives; a property test holds the two against each other.

A run may also begin with the step that admits a waiting request, when decode-first's step is
worked out from the state (:mod:`phasesched.known_selection`) and admits requests that start
from nothing (no transferred KV, no cached prefix) without preempting anyone: an arrival into
a steady batch then costs no step of its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs
import numpy as np
from numpy.typing import NDArray

from phasesched.policies.chunking import FixedChunk, LongPrefillThreshold
from phasesched.policies.priority import DecodeFirst
from phasesched.request import decodes_next

if TYPE_CHECKING:
    from phasesched.policies.policy import SchedulingPolicy

__all__ = ["ChunkRun", "ChunkStep", "chunk_limit", "plan_chunk_steps", "plan_steps_after"]

Int32Array = NDArray[np.int32]
BoolArray = NDArray[np.bool_]


@attrs.frozen(eq=False)
class ChunkStep:
    """One step of a :class:`ChunkRun`, as its plan would hold it.

    Attributes:
        slots: int32 ``[B]``: the slices' slots, in batch order (decodes, then prefill chunks).
        num_new: int32 ``[B]``: tokens each slice computes.
        kv_len: int32 ``[B]``: each slice's context after the step.
        samples: bool ``[B]``: which slices sample a token (decodes, and prefills it completes).
    """

    slots: Int32Array
    num_new: Int32Array
    kv_len: Int32Array
    samples: BoolArray


@attrs.frozen(eq=False)
class ChunkRun:
    """Decode-first steps with prefill chunks that the scheduler is certain to take next.

    See :meth:`phasesched.scheduler.Scheduler.chunk_run`. Only its first step may admit
    requests, and only its last may complete a prefill or finish requests.

    Attributes:
        steps: The steps, in order.
        growth: int64 ``[len(steps)]``: KV pages the run has added by the end of each step.
        num_decodes: The decodes, which lead every step's slices (the same in each).
    """

    steps: tuple[ChunkStep, ...]
    growth: NDArray[np.int64]
    num_decodes: int
    _version: int = attrs.field(repr=False)
    ignores_later_arrivals: bool = False
    """Every step spends the whole budget, so requests that arrive while the run lasts cannot
    be admitted in any of its steps (see :class:`~phasesched.decode_run.DecodeRun`)."""
    admitted: tuple[str, ...] = ()
    """Requests the first step admits, by id; their slots end its ``slots``, in this order. They
    are a plan's ``new_requests`` (a decode worker lets go of their prefill worker's copy)."""

    @property
    def max_steps(self) -> int:
        """Steps in the run."""
        return len(self.steps)


def chunk_limit(policy: SchedulingPolicy) -> int | None:
    """The longest slice ``policy`` gives an ongoing prefill; ``None`` if its steps are not known without asking it.

    Known only for exactly :class:`~phasesched.policies.priority.DecodeFirst` with exactly
    :class:`~phasesched.policies.chunking.FixedChunk` or
    :class:`~phasesched.policies.chunking.LongPrefillThreshold`: an ongoing prefill then gets
    ``min(limit, tokens left in it, budget left)`` (no partial-prefill cap applies to it), and
    ongoing prefills are served in admission order after every decode. A subclass or a plugin
    may decide otherwise, so it is asked every step.
    """
    if type(policy.priority) is not DecodeFirst:
        return None
    chunker, budget = policy.chunker, policy.budget.max_num_batched_tokens
    if type(chunker) is FixedChunk:
        return chunker.size
    if type(chunker) is LongPrefillThreshold:
        return chunker.long_prefill_token_threshold or budget
    return None


def plan_chunk_steps(  # noqa: PLR0913, PLR0917 -- the batch's state, as plain arrays
    decodes: Int32Array,
    decode_start: Int32Array,
    prefills: Int32Array,
    prefill_start: Int32Array,
    prefill_known: Int32Array,
    prefill_prompt: Int32Array,
    *,
    tokens_left: int,
    chunk_limit: int,
    page_size: int,
    free_pages: int,
    max_steps: int,
    spend_budget: bool = False,
) -> tuple[list[ChunkStep], list[int]]:
    """The decode-first steps of a batch until the first that completes a prefill (or readies a recompute to decode).

    Args:
        decodes: int32 ``[D]``: decoding slots, in admission order.
        decode_start: int32 ``[D]``: their computed tokens (each decodes one token a step).
        prefills: int32 ``[P]``: slots with a prefill under way, in admission order (``P >= 1``).
        prefill_start: int32 ``[P]``: their computed tokens.
        prefill_known: int32 ``[P]``: their known tokens (a prefill samples once it computes them all).
        prefill_prompt: int32 ``[P]``: their prompts' lengths. A preempted request recomputing
            past its prompt decodes once one token is left (the builder's test), so it moves up
            among the decodes: the run ends at the step that leaves it so.
        tokens_left: The token budget left after the decodes (``>= 1``).
        chunk_limit: The longest slice the chunk sizer gives a prefill.
        page_size: Tokens per page.
        free_pages: Free KV pages before the first step (pages held now are full to their tokens).
        max_steps: The most steps wanted (``>= 1``).
        spend_budget: Stop before a step whose chunks leave budget over (requests wait, and
            the policy would try to admit them with it).

    Returns:
        The steps (none if even the first does not fit the free pages), and the pages added
        by the end of each.
    """
    steps: list[ChunkStep] = []
    growth: list[int] = []
    computed: list[int] = prefill_start.tolist()
    known: list[int] = prefill_known.tolist()
    # The computed count at which each prefill would decode (a recompute past its prompt), or -1:
    # request.decodes_next's test, per prefill.
    turns = [k - 1 if k - 1 >= p else -1 for k, p in zip(known, prefill_prompt.tolist(), strict=True)]
    if spend_budget and _chunk_sizes(computed, known, tokens_left, chunk_limit)[1]:
        return steps, growth  # the first step leaves budget over: the policy may admit with it
    prefill_growth = 0
    # A decode starts a page in step k when its context before the step, start + k, is a
    # multiple of the page size: the decodes whose start is -k modulo the page size.
    by_offset: list[int] = np.bincount(decode_start % page_size, minlength=page_size).tolist()
    decode_growth = 0
    decode_ones = np.ones(len(decodes), dtype=np.int32)
    decode_samples = np.ones(len(decodes), dtype=bool)
    for j in range(max_steps):
        sizes, left = _chunk_sizes(computed, known, tokens_left, chunk_limit)
        if spend_budget and left:
            break
        decode_growth += by_offset[-j % page_size]
        chunked = len(sizes)  # a prefix of the prefills
        after = [c + n for c, n in zip(computed, sizes, strict=False)]
        # Pages held are full to their tokens (the scheduler's invariant between steps).
        prefill_growth += sum(-(-a // page_size) + (c // -page_size) for a, c in zip(after, computed, strict=False))
        need = decode_growth + prefill_growth
        if need > free_pages:
            break  # the policy would preempt: let it
        samples = [a == k for a, k in zip(after, known, strict=False)]
        steps.append(
            ChunkStep(
                slots=np.concatenate([decodes, prefills[:chunked]]),
                num_new=np.concatenate([decode_ones, np.array(sizes, dtype=np.int32)]),
                kv_len=np.concatenate([decode_start + (j + 1), np.array(after, dtype=np.int32)]),
                samples=np.concatenate([decode_samples, np.array(samples, dtype=bool)]),
            )
        )
        growth.append(need)
        computed[:chunked] = after
        if any(samples) or any(a == t for a, t in zip(after, turns, strict=False)):
            break
    return steps, growth


def plan_steps_after(  # noqa: PLR0913 -- the first step, and plan_chunk_steps's limits
    first: ChunkStep,
    first_growth: int,
    known: Int32Array,
    prompt_len: Int32Array,
    *,
    num_decodes: int,
    tokens_left: int,
    chunk_limit: int,
    page_size: int,
    free_pages: int,
    max_steps: int,
    spend_budget: bool,
) -> tuple[list[ChunkStep], list[int]]:
    """A step that admits requests, then the decode-first steps after it until the first that completes a prefill.

    The caller makes sure that the admitting step gave every running request its slice, so
    its slices after the decodes are every prefill after it, in admission order.

    Args:
        first: The admitting step: ``num_decodes`` decodes, then every prefill's slice.
        first_growth: KV pages ``first`` adds.
        known: int32 ``[B]``: the known tokens of ``first``'s slices.
        prompt_len: int32 ``[B]``: their prompts' lengths.
        num_decodes: The decodes leading ``first``.
        tokens_left: The token budget left after the decodes.
        chunk_limit: The longest slice the chunk sizer gives a prefill.
        page_size: Tokens per page.
        free_pages: Free KV pages before ``first``.
        max_steps: The most steps wanted, ``first`` included (``>= 1``).
        spend_budget: As for :func:`plan_chunk_steps`.

    Returns:
        ``first`` and the steps after it, and the pages added by the end of each.
    """
    steps, growth = [first], [first_growth]
    n = num_decodes
    after, known, prompt_len = first.kv_len[n:], known[n:], prompt_len[n:]
    if max_steps == 1 or np.count_nonzero(first.samples[n:] | decodes_next(after, known, prompt_len)):
        return steps, growth  # a prefill completed, or a recompute decodes next (see plan_chunk_steps)
    later, later_growth = plan_chunk_steps(
        first.slots[:n],
        first.kv_len[:n],
        first.slots[n:],
        after,
        known,
        prompt_len,
        tokens_left=tokens_left,
        chunk_limit=chunk_limit,
        page_size=page_size,
        free_pages=free_pages - first_growth,
        max_steps=max_steps - 1,
        spend_budget=spend_budget,
    )
    return steps + later, growth + [first_growth + pages for pages in later_growth]


def _chunk_sizes(computed: list[int], known: list[int], tokens_left: int, chunk_limit: int) -> tuple[list[int], int]:
    """The ongoing prefills' chunks in a step, as ``_continue_prefills`` sizes them, and the budget they leave."""
    left, sizes = tokens_left, []
    for c, k in zip(computed, known, strict=True):  # admission order, until the budget is spent
        size = min(chunk_limit, k - c, left)
        if size <= 0:
            break
        sizes.append(size)
        left -= size
    return sizes, left
