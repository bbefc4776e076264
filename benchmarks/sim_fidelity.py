"""Simulator fidelity: one mixed workload served for real on the torch executor, and simulated from its profile.

1. **Model.** A Llama-shaped decoder with seeded random weights (:data:`MODEL`: hidden 512,
   4 layers, 8 query heads over 2 KV heads, SwiGLU 1536, vocab 8192), float32 on the CPU. A
   one-sequence decode step takes 10-13 ms, a 256-token chunk 90-600 ms (by its prefix),
   against ~0.75 ms of scheduling and bookkeeping around each step, so steps are compute, not
   Python. Larger shapes cost too much here: the reference attention's gathers dominate long
   contexts, and hidden 768 x 6 layers took 2-3x as long per step (22 ms per decode, 1.4 s
   per chunk after a 1.5K prefix), which would stretch the benchmark past ten minutes.
   Torch is held to ``--threads`` intra-op threads, 1 by default: with 2 on this shared 2-core
   machine, a 10 ms decode step took 360 ms whenever another process held the second core.
   The C allocator keeps freed memory (:func:`keep_freed_memory`): by default glibc returns
   the attention's large score buffers to the system and faults fresh pages in on the next
   step, which made the same 256-token chunk after a 1.5K prefix take 102-117 ms or 136-172 ms
   by what ran before it; the cost of a step then depends on its shape, as a profile assumes.
2. **Profile.** The library's :class:`~phasesched.costmodel.profiling.Profiler` (what
   ``phasesched profile --passes N`` runs) times the executor on a grid covering the workload's
   shapes (prefill chunks up to the chunk size, prefixes up to the longest prompt, decode
   batches up to the sequence cap, contexts up to the longest sequence). The grid is timed in
   ``--passes`` passes spread over the whole benchmark (before, between and after the real
   runs), the decode-only steps again after each prefill size, and each point keeps its median
   over all its runs. The profile becomes a :class:`~phasesched.costmodel.ProfiledCostModel`
   that reads a step's decodes as the torch executor batches them (buckets of similar
   contexts, each padded to its longest: the executor's declared ``decode_batching``).
3. **Workload.** 40 requests, Poisson at 1/s (45 s of arrivals), seed 0: 36 short prompts of
   32-256 tokens and 4 long ones of 1024-1536, each generating 16-64 tokens. Up to five
   sequences decode together, and long prompts are chunked beside running decodes (mixed
   steps); the sequence cap of 8 bounds the profile's decode axis.
4. **Real runs.** :class:`~phasesched.Engine` on a :class:`~phasesched.WallClock`: arrivals are
   replayed in real time, Sarathi-style chunked prefill (``sarathi``, 256-token chunk). Run A is
   the measurement; run B replays the same requests once more, to show how far two real runs
   of the same workload on this machine differ (the floor any simulator is held to here).
5. **Simulated run.** :func:`~phasesched.sim.simulate` of the same workload and policy, with
   the profiled cost model and the same KV geometry (and, for the diagnostics, with the same
   profile read at the mean and at the longest decode context instead).
6. **Errors.** Per real step, ``|measured - predicted| / measured`` for the step's shape, both
   against the executor's own ``duration_s`` (what the profile measures) and against the wall
   time of the engine iteration (``schedule`` + ``execute`` + ``update``); per request,
   ``|sim - real| / real`` of TTFT and of the mean inter-token latency; and the relative error
   of the run-level TTFT and ITL p50 and p99 (each the percentile over all the run's requests
   or token gaps, compared between the runs). Target: 10% (Vidur reports under 9% on GPUs).

The table gives each error for run A (median, p90, pass or fail) and run B, and a *floor*: the
same error between the two real runs (request rows), or between two profile runs of the same
step (step rows). A second table breaks the step errors down (see :func:`diagnostics`).

The whole benchmark takes about four minutes (2.5 of profiling, two real runs of 48 s). Its
errors depend on what else the machine runs: see ``benchmarks/README.md``.

Usage::

    python benchmarks/sim_fidelity.py [--out DIR] [--json out.json] [--passes 3] [--runs 2] [--threads 1]
        [--default-malloc]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch
from numpy.typing import NDArray

from phasesched import (
    Engine,
    PolicyOptions,
    Request,
    Scheduler,
    SchedulerConfig,
    StepPlan,
    StepResult,
    VirtualClock,
    WallClock,
    load_policy,
)
from phasesched.costmodel.batching import RAGGED, DecodeBatching
from phasesched.costmodel.profiled import ProfiledCostModel
from phasesched.costmodel.profiling import ProfileGrid, Profiler, profile_executor
from phasesched.costmodel.protocol import CostModel
from phasesched.engine import StepRecord
from phasesched.metrics.summary import RunMetrics
from phasesched.policies import SchedulingPolicy
from phasesched.sim import Deployment, Poisson, SimResult, Uniform, Workload, simulate, synthetic
from phasesched_torch import LlamaConfig, TorchExecutor, create_executor

MODEL = LlamaConfig(
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1536,
    num_layers=4,
    num_heads=8,
    num_kv_heads=2,
    max_position_embeddings=4096,
)
"""About 17M parameters in the layers and the LM head, 68 MB in float32. See the module docstring."""

TARGET = 0.10
PAGE_SIZE = 16

FloatArray = NDArray[np.float64]


@attrs.frozen
class Setup:
    """The experiment's knobs; the defaults are the configuration the module docstring describes.

    Attributes:
        num_short: Short requests.
        num_long: Long requests, placed at random rows among the short ones.
        short_prompt: Inclusive range of short prompt lengths.
        long_prompt: Inclusive range of long prompt lengths.
        output: Inclusive range of output lengths (every request; EOS is ignored).
        rate: Poisson arrival rate, requests per second.
        chunk_size: Sarathi's chunk and token budget.
        max_num_seqs: Sequence cap (and the largest decode batch of the profile).
        seed: Seeds lengths, arrivals, token ids, weights and sampling.
        passes: Timed passes over the profile grid; each point keeps its median over them.
        warmup: Untimed runs of each point in the first pass.
        runs: Real runs (the first is compared with the simulation; a second one gives the floor).

    """

    num_short: int = 36
    num_long: int = 4
    short_prompt: tuple[int, int] = (32, 256)
    long_prompt: tuple[int, int] = (1024, 1536)
    output: tuple[int, int] = (16, 64)
    rate: float = 1.0
    chunk_size: int = 256
    max_num_seqs: int = 8
    seed: int = 0
    passes: int = 3
    warmup: int = 1
    runs: int = 2

    def workload(self) -> Workload:
        """Short requests from :func:`synthetic`, ``num_long`` of them given long prompts."""
        n = self.num_short + self.num_long
        base = synthetic(n, Poisson(self.rate), Uniform(*self.short_prompt), Uniform(*self.output), seed=self.seed)
        rng = np.random.default_rng([self.seed, 1])
        rows = rng.choice(n, size=self.num_long, replace=False)
        prompt = base.prompt_len.copy()
        prompt[rows] = rng.integers(self.long_prompt[0], self.long_prompt[1] + 1, size=self.num_long)
        return attrs.evolve(base, name=f"mixed-{self.num_long}long-{self.num_short}short", prompt_len=prompt)

    def policy(self) -> SchedulingPolicy:
        """Sarathi with this chunk size and sequence cap."""
        return load_policy("sarathi", PolicyOptions(chunk_size=self.chunk_size, max_num_seqs=self.max_num_seqs))

    @property
    def max_model_len(self) -> int:
        """The longest sequence the workload can produce."""
        return self.long_prompt[1] + self.output[1]

    @property
    def num_pages(self) -> int:
        """Room for ``max_num_seqs`` of the longest sequences (nothing is ever preempted) and for the profile."""
        return max(self.max_num_seqs * -(-self.max_model_len // PAGE_SIZE), self.grid().max_pages(PAGE_SIZE))

    def grid(self) -> ProfileGrid:
        """Every shape the workload's steps can take, four values per length axis (see :func:`_axis`)."""
        return ProfileGrid(
            prefill_tokens=(0, 32, 64, 128, self.chunk_size),
            prefill_prefix=_axis(0, self.long_prompt[1], 4),
            decode_seqs=tuple(sorted({0, 1, 2, 4, self.max_num_seqs})),
            decode_context=_axis(self.short_prompt[0], self.max_model_len, 4),
        )


