"""Requests as immutable values, and the words that describe where one stands.

A request is "tokens computed catching up with tokens known": the scheduler tracks how many of a
request's known tokens (prompt plus generated) already sit in the KV cache, and each step runs the
next slice. A prefill chunk is just a longer slice. The *phase* of a slice is derived from where
it lies, never stored as a mode, so metrics can attribute time to prefill or decode exactly.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs
import numpy as np
from numpy.typing import NDArray

from phasesched.errors import InvalidRequestError
from phasesched.prefix import PromptBlocks
from phasesched.validators import INT32_MAX, INT64_MAX, number, optional, whole

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

    ``WAITING -> RUNNING -> (PREEMPTED -> RUNNING)* -> FINISHED | ABORTED | FAILED``.
    ``REJECTED`` is the status of a request refused at the door; it never enters the scheduler.
    ``FAILED`` is a request the engine gave up on (its steps kept failing on the executor).
    """

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"
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
    ERROR = "error"
    """Ended by the engine because the executor kept failing on its steps (see ``Scheduler.fail``)."""


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


def decodes_next(
    computed: NDArray[np.int32], known: NDArray[np.int32], prompt_len: NDArray[np.int32]
) -> NDArray[np.bool_]:
    """Which requests' next slices are decodes: :func:`phase_of` of all they have left, in bulk.

    The batch builder and every fast path that plans or applies steps itself ask this (or
    :func:`phase_of`, for one request): a run whose idea of a decode drifted from the builder's
    once kept a one-token recompute in prefill order.
    """
    decode: NDArray[np.bool_] = (known - computed == 1) & (computed >= prompt_len)
    return decode


_request_int = whole(error=InvalidRequestError, gt=0, le=INT32_MAX)
_non_negative = number(error=InvalidRequestError, ge=0.0)


