"""Requests as immutable values, and the words that describe where one stands.

A request is "tokens computed catching up with tokens known": the scheduler tracks how many of a
request's known tokens (prompt plus generated) already sit in the KV cache, and each step runs the
next slice. A prefill chunk is just a longer slice. The *phase* of a slice is derived from where
it lies, never stored as a mode, so metrics can attribute time to prefill or decode exactly.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence

import attrs

from phasesched.errors import InvalidRequestError

__all__ = [
    "SLO",
    "FinishReason",
    "Phase",
    "Request",
    "RequestStatus",
    "SamplingParams",
    "phase_of",
]


class RequestStatus(enum.Enum):
    """Where a request stands in the scheduler's life cycle.

    ``WAITING -> RUNNING -> (PREEMPTED -> RUNNING)* -> FINISHED | ABORTED``. ``REJECTED``
    is the status of a request refused at the door; it never enters the scheduler.
    """

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"
    ABORTED = "aborted"
    REJECTED = "rejected"


class FinishReason(enum.Enum):
    """Why a request stopped generating."""

    LENGTH = "length"
    """It generated ``max_new_tokens``, or reached the model's context limit."""
    STOP = "stop"
    """It sampled its EOS or one of its stop tokens."""
    EXECUTOR = "executor"
    """The executor declared it finished (a simulator that knows the output length)."""
    ABORTED = "aborted"
    """The engine aborted it."""


class Phase(enum.IntEnum):
    """The phase of one scheduled slice of a request, derived from its token range."""

    PREFILL = 0
    DECODE = 1


def phase_of(start: int, num_new: int, prompt_len: int) -> Phase:
    """The phase of a slice that computes tokens ``[start, start + num_new)``.

    A slice is a decode when it feeds exactly one token that the model itself generated;
    everything else (prompt chunks, recomputation after preemption) is prefill work.
    """
    return Phase.DECODE if num_new == 1 and start >= prompt_len else Phase.PREFILL


def _positive(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value <= 0:
        msg = f"{attribute.name} must be positive, got {value}"
        raise InvalidRequestError(msg)


def _non_negative_or_none(_: object, attribute: attrs.Attribute[float | None], value: float | None) -> None:
    if value is not None and not (value >= 0 and math.isfinite(value)):
        msg = f"{attribute.name} must be a finite non-negative number, got {value}"
        raise InvalidRequestError(msg)


def _non_negative(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    _non_negative_or_none(_, attribute, value)  # type: ignore[arg-type]  # Attribute is invariant


@attrs.frozen
class SLO:
    """Per-request latency objectives (DistServe's goodput definition uses both).

    Attributes:
        ttft_s: Time-to-first-token target in seconds.
        tpot_s: Mean time-per-output-token target in seconds.

    """

    ttft_s: float | None = attrs.field(default=None, validator=_non_negative_or_none)
    tpot_s: float | None = attrs.field(default=None, validator=_non_negative_or_none)


@attrs.frozen
class SamplingParams:
    """How an executor picks each token. ``temperature == 0`` means greedy.

    A seed makes sampling reproducible per request and position, so a request preempted and
    recomputed still draws the same tokens.
    """

    temperature: float = attrs.field(default=0.0, validator=_non_negative)
    top_k: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    top_p: float = attrs.field(default=1.0, validator=[attrs.validators.gt(0.0), attrs.validators.le(1.0)])
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        """Whether the executor should take the arg-max token."""
        return self.temperature == 0.0


def _token_tuple(value: Sequence[int] | None) -> tuple[int, ...] | None:
    return None if value is None else tuple(map(int, value))


@attrs.frozen
class Request:
    """One generation request, as submitted. Immutable; the scheduler keeps progress apart.

    Give either ``prompt_token_ids`` (real executors) or only ``prompt_len`` (simulation).

    Attributes:
        request_id: Unique id within a scheduler.
        prompt_len: Prompt tokens; derived from ``prompt_token_ids`` when those are given.
        max_new_tokens: Tokens to generate at most.
        prompt_token_ids: The prompt, or ``None`` for a length-only request.
        eos_token_id: Generation stops after this token unless ``ignore_eos``.
        stop_token_ids: Further tokens that stop generation.
        ignore_eos: Keep generating past EOS (benchmarks that fix output lengths).
        arrival_time: When the request arrived, in the engine's clock (seconds).
        priority: Lower values are served first by priority queue orders (vLLM's convention).
        slo: Optional latency objectives, used by SLO-aware policies and goodput.
        sampling: How tokens are drawn.

    >>> Request("a", prompt_len=4, max_new_tokens=2).prompt_len
    4
    >>> Request("b", prompt_token_ids=[1, 2, 3], max_new_tokens=1).prompt_len
    3

    """

    request_id: str = attrs.field(validator=attrs.validators.instance_of(str))
    prompt_len: int = attrs.field(default=-1)
    max_new_tokens: int = attrs.field(default=16, validator=_positive)
    prompt_token_ids: tuple[int, ...] | None = attrs.field(default=None, converter=_token_tuple)
    eos_token_id: int | None = None
    stop_token_ids: frozenset[int] = attrs.field(default=frozenset(), converter=frozenset)
    ignore_eos: bool = False
    arrival_time: float = attrs.field(default=0.0, validator=_non_negative)
    priority: int = 0
    slo: SLO | None = None
    sampling: SamplingParams = attrs.field(factory=SamplingParams)

    def __attrs_post_init__(self) -> None:
        ids = self.prompt_token_ids
        if ids is not None:
            if self.prompt_len not in (-1, len(ids)):
                msg = f"prompt_len={self.prompt_len} disagrees with {len(ids)} prompt_token_ids"
                raise InvalidRequestError(msg)
            if any(t < 0 for t in ids):
                msg = "prompt_token_ids must be non-negative"
                raise InvalidRequestError(msg)
            object.__setattr__(self, "prompt_len", len(ids))
        if self.prompt_len <= 0:
            msg = f"request {self.request_id!r} needs a positive prompt length, got {self.prompt_len}"
            raise InvalidRequestError(msg)

    @property
    def has_token_ids(self) -> bool:
        """Whether the prompt's token ids are known (real execution), not just its length."""
        return self.prompt_token_ids is not None

    @property
    def max_total_tokens(self) -> int:
        """Prompt plus the most tokens it may generate — the KV it can ever need."""
        return self.prompt_len + self.max_new_tokens
