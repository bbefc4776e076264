"""Decode batching: how an executor lays out decodes, and the profiled model reading steps with it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from phasesched.costmodel import (
    RAGGED,
    DecodeBatching,
    GridCoverage,
    ProfiledCostModel,
    ProfileFormatError,
    ProfilePoint,
    decode_step_times,
    write_profile_csv,
)
from phasesched.costmodel.batching import decode_batching_from_metadata, decode_batching_of
from phasesched.errors import InvalidArgumentError
from phasesched.sim import SimulatedExecutor

# A torch-like layout with a small gather cap, so the cap binds in short tests.
BUCKETED = DecodeBatching(bucket_ratio=0.75, bucket_tokens=400)


def linear_grid(contexts: tuple[int, ...] = (16, 256)) -> list[ProfilePoint]:
    """A hand-made profile: decode-only time 1 ms + 1 us per decode-context token; prefill adds 10 us a token."""
    return [
        ProfilePoint(p, 0, d, c, 1e-3 + 1e-5 * p + 1e-6 * d * c) for p in (0, 64) for d in (0, 1, 8) for c in contexts
    ]


def law(decodes: int, context: float, prefill: int = 0) -> float:
    return 1e-3 + 1e-5 * prefill + 1e-6 * decodes * context


class TestDecodeBatching:
    def test_buckets_by_hand(self) -> None:
        """Sorted longest first; a bucket takes contexts within the ratio of its leader, up to the token cap."""
        contexts = np.array([30, 100, 40, 90, 95, 80])
        buckets = DecodeBatching(bucket_ratio=0.75).buckets(contexts)
        assert [contexts[b].tolist() for b in buckets] == [[100, 95, 90, 80], [40, 30]]
        capped = DecodeBatching(bucket_ratio=0.75, bucket_tokens=200).buckets(contexts)  # 2 rows of <= 100
        assert [contexts[b].tolist() for b in capped] == [[100, 95], [90, 80], [40, 30]]

    def test_padded_tokens(self) -> None:
        """Ragged reads the sum, padded the longest times the count, bucketed each bucket's longest."""
        contexts = np.array([100, 80, 20])
        assert RAGGED.padded_tokens(contexts) == 200
        assert DecodeBatching.longest().padded_tokens(contexts) == 300
        assert DecodeBatching(bucket_ratio=0.75).padded_tokens(contexts) == 220

    def test_batch_padding_only_for_decode_only_steps(self) -> None:
        """CUDA-graph sizes pad a decode-only batch (one-token padding slices); mixed and oversized steps run as is."""
        graphs = DecodeBatching(batch_sizes=(1, 4, 8))
        assert graphs.decode_features(np.array([10, 20, 30])) == (4, 61 / 4)
        assert graphs.decode_features(np.array([10, 20, 30]), decode_only=False) == (3, 20.0)
        assert graphs.decode_features(np.full(9, 10)) == (9, 10.0)

    @pytest.mark.parametrize(
        "batching",
        [RAGGED, DecodeBatching.longest(), BUCKETED, DecodeBatching(bucket_ratio=0.5, batch_sizes=(2, 16))],
    )
    def test_metadata_round_trip(self, batching: DecodeBatching) -> None:
        """to_metadata reads back to the same layout."""
        assert DecodeBatching.from_metadata(batching.to_metadata()) == batching

    @pytest.mark.parametrize("text", ["", "ragged", "bucket_ratio=x bucket_tokens= batch_sizes=", "bucket_ratio=2"])
    def test_bad_metadata(self, text: str) -> None:
        """Anything but the documented form is a typed error."""
        with pytest.raises(InvalidArgumentError, match="decode_batching"):
            DecodeBatching.from_metadata(text)

    @pytest.mark.parametrize(
        "kwargs", [{"bucket_ratio": 1.5}, {"bucket_ratio": -0.1}, {"bucket_tokens": 0}, {"batch_sizes": (4, 2)}]
    )
    def test_rejects_bad_fields(self, kwargs: dict[str, object]) -> None:
        """Ratio in [0, 1], a positive cap, increasing positive batch sizes."""
        with pytest.raises(InvalidArgumentError):
            DecodeBatching(**kwargs)  # type: ignore[arg-type]

    @given(
        contexts=st.lists(st.integers(1, 600), min_size=1, max_size=12),
        ratio=st.sampled_from([0.0, 0.5, 0.75, 0.9, 1.0]),
        tokens=st.sampled_from([None, 1, 200, 1000]),
        num_steps=st.integers(0, 300),
    )
    def test_run_features_equal_step_by_step(
        self, contexts: list[int], ratio: float, tokens: int | None, num_steps: int
    ) -> None:
        """The run of k decode steps has, step for step, the features of pricing each step alone."""
        batching = DecodeBatching(bucket_ratio=ratio, bucket_tokens=tokens, batch_sizes=(4, 16))
        ctx = np.array(contexts)
        seqs, run = batching.decode_run_features(ctx, num_steps)
        expected = [batching.decode_features(ctx + j) for j in range(num_steps)]
        assert all(seqs == s for s, _ in expected)
        assert run.tolist() == [c for _, c in expected]


