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
import math
import os
import statistics
from collections.abc import Callable, Iterator, Mapping
from typing import Protocol, runtime_checkable

import attrs
import numpy as np
from numpy.typing import NDArray

from phasesched.costmodel.batching import METADATA_KEY, RAGGED, DecodeBatching, decode_batching_of
from phasesched.costmodel.profiled import ProfiledCostModel, ProfilePoint, write_profile_csv
from phasesched.errors import InvalidArgumentError, PhaseschedError
from phasesched.executor import Executor
from phasesched.kv import PagedKVManager
from phasesched.plan import StepPlan, build_step_plan
from phasesched.request import Request

__all__ = ["DeclaresDevice", "ProfileGrid", "Profiler", "ProfilingError", "device_name_of", "profile_executor"]

_Shape = tuple[int, int, int, int]
Int32Array = NDArray[np.int32]


@runtime_checkable
class DeclaresDevice(Protocol):
    """An executor that names the device it runs on, which ``phasesched profile`` records as the hardware.

    A profile says where its times were measured, so a run priced with it on other hardware is
    refused (``--allow-profile-mismatch`` overrides); a bare ``cuda`` would match no GPU.
    """

    @property
    def device_name(self) -> str:
        """The device as it names itself (``NVIDIA H200``), or ``cpu``."""
        ...


def device_name_of(executor: object) -> str | None:
    """The device ``executor`` declares it runs on (:class:`DeclaresDevice`), or ``None``."""
    if not isinstance(executor, DeclaresDevice):
        return None
    name: object = executor.device_name  # a plugin's claim, checked at run time
    return name if isinstance(name, str) and name else None


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

    def measure(self, shape: _Shape, *, repeats: int, warmup: int) -> list[float]:
        """Seconds of each of ``repeats`` runs of the step ``shape``, after ``warmup`` untimed runs."""
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
        return durations[warmup:]

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


def _check_settle(value: object) -> None:
    if type(value) is not int or value < 0:
        msg = f"decode_settle must be an int >= 0, got {value!r}"
        raise InvalidArgumentError(msg)


def _check_runs(repeats: int, warmup: int) -> None:
    if repeats < 1 or warmup < 0:
        msg = f"need repeats >= 1 and warmup >= 0, got {repeats} and {warmup}"
        raise InvalidArgumentError(msg)