def _axis(low: int, high: int, points: int) -> tuple[int, ...]:
    """``points`` values from ``low`` to ``high``, denser at the low end (most steps are short)."""
    values = low + (high - low) * np.linspace(0.0, 1.0, points) ** 1.5
    return tuple(sorted({round(float(v)) for v in values}))


# ---------------------------------------------------------------------------------- measuring
@attrs.define(eq=False)
class CoreShare:
    """An executor wrapper that records each step's thread CPU time beside its reported duration.

    With torch on one thread a step's work all runs on the calling thread, so ``cpu / duration``
    is the share of a core the step got: 1 when it ran undisturbed, less when the thread waited
    for a core that other processes held. It changes nothing the executor reports.

    Attributes:
        executor: The executor it forwards to.
        phase: The label of the calls to come (``"profile"``, ``"run A"``, ...).
        phases: The label of each call that ran a step (empty plans are not recorded).
        cpu_s: Thread CPU seconds of each of those calls.
        duration_s: The duration each of them reported.

    """

    executor: TorchExecutor
    phase: str = "profile"
    phases: list[str] = attrs.Factory(list)
    cpu_s: list[float] = attrs.Factory(list)
    duration_s: list[float] = attrs.Factory(list)

    @property
    def decode_batching(self) -> DecodeBatching:
        """The wrapped executor's declared decode batching (the profile records it)."""
        return self.executor.decode_batching

    def execute(self, plan: StepPlan) -> StepResult:
        """Run ``plan`` on the wrapped executor, timing its thread CPU."""
        started = time.thread_time()
        result = self.executor.execute(plan)
        if not plan.is_empty:  # an empty plan (it may carry releases) runs nothing and makes no step
            self.cpu_s.append(time.thread_time() - started)
            self.duration_s.append(result.duration_s or 0.0)
            self.phases.append(self.phase)
        return result

    def shares(self, phase: str) -> FloatArray:
        """CPU over reported time of each call made in ``phase``."""
        mask = np.array(self.phases) == phase
        shares: FloatArray = np.array(self.cpu_s)[mask] / np.array(self.duration_s)[mask]
        return shares

    def share(self, phase: str) -> float:
        """CPU over reported time of the calls made in ``phase``, together."""
        mask = np.array(self.phases) == phase
        return float(np.array(self.cpu_s)[mask].sum() / np.array(self.duration_s)[mask].sum())