class TestProfiledModelReadsTheDeclaredBatching:
    """A hand-made profile where the mean and the padded context disagree: the prediction follows the declaration."""

    NUM_NEW = np.array([1, 1, 1])
    KV_LEN = np.array([100, 80, 20])  # mean 66.7, longest 100, buckets [100, 80] + [20]: 73.3

    @pytest.mark.parametrize(
        ("batching", "context"),
        [(RAGGED, 200 / 3), (DecodeBatching.longest(), 100.0), (DecodeBatching(bucket_ratio=0.75), 220 / 3)],
    )
    def test_decode_step(self, batching: DecodeBatching, context: float) -> None:
        """Three decodes are priced at the declared effective context (the law is linear, so exactly)."""
        model = ProfiledCostModel(linear_grid(), decode_batching=batching)
        assert model.step_time(self.NUM_NEW, self.KV_LEN) == pytest.approx(law(3, context), rel=1e-12)

    def test_mixed_step(self) -> None:
        """Beside a prefill slice the decodes are read the same way."""
        model = ProfiledCostModel(linear_grid(), decode_batching=DecodeBatching.longest())
        num_new, kv_len = np.array([1, 1, 32]), np.array([100, 20, 32])
        assert model.step_time(num_new, kv_len) == pytest.approx(law(2, 100.0, prefill=32), rel=1e-12)

    def test_padded_is_dearer_than_mean_on_uneven_contexts(self) -> None:
        """The two readings of one step differ, in the direction padding implies."""
        ragged = ProfiledCostModel(linear_grid())
        padded = ProfiledCostModel(linear_grid(), decode_batching=DecodeBatching.longest())
        assert padded.step_time(self.NUM_NEW, self.KV_LEN) > ragged.step_time(self.NUM_NEW, self.KV_LEN)
        even = np.array([50, 50, 50])
        assert padded.step_time(self.NUM_NEW, even) == ragged.step_time(self.NUM_NEW, even)

    @given(
        contexts=st.lists(st.integers(1, 500), min_size=1, max_size=10),
        num_steps=st.integers(0, 200),
        batching=st.sampled_from([RAGGED, DecodeBatching.longest(), BUCKETED, DecodeBatching(batch_sizes=(2, 8))]),
    )
    def test_fast_forward_equals_stepping(self, contexts: list[int], num_steps: int, batching: DecodeBatching) -> None:
        """decode_step_times prices a run exactly as step_time prices each step (the DecodeFastForward contract)."""
        model = ProfiledCostModel(linear_grid(), decode_batching=batching, step_overhead_s=1e-4)
        ctx = np.array(contexts)
        ones = np.ones_like(ctx)
        expected = [model.step_time(ones, ctx + j) for j in range(num_steps)]
        assert decode_step_times(model, ctx, num_steps).tolist() == expected

    def test_coverage_counts_with_the_declared_features(self) -> None:
        """GridCoverage reads steps as its model does: padding beyond the grid counts as outside."""
        coverage = GridCoverage(ProfiledCostModel(linear_grid((16, 64)), decode_batching=DecodeBatching.longest()))
        coverage.step_time(np.array([1, 1]), np.array([100, 20]))  # mean 60 is inside, longest 100 is not
        coverage.decode_step_times(np.array([20, 20]), 3)
        assert (coverage.outside, coverage.predictions) == (1, 4)
        assert coverage.decode_batching == DecodeBatching.longest()


class TestProfileCsv:
    def test_old_profile_reads_at_the_mean_context(self, tmp_path: Path) -> None:
        """A profile without a decode_batching line (an old one) loads and prices by the mean context, as before."""
        path = tmp_path / "old.csv"
        write_profile_csv(path, linear_grid(), {"executor": "torch"})
        assert "decode_batching" not in path.read_text()
        model = ProfiledCostModel.from_csv(path)
        assert model.decode_batching == RAGGED
        assert model.step_time(np.array([1, 1, 1]), np.array([100, 80, 20])) == pytest.approx(law(3, 200 / 3))

    def test_recorded_batching_is_used(self, tmp_path: Path) -> None:
        """A profile's decode_batching line decides how the loaded model reads steps."""
        path = tmp_path / "padded.csv"
        write_profile_csv(path, linear_grid(), {"decode_batching": DecodeBatching.longest().to_metadata()})
        model = ProfiledCostModel.from_csv(path)
        assert model.decode_batching == DecodeBatching.longest()
        assert model.step_time(np.array([1, 1]), np.array([100, 20])) == pytest.approx(law(2, 100.0))

    def test_malformed_batching_line(self, tmp_path: Path) -> None:
        """A decode_batching line that does not parse is a ProfileFormatError naming the file."""
        path = tmp_path / "bad.csv"
        write_profile_csv(path, linear_grid(), {"decode_batching": "padded please"})
        with pytest.raises(ProfileFormatError, match=r"bad\.csv.*decode_batching"):
            ProfiledCostModel.from_csv(path)

    def test_from_metadata_absent_is_none(self) -> None:
        """No key: None (the caller reads the profile as ragged and may say so)."""
        assert decode_batching_from_metadata({"executor": "torch"}) is None


class TestDeclarations:
    def test_simulated_executor_declares_its_cost_model(self) -> None:
        """A simulated executor on a profiled table declares the table's batching; on the roofline, ragged."""
        padded = ProfiledCostModel(linear_grid(), decode_batching=DecodeBatching.longest())
        assert decode_batching_of(SimulatedExecutor(padded)) == DecodeBatching.longest()
        assert decode_batching_of(SimulatedExecutor(GridCoverage(padded))) == DecodeBatching.longest()
        from phasesched.costmodel import RooflineCostModel  # noqa: PLC0415

        assert decode_batching_of(SimulatedExecutor(RooflineCostModel.from_names())) == RAGGED

    def test_undeclared_is_none(self) -> None:
        """An object without the attribute declares nothing."""
        assert decode_batching_of(object()) is None

    def test_a_wrong_declaration_is_refused(self) -> None:
        """A decode_batching that is not a DecodeBatching is a typed error, not silently ragged."""

        class Liar:
            decode_batching = "padded"

        with pytest.raises(InvalidArgumentError, match="must be a DecodeBatching"):
            decode_batching_of(Liar())
