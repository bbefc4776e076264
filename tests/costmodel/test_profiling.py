"""The executor profiler: synthetic plans per grid point, medians, and the errors it raises."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest

from phasesched import StepPlan, StepResult
from phasesched.costmodel import (
    RAGGED,
    DecodeBatching,
    ProfiledCostModel,
    ProfileGrid,
    ProfilePoint,
    Profiler,
    ProfilingError,
    profile_executor,
    read_profile_csv,
    step_features,
    write_profile_csv,
)
from phasesched.errors import InvalidArgumentError


def plan_law(plan: StepPlan) -> float:
    """A duration computed from the plan itself (not via step_features): linear in each feature."""
    decode = plan.is_decode
    prefill_tokens = int(plan.num_new[~decode].sum())
    prefix = float(plan.start[~decode].sum())
    decodes = int(decode.sum())
    context = float(plan.kv_len[decode].mean()) if decodes else 0.0
    return 1e-3 + 2e-5 * prefill_tokens + 1e-9 * prefill_tokens * prefix + 1e-4 * decodes + 1e-8 * decodes * context


@attrs.define
class TimedExecutor:
    """Checks each plan's layout, records it and reports ``law(plan)`` as its duration."""

    law: Callable[[StepPlan], float | None] = plan_law
    plans: list[StepPlan] = attrs.field(factory=list)

    def execute(self, plan: StepPlan) -> StepResult:
        plan.check_layout()
        self.plans.append(plan)
        return StepResult(step_id=plan.step_id, token_ids=np.where(plan.samples, 7, -1), duration_s=self.law(plan))


DEFAULT_GRID = ProfileGrid()


def profile(executor: TimedExecutor, grid: ProfileGrid = DEFAULT_GRID, **kwargs: Any) -> list[ProfilePoint]:
    return profile_executor(executor, num_pages=128, page_size=4, grid=grid, **kwargs)


