"""Measure any executor's step times on a grid of synthetic steps (what ``phasesched profile`` runs).

Each grid point becomes one :class:`~phasesched.plan.StepPlan`: ``decode_seqs`` decode slices
of context ``decode_context`` and, when ``prefill_tokens > 0``, one prefill slice of that many
tokens after ``prefill_prefix`` cached ones. The plans are real plans (pages from a
:class:`~phasesched.kv.PagedKVManager`, metadata from :func:`~phasesched.plan.build_step_plan`,
random token ids), so the executor runs exactly its serving code path; that the earlier pages
of a slice were never written does not matter, only the time does.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable, Iterator

import attrs
import numpy as np
from numpy.typing import NDArray

from phasesched.costmodel.profiled import ProfilePoint
from phasesched.errors import InvalidArgumentError, PhaseschedError
from phasesched.executor import Executor
from phasesched.kv import PagedKVManager
from phasesched.plan import StepPlan, build_step_plan
from phasesched.request import Request

__all__ = ["ProfileGrid", "ProfilingError", "profile_executor"]

_Shape = tuple[int, int, int, int]
Int32Array = NDArray[np.int32]


class ProfilingError(PhaseschedError, RuntimeError):
    """The executor cannot be profiled (it reports no duration, or the grid does not fit its KV)."""


def _axis(minimum: int) -> Callable[[object, attrs.Attribute[tuple[int, ...]], tuple[int, ...]], None]:
    def check(_: object, attribute: attrs.Attribute[tuple[int, ...]], value: tuple[int, ...]) -> None:
        if not value or list(value) != sorted(set(value)) or value[0] < minimum:
            msg = f"{attribute.name} must be strictly increasing values >= {minimum}, got {value}"
            raise InvalidArgumentError(msg)

    return check


def _no_one_token_prefill(_: object, attribute: attrs.Attribute[tuple[int, ...]], value: tuple[int, ...]) -> None:
    if 1 in value:
        # A one-token slice is a decode to the cost model, so it cannot stand for a prefill.
        msg = f"{attribute.name} cannot contain 1 (a one-token slice counts as a decode)"
        raise InvalidArgumentError(msg)


def _int_tuple(values: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(int(v) for v in values)


@attrs.frozen
class ProfileGrid:
    """The values each feature takes; the profile is their full product.

    The defaults suit a tiny CPU model (seconds in all); :meth:`gpu_default` suits a real one.
    Points beyond the grid are extrapolated linearly by the cost model.

    Attributes:
        prefill_tokens: Prefill query tokens per step (0: decode-only; never 1).
        prefill_prefix: Tokens cached before the prefill slice (a later chunk of a prompt).
        decode_seqs: Decode slices per step.
        decode_context: KV length of every decode slice after the step (>= 2).

    >>> ProfileGrid().num_points
    36

    """

    prefill_tokens: tuple[int, ...] = attrs.field(
        default=(0, 16, 64), converter=_int_tuple, validator=[_axis(0), _no_one_token_prefill]
    )
    prefill_prefix: tuple[int, ...] = attrs.field(default=(0, 64), converter=_int_tuple, validator=_axis(0))
    decode_seqs: tuple[int, ...] = attrs.field(default=(0, 1, 4), converter=_int_tuple, validator=_axis(0))
    decode_context: tuple[int, ...] = attrs.field(default=(16, 64), converter=_int_tuple, validator=_axis(2))

    @classmethod
    def gpu_default(cls) -> ProfileGrid:
        """A grid for an 8B-70B model on one GPU node: 315 points, 247 distinct steps.

        The largest step holds 128 decodes of 2,048 tokens and an 8,192-token chunk after 8,192
        cached tokens (about 280K tokens of KV, 37 GB for Llama-3-8B), so it fits beside the
        weights on an 80 GB GPU. Larger batches and contexts are extrapolated linearly.
        """
        return cls(
            prefill_tokens=(0, 128, 512, 1024, 2048, 4096, 8192),
            prefill_prefix=(0, 2048, 8192),
            decode_seqs=(0, 1, 8, 32, 128),
            decode_context=(128, 512, 2048),
        )

    @property
    def num_points(self) -> int:
        """Grid points (rows of the profile)."""
        return len(self.prefill_tokens) * len(self.prefill_prefix) * len(self.decode_seqs) * len(self.decode_context)

    def combinations(self) -> Iterator[_Shape]:
        """Every ``(prefill_tokens, prefill_prefix, decode_seqs, decode_context)``, in C order."""
        return itertools.product(self.prefill_tokens, self.prefill_prefix, self.decode_seqs, self.decode_context)

    def max_pages(self, page_size: int) -> int:
        """KV pages the largest step needs."""
        decode = self.decode_seqs[-1] * -(-self.decode_context[-1] // page_size)
        prefill = -(-(self.prefill_prefix[-1] + self.prefill_tokens[-1]) // page_size) if self.prefill_tokens[-1] else 0
        return decode + prefill


def _effective_shape(shape: _Shape) -> _Shape:
    """The step a grid point really runs: without a prefill its prefix is moot, likewise context."""
    tokens, prefix, seqs, context = shape
    return tokens, prefix if tokens else 0, seqs, context if seqs else 0


@attrs.frozen(eq=False)
class _Slices:
    """The slices of one synthetic step: decodes first, then the prefill (if any)."""

    requests: tuple[Request, ...]
    start: Int32Array
    num_new: Int32Array
    prompt_len: Int32Array

    @classmethod
    def of(cls, shape: _Shape, tag: str) -> _Slices:
        """The slices of grid step ``shape``, with request ids prefixed by ``tag``."""
        tokens, prefix, seqs, context = shape
        has_prefill = int(tokens > 0)
        start = np.array([context - 1] * seqs + [prefix] * has_prefill, dtype=np.int32)
        num_new = np.array([1] * seqs + [tokens] * has_prefill, dtype=np.int32)
        # Decodes feed their first generated token; the prefill slice ends its prompt.
        prompt_len = np.where(num_new == 1, start, start + num_new).astype(np.int32)
        ids = [f"{tag}-d{i}" for i in range(seqs)] + [f"{tag}-p"] * has_prefill
        requests = tuple(
            Request(rid, prompt_len=int(n), max_new_tokens=2) for rid, n in zip(ids, prompt_len, strict=True)
        )
        return cls(requests, start, num_new, prompt_len)

    @property
    def request_ids(self) -> tuple[str, ...]:
        """The slices' request ids, in batch order."""
        return tuple(r.request_id for r in self.requests)