def _instance_of(kind: type | tuple[type, ...]) -> Callable[[object, attrs.Attribute[Any], object], None]:
    names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))

    def check(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if not isinstance(value, kind):
            msg = f"{attribute.name} must be a {names}, got {value!r}"
            raise InvalidRequestError(msg)

    return check


@attrs.frozen
class SLO:
    """Per-request latency objectives (DistServe's goodput definition uses both).

    Attributes:
        ttft_s: Time-to-first-token target in seconds.
        tpot_s: Mean time-per-output-token target in seconds.

    """

    ttft_s: float | None = attrs.field(default=None, validator=optional(_non_negative))
    tpot_s: float | None = attrs.field(default=None, validator=optional(_non_negative))


@attrs.frozen
class SamplingParams:
    """How an executor picks each token. ``temperature == 0`` means greedy.

    A seed makes sampling reproducible per request and position, so a request preempted and
    recomputed still draws the same tokens.
    """

    temperature: float = attrs.field(default=0.0, validator=_non_negative)
    top_k: int = attrs.field(default=0, validator=whole(error=InvalidRequestError, ge=0))
    top_p: float = attrs.field(default=1.0, validator=number(error=InvalidRequestError, gt=0.0, le=1.0))
    seed: int | None = attrs.field(default=None, validator=optional(whole(error=InvalidRequestError, ge=0)))

    @property
    def greedy(self) -> bool:
        """Whether the executor should take the arg-max token."""
        return self.temperature == 0.0


def _token_ids(values: object, what: str) -> NDArray[np.int64]:
    """``values`` as token ids: a 1-D sequence of ints in ``[0, 2**31)`` (an int32 token id)."""
    try:
        array = np.asarray(values if isinstance(values, np.ndarray) else tuple(values))  # type: ignore[arg-type]
    except TypeError as error:  # not iterable
        msg = f"{what} must be a sequence of token ids, got {values!r}"
        raise InvalidRequestError(msg) from error
    if array.ndim != 1 or (len(array) and array.dtype.kind not in "iu"):
        msg = f"{what} must be a 1-D sequence of ints, got {array.dtype} values of shape {array.shape}"
        raise InvalidRequestError(msg)
    if len(array) and (int(array.min()) < 0 or int(array.max()) > INT32_MAX):
        msg = f"{what} must lie in [0, {INT32_MAX}] (int32 token ids), got {int(array.min())}..{int(array.max())}"
        raise InvalidRequestError(msg)
    ids: NDArray[np.int64] = array.astype(np.int64)
    return ids


def _token_tuple(value: Sequence[int] | None) -> tuple[int, ...] | None:
    return None if value is None else tuple(_token_ids(value, "prompt_token_ids").tolist())


def _token_set(value: Iterable[int]) -> frozenset[int]:
    if not value:
        return frozenset()
    return frozenset(_token_ids(value, "stop_token_ids").tolist())


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
        prompt_blocks: The prompt's content as block hashes, for a length-only request replayed
            from a trace that names its blocks (Mooncake's ``hash_ids``): prefix caching uses
            them where it would hash token ids.

    >>> Request("a", prompt_len=4, max_new_tokens=2).prompt_len
    4
    >>> Request("b", prompt_token_ids=[1, 2, 3], max_new_tokens=1).prompt_len
    3

    """

    request_id: str
    prompt_len: int = -1
    max_new_tokens: int = 16
    prompt_token_ids: tuple[int, ...] | None = attrs.field(default=None, converter=_token_tuple)
    eos_token_id: int | None = None
    stop_token_ids: frozenset[int] = attrs.field(default=frozenset(), converter=_token_set)
    ignore_eos: bool = False
    arrival_time: float = 0.0
    priority: int = 0
    slo: SLO | None = None
    sampling: SamplingParams = attrs.field(factory=SamplingParams)
    prompt_blocks: PromptBlocks | None = None

    def __attrs_post_init__(self) -> None:
        if not _plainly_valid(self):  # the common case costs one expression; the rest names the bad field
            for name, validator in _REQUEST_FIELDS.items():
                validator(self, attrs.fields_dict(Request)[name], getattr(self, name))
        ids = self.prompt_token_ids
        if ids is not None:
            if self.prompt_len not in (-1, len(ids)):
                msg = f"prompt_len={self.prompt_len} disagrees with {len(ids)} prompt_token_ids"
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
    def tokens_matter(self) -> bool:
        """Whether its sampled tokens matter (token ids, an EOS or stop tokens), so a simulator cannot make them up."""
        stops_at_eos = self.eos_token_id is not None and not self.ignore_eos
        return self.has_token_ids or bool(self.stop_token_ids) or stops_at_eos

    @property
    def max_total_tokens(self) -> int:
        """Prompt plus the most tokens it may generate — the KV it can ever need."""
        return self.prompt_len + self.max_new_tokens


_REQUEST_FIELDS: dict[str, Callable[[object, attrs.Attribute[Any], Any], None]] = {
    "request_id": _instance_of(str),
    "prompt_len": whole(error=InvalidRequestError, ge=-1, le=INT32_MAX),
    "max_new_tokens": _request_int,
    "eos_token_id": optional(whole(error=InvalidRequestError, ge=0, le=INT32_MAX)),
    "ignore_eos": _instance_of((bool, np.bool_)),
    "arrival_time": _non_negative,
    "priority": whole(error=InvalidRequestError, ge=-INT64_MAX - 1, le=INT64_MAX),
    "slo": optional(_instance_of(SLO)),
    "sampling": _instance_of(SamplingParams),
    "prompt_blocks": optional(_instance_of(PromptBlocks)),
}
"""Each checked field of :class:`Request` and its validator, run in full when the fast check fails."""


def _plainly_valid(request: Request) -> bool:
    """The fast check: every field has its plain Python type and range (no numpy scalars, no NaN)."""
    eos = request.eos_token_id
    return (
        type(request.request_id) is str
        and type(request.prompt_len) is int
        and -1 <= request.prompt_len <= INT32_MAX
        and type(request.max_new_tokens) is int
        and 0 < request.max_new_tokens <= INT32_MAX
        and (eos is None or (type(eos) is int and 0 <= eos <= INT32_MAX))
        and type(request.ignore_eos) is bool
        and type(request.arrival_time) in (float, int)
        and 0.0 <= request.arrival_time < math.inf
        and type(request.priority) is int
        and -INT64_MAX - 1 <= request.priority <= INT64_MAX
        and (request.slo is None or type(request.slo) is SLO)
        and type(request.sampling) is SamplingParams
        and (request.prompt_blocks is None or type(request.prompt_blocks) is PromptBlocks)
    )