@attrs.define(eq=False)
class Profiler:
    """Times an executor on a grid, pass after pass, keeping every run (what ``phasesched profile`` runs).

    One pass times each grid point ``repeats`` times, back to back. On a shared machine an
    executor's speed drifts over seconds (other processes evicting its weights from the caches,
    a core taken away), so back-to-back repeats land in one regime and their median keeps it;
    several passes spread over a longer time (between other work, even) sample many regimes,
    and :meth:`points` keeps each point's median over all its runs. :meth:`spread` is the
    run-to-run floor: how far two runs of one step differ.

    Grid points whose steps coincide (no prefill, so the prefix is moot; no decodes, so the
    context is) are measured once and share their runs, which also keeps the table flat where
    the step does not change.

    Args:
        executor: Any executor whose results carry ``duration_s``.
        num_pages: KV pages the executor's cache holds (at least ``grid.max_pages(page_size)``).
        page_size: Tokens per KV page, as the executor was built.
        grid: The values of each feature.
        vocab_size: Token ids are drawn below it; the values do not affect the time.
        seed: Seed of the token-id generator.
        decode_batching: How the executor batches decodes, recorded with the profile; ``None``:
            what the executor declares (:class:`~phasesched.costmodel.batching.DeclaresDecodeBatching`),
            or ragged (the mean context) if it declares nothing.
        decode_settle: Untimed runs of a decode-only step before each time it is timed (the
            larger of this and ``warmup`` on a first visit). Serving runs decodes in long
            stretches, but a pass reaches each decode-only step right after a larger one, and on
            a CPU the torch executor's small decode steps then ran 40% slower for two steps and
            16% and 8% for the next two (caches and the allocator refilling), which put the
            profile's decodes 30% above the real ones. After four untimed runs they are within
            about 5% of their steady time; a GPU's decode steps cost little to repeat.

    Raises:
        ProfilingError: The grid needs more pages than ``num_pages``.

    >>> from phasesched.sim import SimulatedExecutor
    >>> from phasesched.costmodel import RooflineCostModel
    >>> profiler = Profiler(SimulatedExecutor(RooflineCostModel.from_names()), num_pages=64, page_size=16)
    >>> profiler.run_pass()
    >>> profiler.run_pass()
    >>> len(profiler.points()), profiler.passes, profiler.spread()
    (36, 2, 0.0)

    """

    executor: Executor
    num_pages: int
    page_size: int
    grid: ProfileGrid = attrs.field(factory=ProfileGrid)
    vocab_size: int = 256
    seed: int = 0
    decode_batching: DecodeBatching | None = None
    decode_settle: int = attrs.field(default=4, kw_only=True, validator=lambda _, __, value: _check_settle(value))
    passes: int = attrs.field(default=0, init=False)
    _runs: dict[_Shape, list[float]] = attrs.field(factory=dict, init=False)
    _session: _Session = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        if self.grid.max_pages(self.page_size) > self.num_pages:
            needs = self.grid.max_pages(self.page_size)
            msg = f"the largest grid step needs {needs} KV pages, the cache has {self.num_pages}"
            raise ProfilingError(msg)
        if self.decode_batching is None:
            self.decode_batching = decode_batching_of(self.executor)
        kv = PagedKVManager(self.num_pages, self.page_size)
        self._session = _Session(self.executor, kv, np.random.default_rng(self.seed), self.vocab_size)

    @property
    def batching(self) -> DecodeBatching:
        """The decode batching the profile is read with (ragged when none was given or declared)."""
        return self.decode_batching or RAGGED

    def run_pass(
        self,
        *,
        repeats: int = 1,
        warmup: int = 0,
        revisit_decodes: bool = False,
        progress: Callable[[int, int], None] | None = None,
    ) -> None:
        """Time every distinct step of the grid ``repeats`` times, after ``warmup`` untimed runs each.

        Args:
            repeats: Timed runs of each step, back to back.
            warmup: Untimed runs of each step before them (allocator, kernel selection, caches).
                A decode-only step gets at least ``decode_settle`` at every visit.
            revisit_decodes: Also time the decode-only steps again after each prefill size
                (with ``decode_settle`` untimed runs only), so the steps most of a serving run
                consists of are sampled across the whole pass rather than at its start only.
            progress: Called with ``(steps done, steps in the pass)`` after each step.

        Raises:
            ProfilingError: The executor reports no duration.

        """
        _check_runs(repeats, warmup)
        sizes = self.grid.prefill_tokens
        parts = [(size, True) for size in sizes]
        if revisit_decodes and sizes[0] == 0:
            parts = [(0, True)] + [part for size in sizes[1:] for part in ((size, True), (0, False))]
        steps = [
            (step, first)
            for size, first in parts
            for step in dict.fromkeys(
                _effective_shape(shape) for shape in attrs.evolve(self.grid, prefill_tokens=(size,)).combinations()
            )
        ]
        for done, (step, first) in enumerate(steps, start=1):
            untimed = warmup if first else 0
            if not step[0] and step[2]:  # decode-only: settle after whatever larger step ran before
                untimed = max(untimed, self.decode_settle)
            times = self._session.measure(step, repeats=repeats, warmup=untimed)
            self._runs.setdefault(step, []).extend(times)
            if progress is not None:
                progress(done, len(steps))
        self.passes += 1

    def points(self) -> list[ProfilePoint]:
        """The profile: each grid point with the median of all its runs, in :meth:`ProfileGrid.combinations` order.

        Raises:
            ProfilingError: No pass has run.

        """
        if not self.passes:
            raise ProfilingError("no profile pass has run: call run_pass() first")
        medians = {step: statistics.median(times) for step, times in self._runs.items()}
        return [ProfilePoint(*shape, medians[_effective_shape(shape)]) for shape in self.grid.combinations()]

    def runs(self) -> dict[tuple[int, int, int, int], tuple[float, ...]]:
        """Every timed run so far, by the step that ran (a grid point's effective shape)."""
        return {step: tuple(times) for step, times in self._runs.items()}

    def spread(self) -> float:
        """The run-to-run floor: median ``|t_i - t_j| / t_j`` over every step and ordered pair of its runs.

        ``nan`` when no step has run twice.
        """
        errors = [
            abs(a - b) / b
            for times in self._runs.values()
            if len(times) > 1 and min(times) > 0
            for i, a in enumerate(times)
            for j, b in enumerate(times)
            if i != j
        ]
        return float(np.median(errors)) if errors else float("nan")

    def metadata(self) -> dict[str, str]:
        """What the profile's metadata should record of how it was measured (decode batching, statistic)."""
        fewest, most = (f(len(times) for times in self._runs.values()) for f in (min, max))
        runs = str(fewest) if fewest == most else f"{fewest} to {most}"
        spread = self.spread()
        return {
            METADATA_KEY: self.batching.to_metadata(),
            "decode_batching_declared": "yes" if self.decode_batching is not None else "no (read as ragged)",
            "statistic": f"median of {runs} runs a point over {self.passes} pass(es)",
            "decode_settle": str(self.decode_settle),
            **({} if math.isnan(spread) else {"run_to_run_spread": f"{spread:.4f}"}),
        }

    def cost_model(self, *, monotone: bool = True, step_overhead_s: float = 0.0) -> ProfiledCostModel:
        """The profile as a cost model that reads steps with this executor's decode batching."""
        return ProfiledCostModel(
            self.points(), monotone=monotone, step_overhead_s=step_overhead_s, decode_batching=self.batching
        )

    def write_csv(self, path: str | os.PathLike[str], metadata: Mapping[str, str] | None = None) -> None:
        """Write the profile as :func:`~phasesched.costmodel.profiled.write_profile_csv` does.

        The metadata lines are ``metadata`` followed by :meth:`metadata` (the decode batching,
        the statistic and the run-to-run spread).
        """
        write_profile_csv(path, self.points(), {**(metadata or {}), **self.metadata()})


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
    decode_settle: int = 4,
) -> list[ProfilePoint]:
    """Time ``executor`` at every point of ``grid`` and return the profile (one :class:`Profiler` pass).

    Use :class:`Profiler` for several passes, the run-to-run spread, or a cost model that
    reads steps with the executor's declared decode batching.

    Args:
        executor: Any executor whose results carry ``duration_s``.
        num_pages: KV pages the executor's cache holds (at least ``grid.max_pages(page_size)``).
        page_size: Tokens per KV page, as the executor was built.
        grid: The values of each feature.
        repeats: Timed runs per point; the median is recorded.
        warmup: Untimed runs per point before them (allocator, kernel selection, caches).
        progress: Called with ``(steps done, steps in all)`` after each distinct step.
        vocab_size: Token ids are drawn below it; the values do not affect the time.
        seed: Seed of the token-id generator.
        decode_settle: Untimed runs of each decode-only step before it is timed (see :class:`Profiler`).

    Returns:
        One :class:`ProfilePoint` per grid point, in :meth:`ProfileGrid.combinations` order.

    Raises:
        ProfilingError: The executor reports no duration, or the grid needs more pages than
            ``num_pages``.

    """
    _check_runs(repeats, warmup)
    profiler = Profiler(
        executor,
        num_pages=num_pages,
        page_size=page_size,
        grid=grid,
        vocab_size=vocab_size,
        seed=seed,
        decode_settle=decode_settle,
    )
    profiler.run_pass(repeats=repeats, warmup=warmup, progress=progress)
    return profiler.points()