@attrs.frozen(eq=False)
class RealRun:
    """One real run: its metrics, its steps and the core share of each step."""

    metrics: RunMetrics
    steps: tuple[StepRecord, ...]
    core_share: FloatArray

    @property
    def duration(self) -> FloatArray:
        """Each step's executor-reported duration, seconds."""
        return np.array([s.duration_s for s in self.steps], dtype=np.float64)

    @property
    def wall(self) -> FloatArray:
        """Each engine iteration's wall time (``schedule`` + ``execute`` + ``update``), seconds."""
        return np.array([s.end_s - s.start_s for s in self.steps], dtype=np.float64)


def token_requests(workload: Workload, vocab_size: int, seed: int) -> list[Request]:
    """The workload's requests (the simulator's ids, lengths and arrivals) with random prompt token ids."""
    rng = np.random.default_rng([seed, 2])
    return [
        Request(
            r.request_id,
            prompt_token_ids=rng.integers(0, vocab_size, r.prompt_len).tolist(),
            max_new_tokens=r.max_new_tokens,
            ignore_eos=True,
            arrival_time=r.arrival_time,
        )
        for r in workload.requests()
    ]


def profiler(setup: Setup, executor: CoreShare) -> Profiler:
    """The library's profiler on the setup's grid and KV geometry.

    Each pass (:meth:`Profiler.run_pass` with ``revisit_decodes``) times every point once and
    the decode-only points again after each prefill size: one run per point per pass rather
    than back-to-back repeats, because on a shared machine the executor's speed drifts by
    10-30% over seconds (even with a core to itself: probably other processes evicting its
    weights from the shared L3), so back-to-back repeats land in one regime and their median
    keeps it; passes spread over the whole benchmark sample many. The decode-only points are
    most of the real steps yet cost a second in all, hence their revisits. Each visit of a
    decode-only point is timed after the profiler's ``decode_settle`` untimed runs: reached right
    after a larger step, this model's decodes ran 40% slower for two steps (and the profile's
    decodes 30% above the real runs' when they were timed at once).
    """
    return Profiler(
        executor,
        num_pages=setup.num_pages,
        page_size=PAGE_SIZE,
        grid=setup.grid(),
        vocab_size=MODEL.vocab_size,
        seed=setup.seed,
    )


def serve(setup: Setup, executor: CoreShare, workload: Workload) -> RealRun:
    """Serve the workload on the executor, arrivals replayed in real time."""
    requests = token_requests(workload, MODEL.vocab_size, setup.seed)
    config = SchedulerConfig(num_pages=setup.num_pages, page_size=PAGE_SIZE, max_model_len=setup.max_model_len)
    gc.collect()  # start without the profile's garbage: a collection would land inside a step
    engine = Engine(Scheduler(config, setup.policy()), executor, clock=WallClock(), keep_requests=True, keep_steps=True)
    metrics = engine.run(requests)
    # The engine records one step per non-empty plan, and CoreShare one call.
    return RealRun(metrics, tuple(engine.steps), executor.shares(executor.phase))


