"""Per-step caps: how many tokens and sequences one step may carry."""

from __future__ import annotations

import attrs

from phasesched.validators import INT32_MAX, whole

__all__ = ["TokenBudget"]


@attrs.frozen
class TokenBudget:
    """The step's caps, with vLLM's knob names.

    Attributes:
        max_num_batched_tokens: Query tokens (prefill plus decode) in one step.
        max_num_seqs: Requests in one step's batch, which is also the cap on requests holding
            KV (running): decode-first schedules every running request each step.

    >>> TokenBudget(max_num_batched_tokens=512, max_num_seqs=64)
    TokenBudget(max_num_batched_tokens=512, max_num_seqs=64)

    """

    max_num_batched_tokens: int = attrs.field(default=8192, validator=whole(gt=0, le=INT32_MAX))
    max_num_seqs: int = attrs.field(default=256, validator=whole(gt=0, le=INT32_MAX))
