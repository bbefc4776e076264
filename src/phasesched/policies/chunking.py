"""Chunk sizing: how many of a prompt's tokens to prefill in this step.

Chunked prefill's tuning variable. Small chunks keep decodes flowing beside a long prompt (short
token gaps) at the price of more steps per prompt and re-reading the prompt's KV in each chunk;
no chunking gives the best prefill throughput and the worst stalls. A sizer sees the step built
so far and answers with a token count; the batch builder checks it against the budget.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import attrs
import numpy as np
from numpy.typing import NDArray

from phasesched.costmodel.protocol import CostModel
from phasesched.request import Request
from phasesched.validators import number, whole

__all__ = [
    "BUILTIN_CHUNKERS",
    "ChunkContext",
    "ChunkSizer",
    "FixedChunk",
    "LongPrefillThreshold",
    "NoChunking",
    "PrefillCandidate",
    "SLOAdaptiveChunk",
]


@attrs.frozen
class PrefillCandidate:
    """A request that has prefill work left, as a chunk sizer sees it.

    Attributes:
        request: The request.
        num_computed: Tokens already in its cache.
        num_tokens: Tokens known; the slice may cover ``[num_computed, num_tokens)``.
        ongoing: Whether it already holds KV from earlier chunks (a partial prefill).

    """

    request: Request
    num_computed: int
    num_tokens: int
    ongoing: bool

    @property
    def remaining(self) -> int:
        """Tokens left to compute before it samples."""
        return self.num_tokens - self.num_computed


@attrs.frozen(eq=False)
class ChunkContext:
    """The step as built so far, when a sizer is asked.

    Attributes:
        tokens_left: Tokens the step budget still allows.
        partial_prefills: Remaining prefill tokens of every *other* request whose prefill is
            unfinished and will still be unfinished after this step (ongoing ones included).
        batch_num_new: int ``[B]``: tokens of the slices already in the step.
        batch_kv_len: int ``[B]``: context lengths of those slices after the step.

    """

    tokens_left: int
    partial_prefills: tuple[int, ...]
    batch_num_new: NDArray[np.int64]
    batch_kv_len: NDArray[np.int64]

    @property
    def has_prefill(self) -> bool:
        """Whether the step already carries prefill work (a slice of more than one token)."""
        return bool(np.any(self.batch_num_new > 1))


@runtime_checkable
class ChunkSizer(Protocol):
    """Chooses a prefill slice's length. Must return an int in ``[0, min(remaining, tokens_left)]``."""

    def chunk(self, candidate: PrefillCandidate, context: ChunkContext) -> int:
        """Tokens of ``candidate`` to compute now; 0 means not in this step."""
        ...


@attrs.frozen
class NoChunking:
    """Whole prompts only: a prompt runs in one step or waits (Orca, vLLM V0 without chunking)."""

    def chunk(self, candidate: PrefillCandidate, context: ChunkContext) -> int:
        """The whole remainder if it fits the budget, else 0."""
        return candidate.remaining if candidate.remaining <= context.tokens_left else 0


@attrs.frozen
class FixedChunk:
    """At most ``size`` tokens per slice (Sarathi-Serve's fixed chunk, SGLang's ``chunked_prefill_size``)."""

    size: int = attrs.field(default=512, validator=whole(gt=0))

    def chunk(self, candidate: PrefillCandidate, context: ChunkContext) -> int:
        """``min(size, remaining, tokens_left)``."""
        return max(0, min(self.size, candidate.remaining, context.tokens_left))


@attrs.frozen
class LongPrefillThreshold:
    """vLLM's long-prefill knobs, enforced.

    Slices are capped at ``long_prefill_token_threshold`` tokens (0: no cap beyond the budget).
    At most ``max_num_partial_prefills`` requests may be part-way through their prefill at once,
    and at most ``max_long_partial_prefills`` of those may be *long* (more than the threshold
    left), so short prompts can overtake a long one instead of queuing behind it. vLLM V1
    declares these knobs but its scheduler does not apply them; this sizer does.
    """

    long_prefill_token_threshold: int = attrs.field(default=0, validator=whole(ge=0))
    max_num_partial_prefills: int = attrs.field(default=1, validator=whole(gt=0))
    max_long_partial_prefills: int = attrs.field(default=1, validator=whole(gt=0))

    def chunk(self, candidate: PrefillCandidate, context: ChunkContext) -> int:
        """Cap by threshold and budget; decline a new partial prefill beyond the caps."""
        limit = self.long_prefill_token_threshold or candidate.remaining
        size = max(0, min(candidate.remaining, context.tokens_left, limit))
        stays_partial = 0 < size < candidate.remaining
        if candidate.ongoing or not stays_partial:
            return size
        if len(context.partial_prefills) >= self.max_num_partial_prefills:
            return 0
        if self._is_long(candidate.remaining):
            num_long = sum(1 for left in context.partial_prefills if self._is_long(left))
            if num_long >= self.max_long_partial_prefills:
                return 0
        return size

    def _is_long(self, remaining: int) -> bool:
        return self.long_prefill_token_threshold > 0 and remaining > self.long_prefill_token_threshold


@attrs.frozen
class SLOAdaptiveChunk:
    """Sarathi-Serve's rule: the largest chunk whose predicted step time meets a TBT target.

    The cost model predicts the step with the candidate slice added; the chunk is the largest
    multiple of ``granularity`` (or the whole remainder) that keeps it within
    ``tbt_target_s``. When no chunk fits and the step has no prefill yet, ``min_chunk``
    tokens still run, so prompts progress even when decodes alone exceed the target.
    """

    cost_model: CostModel
    tbt_target_s: float = attrs.field(validator=number(gt=0.0))
    granularity: int = attrs.field(default=16, validator=whole(gt=0))
    min_chunk: int = attrs.field(default=16, validator=whole(gt=0))

    def chunk(self, candidate: PrefillCandidate, context: ChunkContext) -> int:
        """Binary-search the largest chunk under the target (the cost model is monotone)."""
        upper = max(0, min(candidate.remaining, context.tokens_left))
        if upper == 0:
            return 0
        if self._fits(candidate, context, upper):
            return upper
        lo, hi = 0, upper // self.granularity  # in units of granularity; lo always fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._fits(candidate, context, mid * self.granularity):
                lo = mid
            else:
                hi = mid - 1
        size = lo * self.granularity
        if size == 0 and not context.has_prefill:
            size = min(self.min_chunk, upper)
        return size

    def _fits(self, candidate: PrefillCandidate, context: ChunkContext, size: int) -> bool:
        num_new = np.append(context.batch_num_new, size)
        kv_len = np.append(context.batch_kv_len, candidate.num_computed + size)
        return self.cost_model.step_time(num_new, kv_len) <= self.tbt_target_s


BUILTIN_CHUNKERS: frozenset[type] = frozenset({NoChunking, FixedChunk, LongPrefillThreshold, SLOAdaptiveChunk})
"""The chunk sizers that answer without side effects, so a step may be built without asking them
when no answer they could give changes it (the scheduler's steady path with a blocked queue).
A plugin's, or a subclass of one of these, is asked whenever a policy would ask it."""