def host_overhead(setup: Setup, executor: CoreShare) -> float:
    """Seconds per step the engine spends outside the executor's timed compute, measured apart.

    A calibration workload of the same shape but another seed goes through the engine with the
    real executor on a virtual clock (no waiting for arrivals). The loop's wall time minus the
    executor's reported durations, per step, is the scheduler's, the executor's own host-side
    preparation and ``update()``'s share, which no profile point contains. It becomes the profiled
    model's ``step_overhead_s``. (The workload under test is not used, so nothing is fitted to it.)
    """
    calibration = attrs.evolve(setup, seed=setup.seed + 1, num_short=max(setup.num_short // 3, 4), num_long=1)
    requests = token_requests(calibration.workload(), MODEL.vocab_size, calibration.seed)
    config = SchedulerConfig(num_pages=setup.num_pages, page_size=PAGE_SIZE, max_model_len=setup.max_model_len)
    executor.phase = "calibration"
    engine = Engine(Scheduler(config, setup.policy()), executor, clock=VirtualClock(), keep_steps=True)
    started = time.perf_counter()
    engine.run(requests)
    wall = time.perf_counter() - started
    computed = sum(step.duration_s or 0.0 for step in engine.steps)
    return max(wall - computed, 0.0) / max(len(engine.steps), 1)


def run_sim(setup: Setup, workload: Workload, model: CostModel) -> SimResult:
    """Simulate the workload with the profiled cost model on the same KV geometry."""
    deployment = Deployment(
        cost_model=model, num_pages=setup.num_pages, page_size=PAGE_SIZE, max_model_len=setup.max_model_len
    )
    return simulate(workload, setup.policy(), deployment, keep_requests=True)


# ------------------------------------------------------------------------------------ errors
@attrs.frozen
class ErrorRow:
    """One line of the fidelity table; errors are fractions (``nan`` where they do not apply).

    Attributes:
        metric: What is compared.
        count: Samples behind the median, for run A (1 for a run-level percentile).
        median: Median absolute relative error against run A (the error itself for a run-level value).
        p90: Its 90th percentile.
        run_b: The median error against run B.
        floor: The median error of the same kind between two real measurements (see the module docstring).

    """

    metric: str
    count: int
    median: float
    p90: float = float("nan")
    run_b: float = float("nan")
    floor: float = float("nan")

    @property
    def passed(self) -> bool:
        """Whether the median error against run A is within :data:`TARGET`."""
        return self.median <= TARGET


def relative_error(measured: FloatArray, predicted: FloatArray) -> FloatArray:
    """``|predicted - measured| / measured``, element-wise."""
    return np.abs(predicted - measured) / measured


def _median(errors: FloatArray | float) -> float:
    values = np.atleast_1d(np.asarray(errors, dtype=np.float64))
    values = values[np.isfinite(values)]
    return float(np.median(values)) if len(values) else float("nan")


def predicted_steps(steps: Sequence[StepRecord], model: ProfiledCostModel) -> FloatArray:
    """The profile's prediction for each real step's shape."""
    return np.array([model.step_time(np.array(s.num_new), np.array(s.kv_len)) for s in steps])


def request_errors(real: RunMetrics, other: RunMetrics) -> dict[str, FloatArray]:
    """``|other - real| / real`` of TTFT and mean ITL per request (matched by id), and of the run-level percentiles.

    The run-level rows compare one number per run (the p50 or p99 over all its requests' TTFTs,
    or over all its token gaps), so each is a single error, not a median of many.
    """
    assert real.requests is not None
    assert other.requests is not None
    by_id = {r.request_id: r for r in other.requests}
    ttft = np.array([(r.ttft_s, by_id[r.request_id].ttft_s) for r in real.requests], dtype=np.float64)
    tpot = np.array([(r.tpot_s, by_id[r.request_id].tpot_s) for r in real.requests], dtype=np.float64)

    def run_level(key: str) -> FloatArray:
        return relative_error(np.array([real[key]]), np.array([other[key]]))

    return {
        "TTFT per request": relative_error(ttft[:, 0], ttft[:, 1]),
        "TTFT p50 (run)": run_level("median_ttft_ms"),
        "TTFT p99 (run)": run_level("p99_ttft_ms"),
        "mean ITL per request (TPOT)": relative_error(tpot[:, 0], tpot[:, 1]),
        "ITL p50 (run)": run_level("median_itl_ms"),
        "ITL p99 (run)": run_level("p99_itl_ms"),
    }


def error_rows(runs: Sequence[RealRun], sim: RunMetrics, model: ProfiledCostModel, spread: float) -> list[ErrorRow]:
    """The fidelity table (see the module docstring, item 6).

    The executor's own duration is compared with the profile alone; the wall step (which
    includes the engine's work) with the profile plus the measured host overhead. ``spread``
    is the profiler's run-to-run floor (:meth:`Profiler.spread`; ``nan`` without passes).
    """
    kernel_only = attrs.evolve(model, step_overhead_s=0.0)
    rows = []
    for metric, field, reference in _STEP_METRICS:
        used = kernel_only if reference == "profile" else model
        errors = [relative_error(getattr(run, field), predicted_steps(run.steps, used)) for run in runs]
        rows.append(_row(metric, errors, spread))
    sim_errors = [request_errors(run.metrics, sim) for run in runs]
    floor = request_errors(runs[0].metrics, runs[1].metrics) if len(runs) > 1 else {}
    rows.extend(_row(m, [e[m] for e in sim_errors], _median(floor.get(m, np.nan))) for m in sim_errors[0])
    return rows


_STEP_METRICS = (
    ("step time vs executor duration_s", "duration", "profile"),
    ("step time vs wall (incl. scheduler)", "wall", "profile + overhead"),
)


def _row(metric: str, errors: Sequence[FloatArray], floor: float) -> ErrorRow:
    first = errors[0][np.isfinite(errors[0])]
    return ErrorRow(
        metric,
        len(first),
        _median(first),
        float(np.percentile(first, 90)) if len(first) > 1 else float("nan"),
        _median(errors[1]) if len(errors) > 1 else float("nan"),
        floor,
    )


# ------------------------------------------------------------------------------- diagnostics
def _kind(step: StepRecord) -> str:
    decodes = sum(n == 1 for n in step.num_new)
    prefills = len(step.num_new) - decodes
    if not prefills:
        return "decode-only"
    kind = "prefill-only" if not decodes else "mixed"
    return f"{kind}, {'1 prompt' if prefills == 1 else '2+ prompts'}"


def _uneven(step: StepRecord) -> bool:
    """Whether the step decodes sequences whose contexts differ widely (longest over mean above 1.5)."""
    contexts = [k for n, k in zip(step.num_new, step.kv_len, strict=True) if n == 1]
    return len(contexts) > 1 and max(contexts) > 1.5 * statistics.fmean(contexts)


def read_at(model: ProfiledCostModel, batching: DecodeBatching) -> ProfiledCostModel:
    """The same profile reading decodes with another layout (a what-if: mean or longest context)."""
    return attrs.evolve(model, decode_batching=batching)


WHAT_IFS = {"mean context": RAGGED, "longest context": DecodeBatching.longest()}
"""The other readings of a step's decodes the diagnostics compare with the executor's own."""


def diagnostics(run: RealRun, model: ProfiledCostModel, what_if: dict[str, RunMetrics]) -> dict[str, Any]:
    """Where the step-time error of a real run comes from.

    * ``by_kind``: per step kind, the count, the median measured time, the median absolute and
      the median *signed* error (``(predicted - measured) / measured``: negative means the
      profile under-predicts).
    * ``overhead``: wall time of the engine iteration outside ``execute()``'s own timing
      (scheduling, plan checks, ``update``), which no profile point contains.
    * ``jitter``: ``|d_i - d_(i-1)| / d_(i-1)`` between consecutive decode-only steps of one
      batch size, whose shapes differ by a context token each: the short-term noise.
    * ``undisturbed``: the steps that got at least 95% of a core (see :class:`CoreShare`) and
      their median error: what is left once other processes' load is (mostly) out of the way.
    * ``uneven_contexts``: the steps that decode sequences of widely different contexts, and
      their median error with the profile read as the executor batches decodes (its declared
      ``decode_batching``: buckets of similar contexts, each padded to its longest), at the mean
      context (a ragged kernel's reading, the library's before executors declared theirs) and
      at the longest (padding every decode to the longest).
    * ``itl_median``: where the run's median inter-token gap falls among the decode-only steps
      (see :func:`itl_median_position`).
    * ``what_if``: per other reading (:data:`WHAT_IFS`), the request errors against the run
      when the simulation prices steps with it (``what_if`` holds those simulations).
    """
    steps, duration, wall = run.steps, run.duration, run.wall
    predicted = predicted_steps(steps, model)
    signed = (predicted - duration) / duration
    kinds = np.array([_kind(s) for s in steps])
    by_kind = {
        kind: {
            "steps": int(np.count_nonzero(kinds == kind)),
            "median_measured_ms": float(np.median(duration[kinds == kind]) * 1e3),
            "median_abs_error": _median(np.abs(signed[kinds == kind])),
            "median_signed_error": _median(signed[kinds == kind]),
        }
        for kind in sorted(set(kinds.tolist()))
    }
    like = np.array([len(s.num_new) if k == "decode-only" else -1 for s, k in zip(steps, kinds, strict=True)])
    pairs = np.flatnonzero((like[1:] == like[:-1]) & (like[1:] > 0)) + 1
    undisturbed = run.core_share >= 0.95
    uneven = np.array([_uneven(s) for s in steps], dtype=bool)
    uneven_steps = [s for s, u in zip(steps, uneven, strict=True) if u]
    uneven_errors = {
        name: _median(relative_error(duration[uneven], predicted_steps(uneven_steps, read_at(model, batching))))
        for name, batching in WHAT_IFS.items()
    }
    return {
        "by_kind": by_kind,
        "itl_median": itl_median_position(steps, wall, predicted, kinds),
        "overhead_ms": float(np.median(wall - duration) * 1e3),
        "overhead_fraction": float(np.median((wall - duration) / wall)),
        "jitter": _median(relative_error(duration[pairs - 1], duration[pairs])),
        "undisturbed_steps": int(np.count_nonzero(undisturbed)),
        "undisturbed_error": _median(np.abs(signed[undisturbed])),
        "uneven_steps": int(np.count_nonzero(uneven)),
        "uneven_error": {"declared": _median(np.abs(signed[uneven])), **uneven_errors},
        "what_if": {
            name: {k: _median(v) for k, v in request_errors(run.metrics, metrics).items()}
            for name, metrics in what_if.items()
        },
    }


def _weighted_median(values: FloatArray, weights: NDArray[np.int64]) -> tuple[float, int]:
    """The median of ``values`` counted ``weights`` times each, and the index of the value holding it."""
    order = np.argsort(values, kind="stable")
    held = order[int(np.searchsorted(np.cumsum(weights[order]), weights.sum() / 2))]
    return float(values[held]), int(held)


def itl_median_position(
    steps: Sequence[StepRecord], wall: FloatArray, predicted: FloatArray, kinds: NDArray[np.str_]
) -> dict[str, float]:
    """Where a run's median inter-token gap sits, and what a deterministic model can read there.

    A decode-only step of ``B`` requests gives ``B`` gaps of its wall time, so the run's median
    gap is the token-weighted median of those steps. When batches of one size hold about half
    the tokens, that median is a high or low quantile of that size's steps, and the real
    step-to-step spread there (``spread``: real over predicted, 10th to 90th percentile) moves
    it; a cost model gives one time per shape. ``priced_error`` is the error of the same
    median with each real step priced by the model: the part of the ITL p50 row's error that
    is not scheduling.
    """
    index = np.flatnonzero(kinds == "decode-only")
    if not len(index):
        return {}
    size = np.array([len(steps[i].num_new) for i in index.tolist()], dtype=np.int64)
    real, at = _weighted_median(wall[index], size)
    priced, _ = _weighted_median(predicted[index], size)
    same = size == size[at]
    ratio = wall[index][same] / predicted[index][same]
    return {
        "real_ms": real * 1e3,
        "batch_size": float(size[at]),
        "quantile": float(np.mean(wall[index][same] <= real)),
        "spread_p10": float(np.percentile(ratio, 10)),
        "spread_p90": float(np.percentile(ratio, 90)),
        "priced_ms": priced * 1e3,
        "priced_error": abs(priced - real) / real,
    }


# ------------------------------------------------------------------------------------ report
def summary(runs: Sequence[RealRun], sim: SimResult) -> dict[str, list[float]]:
    """Headline numbers: each real run's, then the simulation's."""
    keys = ("median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms", "median_tpot_ms", "duration")
    out = {key: [*(run.metrics[key] for run in runs), sim.metrics[key]] for key in keys}
    out["steps"] = [*(len(run.steps) for run in runs), sim.steps]
    out["core share"] = [*(float(np.median(run.core_share)) for run in runs), float("nan")]
    return out


def _pct(value: float, width: int) -> str:
    return f"{'-':>{width}}" if np.isnan(value) else f"{value:>{width}.1%}"


def print_table(rows: Sequence[ErrorRow]) -> None:
    header = f"{'relative error (sim vs real)':<37}{'n':>5}{'run A':>8}{'p90':>8}{'run B':>8}{'floor':>8}  result"
    print(header)
    print("-" * len(header))
    for r in rows:
        cells = _pct(r.median, 8) + _pct(r.p90, 8) + _pct(r.run_b, 8) + _pct(r.floor, 8)
        print(f"{r.metric:<37}{r.count:>5}{cells}  {'pass' if r.passed else 'FAIL'} (target {TARGET:.0%})")
    print(
        "floor: the same error between two real measurements (run B vs run A for request rows; "
        "one profile run of a step vs another for step rows)"
    )


def print_details(side_by_side: dict[str, list[float]], diag: dict[str, Any]) -> None:
    runs = len(next(iter(side_by_side.values()))) - 1
    print(f"\n{'':<16}" + "".join(f"{'real ' + 'AB'[i]:>11}" for i in range(runs)) + f"{'sim':>11}")
    for key, values in side_by_side.items():
        print(f"{key:<16}" + "".join(f"{v:>11.4g}" for v in values))
    print(f"\n{'run A step kind':<28}{'steps':>6}{'median ms':>11}{'|error|':>9}{'signed':>9}")
    for kind, d in diag["by_kind"].items():
        error, signed = d["median_abs_error"], d["median_signed_error"]
        print(f"{kind:<28}{d['steps']:>6}{d['median_measured_ms']:>11.1f}{error:>9.1%}{signed:>+9.1%}")
    print(
        f"\noverhead outside execute(): median {diag['overhead_ms']:.2f} ms "
        f"({diag['overhead_fraction']:.1%} of the wall step)\n"
        f"step-to-step jitter of like decode steps: median {diag['jitter']:.1%}\n"
        f"steps with >= 95% of a core: {diag['undisturbed_steps']}, median error {diag['undisturbed_error']:.1%}\n"
        f"steps decoding uneven contexts (longest > 1.5 x mean): {diag['uneven_steps']}, median error "
        + ", ".join(f"{v:.1%} read at the {k}" for k, v in diag["uneven_error"].items() if k != "declared")
        + f", {diag['uneven_error']['declared']:.1%} as the executor batches them (the cost model's reading)"
    )
    itl = diag["itl_median"]
    if itl:
        print(
            f"median ITL (real, token-weighted over decode-only steps): {itl['real_ms']:.2f} ms, the "
            f"{itl['quantile']:.0%} quantile of {itl['batch_size']:.0f}-request steps, where real/predicted spans "
            f"{itl['spread_p10']:.2f}-{itl['spread_p90']:.2f} (p10-p90); the same steps priced by the profile: "
            f"{itl['priced_ms']:.2f} ms ({itl['priced_error']:.1%} off, before any scheduling difference)"
        )
    for name, errors in diag["what_if"].items():
        print(
            f"what-if, simulated with the profile read at the {name} (vs run A): "
            + ", ".join(f"{k} {v:.1%}" for k, v in errors.items())
        )


# ------------------------------------------------------------------------------------- main
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory for reuse; return whether it could (glibc only).

    Torch's CPU allocator is malloc. With glibc's defaults, buffers above the (adaptive) mmap
    threshold are mapped per allocation, and freed memory at the top of the heap is handed back,
    so a step that follows a smaller one pays page faults for its scores and activations: tens of
    milliseconds on a long-prefix chunk here, varying with whatever ran before. Mapping only
    above 32 MiB (glibc's maximum) and trimming only above 1 GiB keeps each step's cost a
    function of its shape, in the profile and in the real runs alike.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_TRIM_THRESHOLD, 1 << 30)) and bool(mallopt(M_MMAP_THRESHOLD, 32 << 20))


def main(argv: list[str] | None = None) -> int:
    defaults = Setup()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--passes", type=int, default=defaults.passes, help="timed passes over the profile grid")
    parser.add_argument("--runs", type=int, choices=(1, 2), default=defaults.runs, help="real runs (2: with floor)")
    parser.add_argument("--rate", type=float, default=defaults.rate, help="Poisson arrival rate, requests/s")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--profile", type=Path, help="reuse a profile.csv from --out instead of profiling")
    parser.add_argument("--out", type=Path, help="folder for profile.csv, steps.csv, requests.csv")
    parser.add_argument("--json", type=Path, help="also write the results as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    parser.add_argument(
        "--default-malloc", action="store_true", help="leave glibc's malloc settings alone (see keep_freed_memory)"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    kept = not args.default_malloc and keep_freed_memory()
    setup = Setup(passes=args.passes, runs=args.runs, rate=args.rate, seed=args.seed)
    log = (lambda _: None) if args.quiet else (lambda text: print(text, file=sys.stderr, flush=True))
    result = run(setup, profile_csv=args.profile, out=args.out, log=log)
    print_table(result["rows"])
    print_details(result["summary"], result["diagnostics"])
    print(f"\nmalloc: {'keeps freed memory (trim above 1 GiB, mmap above 32 MiB)' if kept else 'defaults'}")
    print("wall time: " + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in result["wall_s"].items()))
    if args.json:
        rows = [{**attrs.asdict(r), "passed": r.passed} for r in result["rows"]]
        text = json.dumps({**result, "rows": rows, "malloc_keeps_freed": kept}, indent=2, default=float)
        args.json.write_text(text.replace("NaN", "null"), encoding="utf-8")
    return 0


def run(
    setup: Setup, *, profile_csv: Path | None = None, out: Path | None = None, log: Callable[[str], None] = print
) -> dict[str, Any]:
    """Profile, serve, simulate and compare; return everything the report and the JSON need."""
    started, load_before = time.perf_counter(), os.getloadavg()
    executor = CoreShare(create_executor(model=MODEL, num_pages=setup.num_pages, page_size=PAGE_SIZE, seed=setup.seed))
    workload = setup.workload()
    log(f"{len(workload)} requests over {workload.duration_s:.0f} s; grid of {setup.grid().num_points} points")
    profile, runs, times = measure(setup, executor, workload, profile_csv, log)
    overhead = host_overhead(setup, executor)
    log(f"engine overhead per step, outside the executor: {overhead * 1e3:.2f} ms")
    if profile is not None:
        model = profile.cost_model(step_overhead_s=overhead)
    else:
        assert profile_csv is not None
        model = ProfiledCostModel.from_csv(profile_csv, step_overhead_s=overhead)
    sim_started = time.perf_counter()
    sim = run_sim(setup, workload, model)
    times["simulation"] = time.perf_counter() - sim_started
    times["total"] = time.perf_counter() - started
    if out is not None:
        write_outputs(out, runs, sim=sim.metrics, model=model, profile=profile)
    what_if = {name: run_sim(setup, workload, read_at(model, b)).metrics for name, b in WHAT_IFS.items()}
    return {
        "rows": error_rows(runs, sim.metrics, model, profile.spread() if profile is not None else float("nan")),
        "summary": summary(runs, sim),
        "diagnostics": diagnostics(runs[0], model, what_if),
        "decode_batching": model.decode_batching.to_metadata(),
        "core_share": {phase: executor.share(phase) for phase in dict.fromkeys(executor.phases)},
        "wall_s": times,
        "host_overhead_s": overhead,
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "torch_threads": torch.get_num_threads(),
        "setup": attrs.asdict(setup),
        "model": attrs.asdict(MODEL),
        "grid": attrs.asdict(setup.grid()),
        "profile": str(profile_csv) if profile is None else profile.metadata()["statistic"],
        "versions": {"python": sys.version.split()[0], "torch": torch.__version__},
    }


def measure(
    setup: Setup, executor: CoreShare, workload: Workload, profile_csv: Path | None, log: Callable[[str], None]
) -> tuple[Profiler | None, list[RealRun], dict[str, float]]:
    """Profile passes and real runs, interleaved: pass, run A, pass, run B, pass, then any further passes.

    Spreading the passes over the whole measurement lets the profile see the same mix of load
    from other processes as the real runs did. With ``profile_csv`` no pass runs, only
    :func:`warm_up`.
    """
    num_passes = 0 if profile_csv is not None else setup.passes
    times = {"profile": 0.0, "real runs": 0.0}
    if profile_csv is not None:
        started = time.perf_counter()
        warm_up(setup, executor)
        times = {"warm-up": time.perf_counter() - started, "real runs": 0.0}
    order = [
        kind
        for i in range(max(num_passes, setup.runs))
        for kind, count in (("pass", num_passes), ("run", setup.runs))
        if i < count
    ]
    profile = profiler(setup, executor) if num_passes else None
    runs: list[RealRun] = []
    for kind in order:
        started = time.perf_counter()
        if kind == "pass":
            assert profile is not None
            executor.phase = "profile"
            profile.run_pass(warmup=0 if profile.passes else setup.warmup, revisit_decodes=True)
            times["profile"] += time.perf_counter() - started
            log(f"profile pass {profile.passes}/{num_passes}: {time.perf_counter() - started:.0f} s")
        else:
            executor.phase = f"run {'AB'[len(runs)]}"
            runs.append(serve(setup, executor, workload))
            times["real runs"] += time.perf_counter() - started
            log(f"real {executor.phase}: {time.perf_counter() - started:.0f} s")
    return profile, runs, times


def warm_up(setup: Setup, executor: CoreShare) -> None:
    """Run the extreme shapes once, so the first real steps pay no one-time costs (allocations)."""
    executor.phase = "warm-up"
    grid = ProfileGrid(
        prefill_tokens=(0, 64, setup.chunk_size),
        prefill_prefix=(0, setup.long_prompt[1]),
        decode_seqs=(0, 1, setup.max_num_seqs),
        decode_context=(setup.short_prompt[0], setup.max_model_len),
    )
    profile_executor(executor, num_pages=setup.num_pages, page_size=PAGE_SIZE, grid=grid, repeats=1, warmup=0)


def write_outputs(
    folder: Path, runs: Sequence[RealRun], *, sim: RunMetrics, model: ProfiledCostModel, profile: Profiler | None
) -> None:
    """``profile.csv`` (the documented schema; unless ``profile`` is ``None``), ``steps.csv`` and ``requests.csv``.

    ``steps.csv`` has run A's steps with their prediction; ``requests.csv`` each request's TTFT
    and mean ITL in every real run and in the simulation.
    """
    folder.mkdir(parents=True, exist_ok=True)
    if profile is not None:
        metadata = {
            "model": " ".join(f"{k}={v}" for k, v in attrs.asdict(MODEL).items()),
            "executor": "phasesched_torch TorchExecutor, cpu, float32",
            "torch_threads": str(torch.get_num_threads()),
            "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M"),
        }
        profile.write_csv(folder / "profile.csv", metadata)
    (folder / "steps.csv").write_text(_steps_csv(runs[0], model), encoding="utf-8")
    (folder / "requests.csv").write_text(_requests_csv(runs, sim), encoding="utf-8")