class TestProfileExecutor:
    def test_records_the_duration_at_every_point(self) -> None:
        """Each grid point, in combination order, carries the executor's duration for its step."""
        points = profile(TimedExecutor())
        grid = ProfileGrid()
        assert [(p.prefill_tokens, p.prefill_prefix, p.decode_seqs, p.decode_context) for p in points] == list(
            grid.combinations()
        )
        for p in points:
            expected = (
                1e-3
                + 2e-5 * p.prefill_tokens
                + 1e-9 * p.prefill_tokens * p.prefill_prefix
                + 1e-4 * p.decode_seqs
                + 1e-8 * p.decode_seqs * p.decode_context
            )
            assert p.step_time_s == pytest.approx(expected, rel=1e-12)

    def test_plans_have_the_points_features(self) -> None:
        """Every plan the profiler builds maps back to its grid point's features."""
        executor = TimedExecutor()
        profile(executor, repeats=1, warmup=0)
        seen = {tuple(step_features(plan.num_new, plan.kv_len)) for plan in executor.plans if plan.batch_size}
        grid = ProfileGrid()
        expected = {
            (float(p), float(x if p else 0), float(d), float(c if d else 0))
            for p, x, d, c in grid.combinations()
            if p or d
        }
        assert seen == expected

    def test_median_of_timed_runs_after_warmup(self) -> None:
        """Warm-up runs are discarded and the median of the timed ones recorded."""
        durations = itertools.cycle([100.0, 3.0, 1.0, 2.0])
        points = profile(TimedExecutor(law=lambda plan: next(durations)), repeats=3, warmup=1, decode_settle=0)
        assert {p.step_time_s for p in points} == {2.0}

    def test_coinciding_steps_are_measured_once(self) -> None:
        """Points whose steps coincide (prefix without prefill, context without decodes) share one measurement."""
        executor = TimedExecutor()
        points = profile(executor, repeats=2, warmup=1, decode_settle=0)
        assert len(points) == 36
        assert len(executor.plans) == 25 * 3  # 5 distinct prefill shapes x 5 distinct decode shapes

    def test_requests_are_announced_then_released(self) -> None:
        """A point's first plan announces its requests; the next point's first plan releases them."""
        executor = TimedExecutor()
        profile(executor, repeats=2, warmup=0, decode_settle=0)
        plans = executor.plans
        assert [p.step_id for p in plans] == list(range(len(plans)))
        firsts = plans[::2]
        for first, second in zip(plans[::2], plans[1::2], strict=True):
            assert tuple(r.request_id for r in first.new_requests) == first.request_ids
            assert second.new_requests == ()
            assert second.released == ()
            assert second.request_ids == first.request_ids
        for previous, current in itertools.pairwise(firsts):
            assert current.released == previous.request_ids
        all_ids = [rid for first in firsts for rid in first.request_ids]
        assert len(all_ids) == len(set(all_ids))

    def test_input_ids_are_random_below_the_vocabulary(self) -> None:
        """Every plan has one int32 token id per query token, drawn below vocab_size."""
        executor = TimedExecutor()
        profile(executor, repeats=1, warmup=0, vocab_size=50)
        for plan in executor.plans:
            assert plan.input_ids is not None
            assert plan.input_ids.dtype == np.int32
            assert plan.input_ids.shape == (plan.num_tokens,)
            assert np.all((plan.input_ids >= 0) & (plan.input_ids < 50))
        assert len({int(i) for plan in executor.plans if plan.input_ids is not None for i in plan.input_ids}) > 10

    def test_a_cache_exactly_as_large_as_the_largest_step_suffices(self) -> None:
        """Pages go back after each point, so max_pages pages are enough for the whole grid."""
        grid = ProfileGrid()
        profile_executor(TimedExecutor(), num_pages=grid.max_pages(4), page_size=4, grid=grid, repeats=1)

    def test_grid_larger_than_the_cache_fails_first(self) -> None:
        """A grid that needs more pages than the cache raises before running anything."""
        executor = TimedExecutor()
        with pytest.raises(ProfilingError, match="KV pages"):
            profile_executor(executor, num_pages=10, page_size=4)
        assert executor.plans == []

    def test_executor_without_timing_is_refused(self) -> None:
        """An executor that reports duration_s=None cannot be profiled."""
        with pytest.raises(ProfilingError, match="duration_s=None"):
            profile(TimedExecutor(law=lambda plan: None))

    def test_progress_reports_every_step(self) -> None:
        """The progress callback sees (done, total) after each distinct step (25 for the 36 points)."""
        calls: list[tuple[int, int]] = []
        profile(TimedExecutor(), repeats=1, warmup=0, progress=lambda done, total: calls.append((done, total)))
        assert calls == [(i, 25) for i in range(1, 26)]

    @pytest.mark.parametrize(("repeats", "warmup"), [(0, 1), (1, -1)])
    def test_rejects_bad_repeat_counts(self, repeats: int, warmup: int) -> None:
        """At least one timed run; no negative warm-up."""
        with pytest.raises(ValueError, match="repeats"):
            profile(TimedExecutor(), repeats=repeats, warmup=warmup)

    def test_profile_to_csv_to_model(self, tmp_path: Path) -> None:
        """A profile written and read back prices an off-grid step as the executor would."""
        points = profile(TimedExecutor(), repeats=1, warmup=0)
        path = tmp_path / "profile.csv"
        write_profile_csv(path, points, {"executor": "timed"})
        assert read_profile_csv(path)[1] == {"executor": "timed"}
        model = ProfiledCostModel.from_csv(path)
        num_new = np.array([1, 1, 1, 30])
        kv_len = np.array([40, 40, 40, 50])
        expected = 1e-3 + 2e-5 * 30 + 1e-9 * 30 * 20 + 1e-4 * 3 + 1e-8 * 3 * 40
        assert model.step_time(num_new, kv_len) == pytest.approx(expected, rel=1e-9)


