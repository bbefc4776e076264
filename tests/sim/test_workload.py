"""Workloads, length distributions, arrival processes and the workload builders."""

from __future__ import annotations

import inspect
import itertools
import math
import tracemalloc
from collections.abc import Callable
from typing import Any, cast

import attrs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phasesched import Request
from phasesched.sim import (
    ArrivalProcess,
    Burst,
    ClosedLoop,
    Empirical,
    Fixed,
    Gamma,
    GridPoint,
    LengthDist,
    LogNormal,
    Periodic,
    Poisson,
    Uniform,
    Workload,
    fixed,
    grid_points,
    mixed_load,
    synthetic,
)

seeds = st.integers(min_value=0, max_value=2**32)


def small(n: int = 4, **overrides: object) -> Workload:
    columns: dict[str, object] = {
        "arrival_s": np.arange(n, dtype=float),
        "prompt_len": np.arange(1, n + 1) * 10,
        "output_len": np.full(n, 3),
    }
    columns.update(overrides)
    return Workload("small", **columns)  # type: ignore[arg-type]


def count_cv(times: np.ndarray, width: float) -> float:
    counts = np.bincount((times // width).astype(int))[: int(times[-1] // width)]
    return float(counts.std() / counts.mean())


class TestWorkload:
    def test_columns_are_read_only_copies(self) -> None:
        """Arrays are converted to float64/int64 copies that nobody can write."""
        source = np.array([0.0, 1.0])
        w = Workload("w", source, [5, 6], [1, 2])
        source[1] = 99.0
        assert w.arrival_s.tolist() == [0.0, 1.0]
        assert (w.arrival_s.dtype, w.prompt_len.dtype, w.output_len.dtype) == (
            np.dtype(np.float64),
            np.dtype(np.int64),
            np.dtype(np.int64),
        )
        for column in (w.arrival_s, w.prompt_len, w.output_len):
            with pytest.raises(ValueError, match="read-only"):
                column[0] = 1

    @pytest.mark.parametrize(
        ("overrides", "message"),
        [
            ({"prompt_len": [10, 20, 30]}, "prompt_len must be a 1-D array of length 4"),
            ({"output_len": [[1, 2], [3, 4]]}, "output_len must be a 1-D array"),
            ({"arrival_s": [0.0, 2.0, 1.0, 3.0]}, r"non-decreasing, got arrival_s\[2\] = 1.0"),
            ({"arrival_s": [-1.0, 0.0, 1.0, 2.0]}, "start at or after 0"),
            ({"arrival_s": [0.0, math.nan, 1.0, 2.0]}, "finite"),
            ({"arrival_s": [0.0, 1.0, 2.0, math.inf]}, "finite"),
            ({"prompt_len": [10, 0, 30, 40]}, r"prompt_len must be positive, got prompt_len\[1\] = 0"),
            ({"output_len": [1, 1, -2, 1]}, "output_len must be positive"),
            ({"output_len": [1.0, 1.5, 2.0, 1.0]}, "whole numbers"),
            ({"prompt_len": ["a", "b", "c", "d"]}, "must hold integers"),
            ({"priority": [0, 1]}, "priority must be a 1-D array of length 4"),
        ],
    )
    def test_rejects_inconsistent_columns(self, overrides: dict[str, Any], message: str) -> None:
        """Bad lengths, shapes, times or order raise a ValueError that names the column."""
        with pytest.raises(ValueError, match=message):
            small(**overrides)

    def test_whole_floats_and_negative_priorities_are_accepted(self) -> None:
        """Integral floats become int64 lengths; priorities may be any integer."""
        w = small(output_len=[1.0, 2.0, 3.0, 4.0], priority=[-1, 0, 5, 0])
        assert w.output_len.tolist() == [1, 2, 3, 4]
        assert w.priority is not None
        assert w.priority.tolist() == [-1, 0, 5, 0]

    def test_size_duration_and_rate(self) -> None:
        """``rate`` is (N - 1) / span; a burst has infinite rate and a single request none."""
        w = small(5)
        assert (len(w), w.duration_s, w.rate) == (5, 4.0, 1.0)
        assert fixed(3, 8, 8).rate == math.inf
        assert math.isnan(small(1).rate)
        assert small(1).duration_s == 0.0
        assert len(small(0)) == 0

    def test_repr_is_short(self) -> None:
        """The repr summarises instead of printing arrays."""
        assert repr(small(4)) == "Workload(name='small', requests=4, duration_s=3)"

    def test_time_scaled_multiplies_times(self) -> None:
        """A factor of 2 doubles every arrival time and halves the rate; lengths are untouched."""
        w = small(4)
        slow = w.time_scaled(2.0)
        assert slow.arrival_s.tolist() == [0.0, 2.0, 4.0, 6.0]
        assert slow.rate == pytest.approx(w.rate / 2)
        np.testing.assert_array_equal(slow.prompt_len, w.prompt_len)
        with pytest.raises(ValueError, match="factor"):
            w.time_scaled(0.0)

    @given(seed=seeds, target=st.floats(min_value=1e-3, max_value=1e4))
    @settings(max_examples=30, deadline=None)
    def test_scaled_to_rate_hits_the_target(self, seed: int, target: float) -> None:
        """Replaying at a target rate gives exactly that mean rate and keeps the inter-arrival CV."""
        w = synthetic(200, Gamma(3.0, cv=2.0), 16, 16, seed=seed)
        scaled = w.scaled_to_rate(target)
        assert scaled.rate == pytest.approx(target, rel=1e-12)
        gaps, scaled_gaps = np.diff(w.arrival_s), np.diff(scaled.arrival_s)
        assert scaled_gaps.std() / scaled_gaps.mean() == pytest.approx(gaps.std() / gaps.mean(), rel=1e-9)

    def test_scaled_to_rate_needs_a_finite_rate(self) -> None:
        """A burst or a single request has no rate to rescale; a bad target is refused."""
        with pytest.raises(ValueError, match="cannot be rescaled"):
            fixed(4, 8, 8).scaled_to_rate(1.0)
        with pytest.raises(ValueError, match="cannot be rescaled"):
            small(1).scaled_to_rate(1.0)
        with pytest.raises(ValueError, match="requests_per_s"):
            small(4).scaled_to_rate(-1.0)

    def test_head(self) -> None:
        """``head(n)`` keeps the first n rows (all if there are fewer)."""
        w = small(5, priority=[4, 3, 2, 1, 0])
        assert w.head(2).prompt_len.tolist() == [10, 20]
        assert w.head(2).priority.tolist() == [4, 3]  # type: ignore[union-attr]
        assert len(w.head(0)) == 0
        assert len(w.head(99)) == 5
        with pytest.raises(ValueError, match="n >= 0"):
            w.head(-1)

    def test_window_selects_and_rebases(self) -> None:
        """``window(t0, t1)`` keeps arrivals in [t0, t1) and moves t0 to time 0."""
        w = Workload("w", [0.0, 1.0, 1.5, 2.0, 3.0], [1, 2, 3, 4, 5], [1, 1, 1, 1, 1])
        part = w.window(1.0, 3.0)
        assert part.arrival_s.tolist() == [0.0, 0.5, 1.0]
        assert part.prompt_len.tolist() == [2, 3, 4]
        assert w.window(2.5).prompt_len.tolist() == [5]
        assert w.window(2.5).arrival_s.tolist() == [0.5]
        assert len(w.window(10.0, 20.0)) == 0
        with pytest.raises(ValueError, match="t0 <= t1"):
            w.window(2.0, 1.0)

    def test_clip_lengths(self) -> None:
        """Lengths are capped, no row is dropped, and a cap below 1 is refused."""
        w = small(4)
        clipped = w.clip_lengths(max_prompt=25, max_output=2)
        assert clipped.prompt_len.tolist() == [10, 20, 25, 25]
        assert clipped.output_len.tolist() == [2, 2, 2, 2]
        assert w.clip_lengths().prompt_len.tolist() == w.prompt_len.tolist()
        with pytest.raises(ValueError, match="max_output"):
            w.clip_lengths(max_output=0)


class TestRequests:
    def test_rows_become_length_only_requests(self) -> None:
        """Row i becomes request f"{prefix}{i}" with exact output length and its arrival time."""
        w = small(3, priority=[2, 0, 1])
        requests = list(w.requests(prefix="q"))
        assert requests[1] == Request(
            "q1", prompt_len=20, max_new_tokens=3, ignore_eos=True, arrival_time=1.0, priority=0
        )
        assert [r.request_id for r in requests] == ["q0", "q1", "q2"]
        assert [r.priority for r in requests] == [2, 0, 1]
        assert all(type(r.prompt_len) is int and type(r.arrival_time) is float for r in requests)
        assert all(not r.has_token_ids for r in requests)

    def test_without_priorities_requests_get_zero(self) -> None:
        """A workload without a priority column yields priority-0 requests."""
        assert {r.priority for r in small(3).requests()} == {0}

    def test_ids_continue_across_chunks(self) -> None:
        """Ids and values stay aligned across the internal conversion chunks."""
        w = fixed(3000, 7, 2, rate=100.0)
        requests = list(w.requests())
        assert [r.request_id for r in requests[1022:1026]] == ["r1022", "r1023", "r1024", "r1025"]
        assert requests[2999].arrival_time == pytest.approx(29.99)

    def test_requests_are_produced_lazily(self) -> None:
        """Asking for the iterator builds nothing; taking three rows of a million converts one small chunk.

        (How fast that is depends on the machine: ``benchmarks/speed_checks.py`` times it.)
        """
        w = fixed(1_000_000, 16, 16, rate=1000.0)
        iterator = w.requests()
        assert inspect.isgenerator(iterator)
        tracemalloc.start()
        try:
            # isgenerator() narrows the iterator to a generator of object; its items are still Requests.
            first = cast("list[Request]", list(itertools.islice(iterator, 3)))
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert [r.request_id for r in first] == ["r0", "r1", "r2"]
        assert peak < 1_000_000  # a million Requests would take about 300 MB

    def test_memory_stays_flat_while_iterating(self) -> None:
        """Streaming 30,000 requests peaks far below what holding them all would take."""
        w = synthetic(30_000, Poisson(100.0), LogNormal(500, 1.0), Uniform(1, 100), seed=0)
        tracemalloc.start()
        try:
            count = sum(1 for _ in w.requests())
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert count == 30_000
        assert peak < 1_000_000  # holding 30,000 Requests takes about 9 MB


class TestLengthDists:
    def test_all_satisfy_the_protocol(self) -> None:
        """The built-in distributions are LengthDists."""
        for dist in (Fixed(3), Uniform(1, 4), LogNormal(10, 1.0), Empirical([1, 2])):
            assert isinstance(dist, LengthDist)

    @given(seed=seeds, lo=st.integers(1, 10_000), width=st.integers(0, 10_000), n=st.integers(0, 300))
    @settings(max_examples=40, deadline=None)
    def test_uniform_stays_in_bounds(self, seed: int, lo: int, width: int, n: int) -> None:
        """Uniform draws int64 values in [lo, hi], both ends included."""
        x = Uniform(lo, lo + width).sample(np.random.default_rng(seed), n)
        assert x.dtype == np.int64
        assert x.shape == (n,)
        assert np.all((x >= lo) & (x <= lo + width))

    def test_uniform_reaches_both_ends(self) -> None:
        """Both endpoints are drawn."""
        assert set(Uniform(3, 5).sample(np.random.default_rng(0), 200).tolist()) == {3, 4, 5}

    def test_fixed(self) -> None:
        """Fixed repeats its value and refuses lengths below 1."""
        assert Fixed(np.int64(7)).sample(np.random.default_rng(0), 2).tolist() == [7, 7]
        with pytest.raises(ValueError, match="value"):
            Fixed(0)

    def test_lognormal_median_and_clipping(self) -> None:
        """LogNormal is parametrised by its median, and clipped to [lo, hi]."""
        x = LogNormal(2000, 1.0, lo=64, hi=8192).sample(np.random.default_rng(1), 50_000)
        assert np.median(x) == pytest.approx(2000, rel=0.03)
        assert (x.min(), x.max()) == (64, 8192)

    def test_lognormal_from_mean(self) -> None:
        """``from_mean`` matches the mean of the unclipped distribution."""
        dist = LogNormal.from_mean(300.0, 0.8)
        assert dist.median == pytest.approx(300.0 * math.exp(-0.32))
        assert dist.sample(np.random.default_rng(2), 200_000).mean() == pytest.approx(300.0, rel=0.02)

    def test_lognormal_zero_sigma_is_constant(self) -> None:
        """Sigma 0 gives the rounded median every time."""
        assert set(LogNormal(99.6, 0.0).sample(np.random.default_rng(0), 10).tolist()) == {100}

    @pytest.mark.parametrize(
        ("build", "message"),
        [
            (lambda: Uniform(5, 4), "lo <= hi"),
            (lambda: Uniform(0, 4), "lo"),
            (lambda: LogNormal(0, 1.0), "median"),
            (lambda: LogNormal(10, -1.0), "sigma"),
            (lambda: LogNormal(10, 1.0, lo=8, hi=4), "lo <= hi"),
            (lambda: Empirical([]), "non-empty"),
            (lambda: Empirical([3, 0]), "positive"),
        ],
    )
    def test_rejects_bad_parameters(self, build: Callable[[], object], message: str) -> None:
        """Impossible parameters fail at construction."""
        with pytest.raises(ValueError, match=message):
            build()

    def test_empirical_resamples_observed_values(self) -> None:
        """Empirical draws only values it was given, with their frequencies."""
        values = np.array([10, 10, 10, 500])
        x = Empirical(values).sample(np.random.default_rng(0), 40_000)
        assert set(x.tolist()) == {10, 500}
        assert np.mean(x == 500) == pytest.approx(0.25, abs=0.01)

    def test_negative_count_is_refused(self) -> None:
        """Sampling -1 values is an error, not an empty array."""
        with pytest.raises(ValueError, match="negative"):
            Fixed(1).sample(np.random.default_rng(0), -1)


class TestArrivalProcesses:
    @pytest.mark.parametrize("process", [Poisson(5.0), Gamma(5.0, 3.0), Burst(), Periodic(5.0)])
    @given(seed=seeds, n=st.integers(0, 200))
    @settings(max_examples=20, deadline=None)
    def test_times_start_at_zero_and_never_decrease(self, process: ArrivalProcess, seed: int, n: int) -> None:
        """Every process returns n non-decreasing float64 times, the first at 0."""
        assert isinstance(process, ArrivalProcess)
        t = process.sample(np.random.default_rng(seed), n)
        assert t.shape == (n,)
        assert t.dtype == np.float64
        assert n == 0 or t[0] == 0.0
        assert np.all(np.diff(t) >= 0)

    def test_poisson_rate_and_cv(self) -> None:
        """Poisson gaps have mean 1 / rate and CV 1."""
        t = Poisson(4.0).sample(np.random.default_rng(0), 100_000)
        gaps = np.diff(t)
        assert gaps.mean() == pytest.approx(0.25, rel=0.02)
        assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.03)

    @pytest.mark.parametrize("cv", [0.5, 1.0, 4.0])
    def test_gamma_gap_cv_matches(self, cv: float) -> None:
        """Gamma gaps keep the mean 1 / rate and have the requested CV."""
        gaps = np.diff(Gamma(2.0, cv).sample(np.random.default_rng(3), 200_000))
        assert gaps.mean() == pytest.approx(0.5, rel=0.05)
        assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.05)

    def test_burstier_gamma_gives_higher_count_cv(self) -> None:
        """At one mean rate, cv=4 arrivals bunch up: per-second counts vary far more than Poisson's."""
        calm = Gamma(10.0, 1.0).sample(np.random.default_rng(7), 20_000)
        bursty = Gamma(10.0, 4.0).sample(np.random.default_rng(7), 20_000)
        assert count_cv(calm, 1.0) == pytest.approx(1 / math.sqrt(10), rel=0.15)  # Poisson counts
        assert count_cv(bursty, 1.0) > 2 * count_cv(calm, 1.0)

    def test_burst_and_periodic(self) -> None:
        """Burst puts everything at 0; Periodic spaces arrivals 1 / rate apart."""
        rng = np.random.default_rng(0)
        assert Burst().sample(rng, 3).tolist() == [0.0, 0.0, 0.0]
        assert Periodic(0.5).sample(rng, 3).tolist() == [0.0, 2.0, 4.0]

    @pytest.mark.parametrize("build", [lambda: Poisson(0.0), lambda: Gamma(1.0, 0.0), lambda: Periodic(math.inf)])
    def test_rejects_bad_rates(self, build: Callable[[], object]) -> None:
        """Rates and CVs must be positive and finite."""
        with pytest.raises(ValueError, match="positive finite"):
            build()


