"""Streaming distributions: exact while small, bounded-error histograms past the limit."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phasesched.metrics import Distribution


class TestDistribution:
    def test_exact_percentiles_match_numpy(self) -> None:
        """While exact, percentiles are numpy's linear percentiles."""
        values = np.random.default_rng(0).exponential(0.02, 5000)
        d = Distribution()
        d.add_many(values)
        assert d.is_exact
        assert d.percentiles([50, 90, 99]).tolist() == np.percentile(values, [50, 90, 99]).tolist()
        assert d.mean == pytest.approx(values.mean())
        assert d.std == pytest.approx(values.std())
        assert (d.min, d.max, d.count) == (values.min(), values.max(), 5000)

    def test_histogram_keeps_relative_accuracy(self) -> None:
        """Past the exact limit, percentiles stay within the bucket resolution of the truth."""
        values = np.random.default_rng(1).lognormal(-4, 1, 50_000)
        d = Distribution(exact_limit=1000, relative_resolution=1e-3)
        d.add_many(values)
        assert not d.is_exact
        for q in (1, 50, 90, 99, 99.9):
            truth = np.percentile(values, q, method="inverted_cdf")
            assert d.percentile(q) == pytest.approx(truth, rel=2e-3)
        assert d.count == 50_000
        assert d.max == values.max()

    def test_memory_stays_flat(self) -> None:
        """Millions of samples occupy a fixed number of buckets."""
        d = Distribution(exact_limit=1000)
        rng = np.random.default_rng(2)
        for _ in range(20):
            d.add_many(rng.uniform(1e-3, 1.0, 100_000))
        d.percentile(50)
        assert d._buckets is not None
        assert d._buckets.nbytes < 512 * 1024

    def test_weighted_adds_equal_repeated_adds(self) -> None:
        """add_many with counts records each value that many times."""
        weighted, repeated = Distribution(), Distribution()
        weighted.add_many([0.1, 0.2], [3, 1])
        repeated.add_many([0.1, 0.1, 0.1, 0.2])
        assert weighted.percentiles([25, 50, 75, 100]).tolist() == repeated.percentiles([25, 50, 75, 100]).tolist()
        assert weighted.count == 4

    def test_empty(self) -> None:
        """An empty distribution answers nan, not an error."""
        d = Distribution()
        assert d.count == 0
        assert math.isnan(d.mean)
        assert math.isnan(d.percentile(99))
        assert math.isnan(d.summary()["max"])

    def test_merge(self) -> None:
        """Merging two distributions gives the distribution of all their samples."""
        a, b, both = Distribution(exact_limit=100), Distribution(exact_limit=100), Distribution(exact_limit=100)
        rng = np.random.default_rng(3)
        x, y = rng.uniform(0.01, 1, 300), rng.uniform(0.01, 1, 50)
        a.add_many(x)
        b.add_many(y)
        both.add_many(np.concatenate([x, y]))
        a.merge(b)
        assert a.count == both.count
        assert a.percentiles([10, 50, 90]).tolist() == both.percentiles([10, 50, 90]).tolist()

    def test_cdf_is_monotone(self) -> None:
        """The CDF used for plots rises from the minimum to the maximum."""
        d = Distribution()
        d.add_many(np.random.default_rng(4).exponential(1.0, 1000))
        values, fractions = d.cdf(50)
        assert np.all(np.diff(values) >= 0)
        assert fractions[0] == 0.0
        assert fractions[-1] == 1.0
        assert values[-1] == d.max


@given(st.lists(st.floats(1e-6, 10.0), min_size=1, max_size=300), st.integers(1, 50))
@settings(deadline=None, max_examples=50)
def test_order_and_batching_do_not_matter(values: list[float], split: int) -> None:
    """The same multiset gives the same percentiles however it was added."""
    one, many = Distribution(exact_limit=64), Distribution(exact_limit=64)
    one.add_many(values)
    for i in range(0, len(values), split):
        many.add_many(values[i : i + split][::-1])
    assert one.percentiles([0, 50, 99, 100]).tolist() == many.percentiles([0, 50, 99, 100]).tolist()
    assert one.count == many.count


def test_merge_into_an_empty_distribution_keeps_the_spread() -> None:
    """Merging a histogram into an empty distribution gives the source's standard deviation."""
    source, empty = Distribution(exact_limit=10), Distribution(exact_limit=10)
    values = np.random.default_rng(5).uniform(0.0, 1.0, 500)
    source.add_many(values)
    empty.merge(source)
    assert empty.std == pytest.approx(values.std(), rel=1e-9)
    assert empty.count == 500