class TestProfileGrid:
    def test_defaults_are_small(self) -> None:
        """The default grid has 36 points over small sizes."""
        grid = ProfileGrid()
        assert grid.num_points == 36
        assert max(grid.prefill_tokens) <= 64

    def test_gpu_default(self) -> None:
        """The GPU grid has 315 points and needs under 40 GB of Llama-3-8B KV at page size 16."""
        grid = ProfileGrid.gpu_default()
        assert grid.num_points == 315
        assert grid.max_pages(16) == 128 * 128 + 1024
        assert grid.max_pages(16) * 16 * 131_072 < 40e9

    def test_max_pages_by_hand(self) -> None:
        """Largest decode batch plus the largest prefill slice, in pages."""
        grid = ProfileGrid(prefill_tokens=(0, 10), prefill_prefix=(0, 7), decode_seqs=(0, 3), decode_context=(2, 9))
        assert grid.max_pages(4) == 3 * 3 + 5

    @pytest.mark.parametrize(
        "kwargs",
        [
            {"prefill_tokens": (0, 1, 16)},
            {"decode_seqs": (4, 1)},
            {"decode_context": (1, 16)},
            {"prefill_prefix": ()},
            {"decode_seqs": (0, 0, 1)},
            {"prefill_prefix": (-1, 0)},
        ],
    )
    def test_rejects_bad_axes(self, kwargs: dict[str, tuple[int, ...]]) -> None:
        """Axes are non-empty, strictly increasing, with no one-token prefill and contexts >= 2."""
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            ProfileGrid(**kwargs)


@attrs.define
class PaddingExecutor(TimedExecutor):
    """A TimedExecutor that declares it pads decodes to the longest context."""

    @property
    def decode_batching(self) -> DecodeBatching:
        return DecodeBatching.longest()