class TestSynthetic:
    @given(seed=seeds)
    @settings(max_examples=20, deadline=None)
    def test_same_seed_same_workload(self, seed: int) -> None:
        """Two builds with one seed are identical, array for array."""
        build: Callable[[], Workload] = lambda: synthetic(
            50, Gamma(2.0, 2.0), LogNormal(800, 1.0), Uniform(1, 300), seed=seed
        )
        a, b = build(), build()
        for column in ("arrival_s", "prompt_len", "output_len"):
            np.testing.assert_array_equal(getattr(a, column), getattr(b, column))

    def test_different_seeds_differ(self) -> None:
        """Another seed gives other draws."""
        a = synthetic(50, Poisson(1.0), Uniform(1, 10**6), 4, seed=1)
        b = synthetic(50, Poisson(1.0), Uniform(1, 10**6), 4, seed=2)
        assert not np.array_equal(a.prompt_len, b.prompt_len)
        assert not np.array_equal(a.arrival_s, b.arrival_s)

    def test_lengths_do_not_depend_on_arrivals(self) -> None:
        """Changing only the arrival process keeps every length (paired comparisons)."""
        poisson = synthetic(100, Poisson(3.0), LogNormal(900, 1.0), Uniform(1, 500), seed=9)
        bursty = synthetic(100, Gamma(3.0, 5.0), LogNormal(900, 1.0), Uniform(1, 500), seed=9)
        np.testing.assert_array_equal(poisson.prompt_len, bursty.prompt_len)
        np.testing.assert_array_equal(poisson.output_len, bursty.output_len)

    def test_int_lengths_mean_fixed(self) -> None:
        """An int stands for Fixed; other objects are refused."""
        w = synthetic(3, Burst(), 128, 4)
        assert w.prompt_len.tolist() == [128] * 3
        assert w.name == "synthetic-n3-seed0"
        with pytest.raises(TypeError, match="LengthDist"):
            synthetic(3, Burst(), "128", 4)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="seed"):
            synthetic(3, Burst(), 1, 1, seed=-1)

    def test_fixed_builder(self) -> None:
        """``fixed`` is a burst by default and evenly spaced at a rate."""
        assert fixed(2, 64, 8).arrival_s.tolist() == [0.0, 0.0]
        w = fixed(4, 64, 8, rate=2.0)
        assert w.arrival_s.tolist() == [0.0, 0.5, 1.0, 1.5]
        assert (w.rate, w.name) == (2.0, "fixed-p64-o8-2rps")