@attrs.define
class _Session:
    """Builds and runs the synthetic plans; holds what must carry from one plan to the next."""

    executor: Executor
    kv: PagedKVManager
    rng: np.random.Generator
    vocab_size: int
    step_id: int = 0
    serial: int = 0
    released: tuple[str, ...] = ()

    def measure(self, shape: _Shape, *, repeats: int, warmup: int) -> float:
        """Median seconds of ``repeats`` runs of the step ``shape``, after ``warmup`` runs."""
        self.serial += 1
        slices = _Slices.of(shape, f"profile-{self.serial}")
        slots = np.array([self.kv.open() for _ in slices.requests], dtype=np.int32)
        try:
            self.kv.grow_many(slots, slices.start + slices.num_new)
            input_ids = self.rng.integers(0, self.vocab_size, int(slices.num_new.sum()), dtype=np.int32)
            durations = [self._run(slices, slots, input_ids, first=i == 0) for i in range(warmup + repeats)]
        finally:
            self.kv.free_many(slots)
        self.released = slices.request_ids
        return statistics.median(durations[warmup:])

    def _run(self, slices: _Slices, slots: Int32Array, input_ids: Int32Array, *, first: bool) -> float:
        """Run one plan of ``slices``; the first of a point announces its requests."""
        kv_indptr, kv_indices = self.kv.gather(slots, self.kv.page_counts[slots])
        plan = build_step_plan(
            step_id=self.step_id,
            request_ids=slices.request_ids,
            slots=slots,
            start=slices.start,
            num_new=slices.num_new,
            prompt_len=slices.prompt_len,
            samples=np.ones(len(slots), dtype=bool),
            kv_indptr=kv_indptr,
            kv_indices=kv_indices,
            page_size=self.kv.page_size,
            input_ids=input_ids,
            new_requests=slices.requests if first else (),
            released=self.released if first else (),
        )
        self.step_id += 1
        return _duration(self.executor, plan)


def _duration(executor: Executor, plan: StepPlan) -> float:
    result = executor.execute(plan)
    result.check_against(plan)
    if result.duration_s is None:
        msg = (
            f"{type(executor).__name__} returned duration_s=None: it makes no timing claim, so it "
            "cannot be profiled (time the step inside execute() and report it)"
        )
        raise ProfilingError(msg)
    return float(result.duration_s)


def profile_executor(  # noqa: PLR0913 -- every knob is a keyword with a default
    executor: Executor,
    *,
    num_pages: int,
    page_size: int,
    grid: ProfileGrid = ProfileGrid(),
    repeats: int = 5,
    warmup: int = 1,
    progress: Callable[[int, int], None] | None = None,
    vocab_size: int = 256,
    seed: int = 0,
) -> list[ProfilePoint]:
    """Time ``executor`` at every point of ``grid`` and return the profile.

    Grid points whose steps coincide (no prefill, so the prefix is moot; no decodes, so the
    context is) are measured once and share the value, which also keeps the table flat where
    the step does not change.

    Args:
        executor: Any executor whose results carry ``duration_s``.
        num_pages: KV pages the executor's cache holds (at least ``grid.max_pages(page_size)``).
        page_size: Tokens per KV page, as the executor was built.
        grid: The values of each feature.
        repeats: Timed runs per point; the median is recorded.
        warmup: Untimed runs per point before them (allocator, kernel selection, caches).
        progress: Called with ``(points done, points in all)`` after each point.
        vocab_size: Token ids are drawn below it; the values do not affect the time.
        seed: Seed of the token-id generator.

    Returns:
        One :class:`ProfilePoint` per grid point, in :meth:`ProfileGrid.combinations` order.

    Raises:
        ProfilingError: The executor reports no duration, or the grid needs more pages than
            ``num_pages``.

    """
    if repeats < 1 or warmup < 0:
        msg = f"need repeats >= 1 and warmup >= 0, got {repeats} and {warmup}"
        raise InvalidArgumentError(msg)
    if grid.max_pages(page_size) > num_pages:
        msg = f"the largest grid step needs {grid.max_pages(page_size)} KV pages, the cache has {num_pages}"
        raise ProfilingError(msg)
    session = _Session(executor, PagedKVManager(num_pages, page_size), np.random.default_rng(seed), vocab_size)
    measured: dict[_Shape, float] = {}
    points = []
    for done, shape in enumerate(grid.combinations(), start=1):
        step = _effective_shape(shape)
        if step not in measured:
            measured[step] = session.measure(step, repeats=repeats, warmup=warmup)
        points.append(ProfilePoint(shape[0], shape[1], shape[2], shape[3], measured[step]))
        if progress is not None:
            progress(done, grid.num_points)
    return points