def _steps_csv(run: RealRun, model: ProfiledCostModel) -> str:
    lines = ["start_s,end_s,duration_s,predicted_s,core_share,num_new,kv_len"]
    lines.extend(
        f"{s.start_s:.6f},{s.end_s:.6f},{s.duration_s:.6f},{p:.6f},{c:.3f},"
        f"{' '.join(map(str, s.num_new))},{' '.join(map(str, s.kv_len))}"
        for s, p, c in zip(run.steps, predicted_steps(run.steps, model), run.core_share, strict=True)
    )
    return "\n".join(lines) + "\n"


def _requests_csv(runs: Sequence[RealRun], sim: RunMetrics) -> str:
    sources = [*((f"real_{'ab'[i]}", r.metrics) for i, r in enumerate(runs)), ("sim", sim)]
    records = {name: {r.request_id: r for r in metrics.requests or ()} for name, metrics in sources}
    columns = [(field, name) for field in ("ttft_s", "tpot_s") for name, _ in sources]
    lines = [",".join(["request_id", "arrival_s", "prompt_len", "output_len"] + [f"{f}_{n}" for f, n in columns])]
    for r in runs[0].metrics.requests or ():
        values = [f"{getattr(records[n][r.request_id], f):.6f}" for f, n in columns]
        lines.append(",".join([r.request_id, f"{r.arrival_s:.6f}", str(r.prompt_len), str(r.output_len), *values]))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