class TestMixedLoad:
    def test_structure(self) -> None:
        """N short requests at 0, then the long one last, at its arrival time."""
        w = mixed_load(8, 32, 256, long_prompt=16_384, long_arrival_s=0.25, long_output=4)
        assert len(w) == 9
        assert w.arrival_s.tolist() == [0.0] * 8 + [0.25]
        assert w.prompt_len.tolist() == [32] * 8 + [16_384]
        assert w.output_len.tolist() == [256] * 8 + [4]
        assert list(w.requests())[-1].request_id == "r8"

    def test_long_request_is_last_even_at_time_zero(self) -> None:
        """When the long prompt arrives with the short ones it still comes last."""
        w = mixed_load(3, Uniform(10, 20), Uniform(50, 60), long_prompt=5000, long_arrival_s=0.0, seed=4)
        assert w.arrival_s.tolist() == [0.0] * 4
        assert int(np.argmax(w.prompt_len)) == 3
        assert w.output_len[3] == 1

    def test_short_lengths_are_seeded(self) -> None:
        """Sampled short lengths repeat for a seed and match synthetic's for that seed."""
        a = mixed_load(20, LogNormal(100, 1.0), Uniform(1, 90), 9000, 1.0, seed=5)
        b = synthetic(20, Burst(), LogNormal(100, 1.0), Uniform(1, 90), seed=5)
        np.testing.assert_array_equal(a.prompt_len[:20], b.prompt_len)
        np.testing.assert_array_equal(a.output_len[:20], b.output_len)

    def test_no_short_requests_is_the_baseline(self) -> None:
        """num_short=0 is the long prompt alone."""
        w = mixed_load(0, 8, 8, long_prompt=4096, long_arrival_s=0.5)
        assert (len(w), w.prompt_len.tolist()) == (1, [4096])

    def test_rejects_bad_arrival(self) -> None:
        """The long request's arrival time must be finite and >= 0."""
        with pytest.raises(ValueError, match="long_arrival_s"):
            mixed_load(2, 8, 8, long_prompt=4096, long_arrival_s=-1.0)