class TestProfiler:
    def test_passes_accumulate_runs_and_keep_the_median(self) -> None:
        """Each pass adds one run per step; the points hold the median over all passes."""
        durations = itertools.cycle([1.0, 5.0, 3.0])
        executor = TimedExecutor(law=lambda plan: next(durations))
        profiler = Profiler(executor, num_pages=128, page_size=4, decode_settle=0)
        for _ in range(3):
            profiler.run_pass()
        assert profiler.passes == 3
        assert all(len(runs) == 3 for runs in profiler.runs().values())
        assert len(profiler.points()) == 36
        # 25 steps a pass: step i gets durations i, i + 25, i + 50 of the cycle, a permutation of 1, 5, 3.
        assert {p.step_time_s for p in profiler.points()} == {3.0}

    @pytest.mark.parametrize("settle", [0, 3])
    def test_revisit_decodes(self, settle: int) -> None:
        """With revisit_decodes the decode-only steps run again after each prefill size, settled first."""
        executor = TimedExecutor()
        profiler = Profiler(executor, num_pages=128, page_size=4, decode_settle=settle)
        profiler.run_pass(warmup=1, revisit_decodes=True)
        runs = profiler.runs()
        decode_only = [step for step in runs if step[0] == 0]
        assert len(decode_only) == 5
        assert all(len(runs[step]) == 3 for step in decode_only)  # prefill sizes (16, 64): two revisits
        assert all(len(runs[step]) == 1 for step in runs if step[0])
        # Every step warmed once, then the revisits; the four decode-only steps (not the empty
        # one) settled at every visit: max(warmup, settle) untimed runs the first time, settle after.
        untimed = 20 * 1 + 4 * max(1, settle) + 1 + 2 * 4 * settle
        assert len(executor.plans) == 25 + 5 * 2 + untimed

    def test_decode_only_steps_are_timed_once_settled(self) -> None:
        """Decodes that run slower for a few steps after a prefill are profiled at their steady time."""
        slow_for = 3
        since_prefill = 0

        def law(plan: StepPlan) -> float:
            nonlocal since_prefill
            if not plan.is_decode.all():
                since_prefill = 0
                return 1.0
            since_prefill += 1
            return 2.0 if since_prefill <= slow_for else 1.0

        settled = Profiler(TimedExecutor(law=law), num_pages=128, page_size=4, decode_settle=slow_for)
        unsettled = Profiler(TimedExecutor(law=law), num_pages=128, page_size=4, decode_settle=0)
        for profiler in (settled, unsettled):
            for _ in range(2):
                profiler.run_pass(revisit_decodes=True)
        assert {p.step_time_s for p in settled.points() if p.decode_seqs and not p.prefill_tokens} == {1.0}
        assert 2.0 in {p.step_time_s for p in unsettled.points() if p.decode_seqs and not p.prefill_tokens}
        assert settled.metadata()["decode_settle"] == "3"

    def test_rejects_a_bad_decode_settle(self) -> None:
        """decode_settle is a count of runs."""
        for bad in (-1, 1.5, True):
            with pytest.raises(InvalidArgumentError, match="decode_settle"):
                Profiler(TimedExecutor(), num_pages=128, page_size=4, decode_settle=bad)  # type: ignore[arg-type]

    def test_spread_is_the_run_to_run_floor(self) -> None:
        """Two runs of 1.0 and 1.5: |a - b| / b is 0.5 one way and 1/3 the other; a steady executor has none."""
        durations = itertools.cycle([1.0] * 25 + [1.5] * 25)
        profiler = Profiler(
            TimedExecutor(law=lambda plan: next(durations)), num_pages=128, page_size=4, decode_settle=0
        )
        assert np.isnan(profiler.spread())
        profiler.run_pass()
        profiler.run_pass()
        assert profiler.spread() == pytest.approx((0.5 + 1 / 3) / 2)
        steady = Profiler(TimedExecutor(), num_pages=128, page_size=4)
        steady.run_pass(repeats=2)
        assert steady.spread() == 0.0

    def test_points_before_any_pass(self) -> None:
        """Asking for the profile before measuring is a typed error."""
        with pytest.raises(ProfilingError, match="run_pass"):
            Profiler(TimedExecutor(), num_pages=128, page_size=4).points()

    def test_declared_batching_reaches_the_csv_and_the_model(self, tmp_path: Path) -> None:
        """The executor's declaration is recorded in the CSV and read back by from_csv; cost_model uses it too."""
        profiler = Profiler(PaddingExecutor(), num_pages=128, page_size=4)
        profiler.run_pass()
        assert profiler.cost_model().decode_batching == DecodeBatching.longest()
        path = tmp_path / "padded.csv"
        profiler.write_csv(path, {"executor": "padding"})
        metadata = read_profile_csv(path)[1]
        assert metadata["executor"] == "padding"
        assert metadata["decode_batching"] == DecodeBatching.longest().to_metadata()
        assert metadata["decode_batching_declared"] == "yes"
        assert ProfiledCostModel.from_csv(path).decode_batching == DecodeBatching.longest()

    def test_undeclared_executor_is_profiled_as_ragged(self, tmp_path: Path) -> None:
        """Without a declaration the profile says so and reads decodes at their mean context."""
        profiler = Profiler(TimedExecutor(), num_pages=128, page_size=4)
        profiler.run_pass()
        assert profiler.decode_batching is None
        assert profiler.metadata()["decode_batching_declared"].startswith("no")
        assert profiler.cost_model().decode_batching == RAGGED

    def test_explicit_batching_overrides_the_declaration(self) -> None:
        """A batching passed in wins over what the executor declares."""
        bucketed = DecodeBatching(bucket_ratio=0.5)
        profiler = Profiler(PaddingExecutor(), num_pages=128, page_size=4, decode_batching=bucketed)
        profiler.run_pass()
        assert profiler.cost_model().decode_batching == bucketed

    def test_padded_profile_predicts_a_padding_executor(self) -> None:
        """Profiled on uniform steps, the model prices an uneven step as the padding executor runs it."""

        def padded_law(plan: StepPlan) -> float:
            decode = plan.is_decode
            longest = float(plan.kv_len[decode].max()) if decode.any() else 0.0
            return 1e-3 + 2e-5 * int(plan.num_new[~decode].sum()) + 1e-8 * int(decode.sum()) * longest

        profiler = Profiler(PaddingExecutor(law=padded_law), num_pages=128, page_size=4)
        profiler.run_pass()
        model = profiler.cost_model()
        num_new, kv_len = np.array([1, 1, 1]), np.array([60, 20, 16])
        assert model.step_time(num_new, kv_len) == pytest.approx(1e-3 + 1e-8 * 3 * 60, rel=1e-9)
        mean_reading = attrs.evolve(model, decode_batching=RAGGED)
        assert mean_reading.step_time(num_new, kv_len) == pytest.approx(1e-3 + 1e-8 * 3 * 32, rel=1e-9)