class TestClosedLoop:
    def test_lengths_are_deterministic(self) -> None:
        """The same spec gives the same lengths; the seed changes them."""
        spec = ClosedLoop(32, 500, LogNormal(1000, 1.0), Uniform(1, 400), seed=3)
        p1, o1 = spec.lengths()
        p2, o2 = attrs.evolve(spec).lengths()
        np.testing.assert_array_equal(p1, p2)
        np.testing.assert_array_equal(o1, o2)
        assert (p1.shape, p1.dtype, o1.dtype) == ((500,), np.dtype(np.int64), np.dtype(np.int64))
        p3, _ = attrs.evolve(spec, seed=4).lengths()
        assert not np.array_equal(p1, p3)

    def test_matches_the_open_loop_lengths(self) -> None:
        """A closed loop sends the lengths synthetic() would for that seed."""
        spec = ClosedLoop(8, 100, LogNormal(700, 0.7), Uniform(1, 64), seed=11)
        open_loop = synthetic(100, Poisson(1.0), LogNormal(700, 0.7), Uniform(1, 64), seed=11)
        prompt, output = spec.lengths()
        np.testing.assert_array_equal(prompt, open_loop.prompt_len)
        np.testing.assert_array_equal(output, open_loop.output_len)

    def test_as_workload_has_placeholder_arrivals(self) -> None:
        """``as_workload`` carries the lengths with arrival times all 0."""
        w = ClosedLoop(2, 3, 10, 20).as_workload()
        assert w.arrival_s.tolist() == [0.0, 0.0, 0.0]
        assert w.prompt_len.tolist() == [10, 10, 10]

    @pytest.mark.parametrize(
        "kwargs",
        [{"concurrency": 0}, {"num_requests": 0}, {"think_time_s": -1.0}, {"think_time_s": math.inf}, {"seed": -1}],
    )
    def test_rejects_bad_parameters(self, kwargs: dict[str, Any]) -> None:
        """Concurrency and request counts are positive; think time finite and >= 0."""
        base = {"concurrency": 1, "num_requests": 1, "prompt": 1, "output": 1}
        with pytest.raises(ValueError):
            ClosedLoop(**{**base, **kwargs})


class TestGrid:
    def test_default_grid(self) -> None:
        """The seed grid has 4 x 3 x 4 points, prompt length outermost."""
        points = list(grid_points())
        assert len(points) == 48
        assert len(set(points)) == 48
        assert points[0] == GridPoint(128, 32, 1)
        assert points[1] == GridPoint(128, 32, 8)
        assert points[-1] == GridPoint(16384, 1024, 128)

    def test_point_as_closed_loop(self) -> None:
        """A grid point becomes a fixed-length closed loop at its concurrency."""
        spec = GridPoint(1024, 256, 32).closed_loop(num_requests=64)
        assert (spec.concurrency, spec.num_requests) == (32, 64)
        prompt, output = spec.lengths()
        assert set(prompt.tolist()) == {1024}
        assert set(output.tolist()) == {256}
        assert GridPoint(1024, 256, 32).name == "p1024-o256-c32"

    def test_rejects_non_positive_values(self) -> None:
        """Every coordinate is a positive integer."""
        with pytest.raises(ValueError, match="concurrency"):
            GridPoint(1, 1, 0)
