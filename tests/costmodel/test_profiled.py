"""The profiled cost model: CSV schema, grid validation, interpolation and extrapolation."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from phasesched.costmodel import (
    CostModel,
    DecodeFastForward,
    ProfiledCostModel,
    ProfileFormatError,
    ProfilePoint,
    RooflineCostModel,
    read_profile_csv,
    step_features,
    write_profile_csv,
)
from phasesched.errors import PhaseschedError

AXES = ((0, 64, 256), (0, 128), (0, 4, 16), (128, 512))


def multilinear(p: float, prefix: float, d: float, c: float) -> float:
    """A step-time law that is linear in each feature, so interpolation must reproduce it."""
    return 1e-3 + 2e-5 * p + 1e-9 * p * prefix + 1e-4 * d + 1e-8 * d * c


def grid_points(
    law: Callable[[int, int, int, int], float] = multilinear, axes: tuple[tuple[int, ...], ...] = AXES
) -> list[ProfilePoint]:
    return [ProfilePoint(p, x, d, c, law(p, x, d, c)) for p, x, d, c in itertools.product(*axes)]


def arr(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


@pytest.fixture
def model() -> ProfiledCostModel:
    return ProfiledCostModel(grid_points())


CSV_TEXT = """# model: llama-3-8b
# device: H200
prefill_tokens,prefill_prefix,decode_seqs,decode_context,step_time_s
0,0,1,128,0.004
16,0,1,128,0.005
"""


class TestProfilePoint:
    @pytest.mark.parametrize(
        "field", ["prefill_tokens", "prefill_prefix", "decode_seqs", "decode_context", "step_time_s"]
    )
    def test_rejects_negative_values(self, field: str) -> None:
        """Every field is non-negative."""
        values: dict[str, Any] = {
            "prefill_tokens": 1,
            "prefill_prefix": 0,
            "decode_seqs": 0,
            "decode_context": 0,
            "step_time_s": 0.1,
            field: -1,
        }
        with pytest.raises(ValueError, match=field):
            ProfilePoint(**values)

    def test_rejects_non_finite_time(self) -> None:
        """A NaN duration is not a measurement."""
        with pytest.raises(ValueError, match="step_time_s"):
            ProfilePoint(0, 0, 1, 128, float("nan"))


class TestCsv:
    def test_round_trip(self, tmp_path: Path) -> None:
        """Points and metadata written come back equal, floats to the last bit."""
        points = [*grid_points(), ProfilePoint(3, 12.5, 2, 100.25, 0.1 + 0.2)]
        path = tmp_path / "profile.csv"
        write_profile_csv(path, points, {"model": "llama-3-8b", "repeats": "5"})
        back, metadata = read_profile_csv(path)
        assert back == points
        assert metadata == {"model": "llama-3-8b", "repeats": "5"}

    def test_reads_the_documented_layout(self, tmp_path: Path) -> None:
        """Metadata lines, a header and rows parse as documented."""
        path = tmp_path / "p.csv"
        path.write_text(CSV_TEXT)
        points, metadata = read_profile_csv(path)
        assert metadata == {"model": "llama-3-8b", "device": "H200"}
        assert points == [ProfilePoint(0, 0, 1, 128, 0.004), ProfilePoint(16, 0, 1, 128, 0.005)]

    def test_column_order_is_free_and_extras_are_ignored(self, tmp_path: Path) -> None:
        """Columns may come in any order, with extra ones and blank lines."""
        path = tmp_path / "p.csv"
        path.write_text(
            "step_time_s,p90_s,decode_context,decode_seqs,prefill_prefix,prefill_tokens\n\n0.5,0.7,64,2,8,16\n"
        )
        points, _ = read_profile_csv(path)
        assert points == [ProfilePoint(16, 8, 2, 64, 0.5)]

    @pytest.mark.parametrize(
        ("row", "words"),
        [
            ("16,0,1,128,fast", "step_time_s"),
            ("16.5,0,1,128,0.1", "prefill_tokens must be an integer"),
            ("16,0,1", "fields"),
            ("16,0,-1,128,0.1", "decode_seqs"),
            ("16,0,1,128,inf", "step_time_s"),
        ],
    )
    def test_malformed_row_names_its_line(self, tmp_path: Path, row: str, words: str) -> None:
        """A bad row raises ProfileFormatError naming line 6 (after 2 metadata lines, a header, 2 rows)."""
        path = tmp_path / "p.csv"
        path.write_text(CSV_TEXT + row + "\n")
        with pytest.raises(ProfileFormatError, match=words) as info:
            read_profile_csv(path)
        assert info.value.line == 6
        assert str(info.value).startswith("line 6:")
        assert isinstance(info.value, PhaseschedError)
        assert isinstance(info.value, ValueError)

    def test_missing_column_names_the_header_line(self, tmp_path: Path) -> None:
        """A header without decode_context is rejected at its line."""
        path = tmp_path / "p.csv"
        path.write_text("# a: b\nprefill_tokens,prefill_prefix,decode_seqs,step_time_s\n1,2,3,4\n")
        with pytest.raises(ProfileFormatError, match="decode_context") as info:
            read_profile_csv(path)
        assert info.value.line == 2

    def test_metadata_below_the_header_rejected(self, tmp_path: Path) -> None:
        """'#' lines are only allowed at the top."""
        path = tmp_path / "p.csv"
        path.write_text(CSV_TEXT + "# late: yes\n")
        with pytest.raises(ProfileFormatError, match="above the header") as info:
            read_profile_csv(path)
        assert info.value.line == 6

    def test_file_without_header_rejected(self, tmp_path: Path) -> None:
        """Metadata alone is not a profile."""
        path = tmp_path / "p.csv"
        path.write_text("# model: x\n")
        with pytest.raises(ProfileFormatError, match="no header"):
            read_profile_csv(path)

    def test_unwritable_metadata_rejected(self, tmp_path: Path) -> None:
        """A key with a colon or a value with a newline would not read back."""
        with pytest.raises(ValueError, match="metadata"):
            write_profile_csv(tmp_path / "p.csv", [], {"a:b": "c"})
        with pytest.raises(ValueError, match="metadata"):
            write_profile_csv(tmp_path / "p.csv", [], {"a": "b\nc"})


class TestGrid:
    def test_missing_point_rejected(self) -> None:
        """A grid with a hole raises ProfileFormatError naming a missing combination."""
        with pytest.raises(ProfileFormatError, match="1 of 36 combinations missing"):
            ProfiledCostModel(grid_points()[1:])

    def test_duplicate_point_rejected(self) -> None:
        """Two rows with the same features are ambiguous."""
        points = grid_points()
        with pytest.raises(ProfileFormatError, match="share the features"):
            ProfiledCostModel([*points, points[7]])

    def test_empty_rejected(self) -> None:
        """A profile needs points."""
        with pytest.raises(ProfileFormatError, match="at least one"):
            ProfiledCostModel([])

    def test_scattered_points_rejected(self) -> None:
        """Points off a common grid (each with its own values) are not a grid."""
        points = [ProfilePoint(16 * i, 0, i, 100 + i, 0.01 * i) for i in range(1, 4)]
        with pytest.raises(ProfileFormatError, match="full grid"):
            ProfiledCostModel(points)

    def test_from_csv(self, tmp_path: Path) -> None:
        """A model read from CSV prices grid points as measured."""
        path = tmp_path / "p.csv"
        write_profile_csv(path, grid_points())
        assert ProfiledCostModel.from_csv(path).interpolate([64, 128, 4, 512]).tolist() == [
            multilinear(64, 128, 4, 512)
        ]

    def test_protocols(self, model: ProfiledCostModel) -> None:
        """The profiled model is a cost model with the decode fast path."""
        assert isinstance(model, CostModel)
        assert isinstance(model, DecodeFastForward)


# Step times in seconds; subnormal ones (below 2e-308) would lose the precision the checks rely on.
step_times = st.floats(0.0, 1.0, allow_subnormal=False)
monotone_values = st.tuples(st.integers(1, 3), st.integers(1, 3), st.integers(1, 3), st.integers(1, 3)).flatmap(
    lambda shape: hnp.arrays(np.float64, shape, elements=step_times)
)


def monotone_grid(increments: np.ndarray) -> ProfiledCostModel:
    """A grid whose values grow along every axis (cumulative sums of non-negative increments)."""
    values = increments
    for dim in range(4):
        values = np.cumsum(values, axis=dim)
    axes = [16 * np.arange(1, n + 1) ** 2 for n in values.shape]  # uneven spacing, starting above 0
    points = [
        ProfilePoint(int(axes[0][i]), axes[1][j], int(axes[2][k]), axes[3][m], values[i, j, k, m])
        for i, j, k, m in itertools.product(*(range(n) for n in values.shape))
    ]
    return ProfiledCostModel(points)


class TestInterpolation:
    @given(monotone_values)
    @settings(max_examples=30)
    def test_exact_at_grid_points(self, increments: np.ndarray) -> None:
        """At every measured point the model returns the measurement, exactly."""
        model = monotone_grid(increments)
        features = np.array([p.features for p in model.points])
        assert model.interpolate(features).tolist() == [p.step_time_s for p in model.points]

    def test_corner_extrapolation_never_raises_measured_values(self) -> None:
        """Extrapolating below two axes at once overshoots here (+1/9); measured values must not follow."""
        increments = np.zeros((1, 1, 2, 2))
        increments[0, 0, 1, 1] = 1.0  # values 0, 0, 0, 1 on a 2 x 2 grid starting above 0
        model = monotone_grid(increments)
        features = np.array([p.features for p in model.points])
        assert model.interpolate(features).tolist() == [0.0, 0.0, 0.0, 1.0]
        assert model.interpolate([16, 16, 0, 0]).tolist() == [0.0]

    def test_linear_between_neighbours(self) -> None:
        """Between two grid points along one axis the time is their linear blend."""
        rng = np.random.default_rng(1)
        model = monotone_grid(rng.random((3, 2, 3, 2)))
        lookup: dict[tuple[float, ...], float] = {p.features: p.step_time_s for p in model.points}
        for low in model.points:
            for dim in range(4):
                axis = sorted({p.features[dim] for p in model.points})
                at = axis.index(low.features[dim])
                if at + 1 == len(axis):
                    continue
                high = list(low.features)
                high[dim] = axis[at + 1]
                for t in (0.25, 0.5, 0.9):
                    x = list(low.features)
                    x[dim] = (1 - t) * axis[at] + t * axis[at + 1]
                    expected = (1 - t) * low.step_time_s + t * lookup[tuple(high)]
                    assert model.interpolate(x)[0] == pytest.approx(expected, rel=1e-12, abs=1e-15)

    def test_multilinear_law_reproduced_everywhere(self, model: ProfiledCostModel) -> None:
        """A law linear in each feature is reproduced inside the grid and beyond it."""
        rng = np.random.default_rng(0)
        queries = rng.uniform(0, 1, (200, 4)) * [1000, 500, 64, 4000]  # well past the grid's edges
        expected = [multilinear(*q) for q in queries]
        assert model.interpolate(queries) == pytest.approx(expected, rel=1e-9)

    def test_linear_extrapolation_along_an_axis(self) -> None:
        """Past the last prefill_tokens value the edge cell's slope continues."""
        model = ProfiledCostModel(grid_points(lambda p, x, d, c: 1e-3 + 1e-5 * p**1.5 + 1e-6 * d * c))
        v_last, v_prev = (model.interpolate([p, 0, 4, 128])[0] for p in (256, 64))
        slope = (v_last - v_prev) / (256 - 64)
        assert model.interpolate([1000, 0, 4, 128])[0] == pytest.approx(v_last + slope * 744, rel=1e-9)

    def test_extrapolation_below_the_grid_is_clamped_at_zero(self) -> None:
        """Below the first context value the line continues down, but never below zero."""
        points = grid_points(lambda p, x, d, c: 1e-3 if c == 128 else 1e-2, axes=((0,), (0,), (1,), (128, 512)))
        model = ProfiledCostModel(points)
        slope = 9e-3 / 384
        assert model.interpolate([0, 0, 1, 100])[0] == pytest.approx(1e-3 - 28 * slope, rel=1e-9)
        assert model.interpolate([0, 0, 1, 50])[0] == 0.0

    def test_single_value_axes_are_constant(self) -> None:
        """An axis measured at one value only holds that value everywhere."""
        model = ProfiledCostModel(grid_points(axes=((0, 64), (0,), (1,), (128,))))
        assert model.interpolate([32, 5000, 1, 9])[0] == pytest.approx(multilinear(32, 0, 1, 128), rel=1e-15)

    def test_monotone_envelope_raises_a_noisy_dip(self) -> None:
        """A measured dip is raised to the value below it; monotone=False keeps the data."""
        law = lambda p, x, d, c: {0: 1.0, 64: 3.0, 256: 2.0}[p]
        points = grid_points(law, axes=((0, 64, 256), (0,), (1,), (128,)))
        assert ProfiledCostModel(points).interpolate([256, 0, 1, 128]).tolist() == [3.0]
        assert ProfiledCostModel(points, monotone=False).interpolate([256, 0, 1, 128]).tolist() == [2.0]

    @given(
        increments=monotone_values,
        start=hnp.arrays(np.float64, 4, elements=st.floats(0, 300)),
        dim=st.integers(0, 3),
        delta=st.floats(0.01, 1e5),
        stretch=hnp.arrays(np.float64, 4, elements=st.sampled_from([1.0, 1.0, 50.0])),
    )
    @settings(max_examples=150)
    def test_monotone_in_every_feature(
        self, increments: np.ndarray, start: np.ndarray, dim: int, delta: float, stretch: np.ndarray
    ) -> None:
        """On monotone data, raising any feature never lowers the time, inside or beyond the grid."""
        model = monotone_grid(increments)
        x = start * stretch  # some coordinates far beyond the grid, several at once
        y = x.copy()
        y[dim] += delta
        low, high = model.interpolate(x)[0], model.interpolate(y)[0]
        assert high >= low - 1e-12 * abs(low)

    @given(
        noise=monotone_values,
        start=hnp.arrays(np.float64, 4, elements=st.floats(0, 2000)),
        dim=st.integers(0, 3),
        delta=st.floats(0.01, 1e4),
    )
    @settings(max_examples=100)
    def test_noisy_data_made_monotone(self, noise: np.ndarray, start: np.ndarray, dim: int, delta: float) -> None:
        """With monotone=True even unordered measurements give a monotone model."""
        axes = [16 * np.arange(1, n + 1) ** 2 for n in noise.shape]
        points = [
            ProfilePoint(int(axes[0][i]), axes[1][j], int(axes[2][k]), axes[3][m], noise[i, j, k, m])
            for i, j, k, m in itertools.product(*(range(n) for n in noise.shape))
        ]
        model = ProfiledCostModel(points)
        y = start.copy()
        y[dim] += delta
        low, high = model.interpolate(start)[0], model.interpolate(y)[0]
        assert high >= low - 1e-12 * abs(low)


class TestStepTime:
    def test_features_of_a_mixed_batch(self) -> None:
        """Decodes are the one-token slices; prefill prefix is token-weighted."""
        features = step_features(arr(1, 1, 100, 300), arr(10, 20, 100, 700))
        assert features.tolist() == [400.0, (100 * 0 + 300 * 400) / 400, 2.0, 15.0]

    def test_features_reject_bad_batches(self) -> None:
        """A slice whose context is shorter than its tokens is an error."""
        with pytest.raises(ValueError, match="kv_len >= num_new"):
            step_features(arr(5), arr(4))

    def test_step_time_is_the_table_at_the_features(self, model: ProfiledCostModel) -> None:
        """A step costs what the law says at its features."""
        num_new, kv_len = arr(100, 1, 1, 1), arr(150, 300, 200, 250)
        assert model.step_time(num_new, kv_len) == pytest.approx(multilinear(100, 50, 3, 250), rel=1e-12)

    def test_empty_step_takes_no_time(self, model: ProfiledCostModel) -> None:
        """No slices, no step."""
        assert model.step_time(arr(), arr()) == 0.0

    @given(kv_len=st.lists(st.integers(2, 100_000), max_size=40), num_steps=st.integers(0, 30))
    @settings(max_examples=50)
    def test_decode_fast_path_equals_stepping(self, kv_len: list[int], num_steps: int) -> None:
        """decode_step_times equals step_time on each step's contexts, exactly."""
        model = ProfiledCostModel(grid_points())
        ctx = arr(*kv_len)
        fast = model.decode_step_times(ctx, num_steps)
        assert fast.shape == (num_steps,)
        assert fast.tolist() == [model.step_time(np.ones(len(ctx), np.int64), ctx + j) for j in range(num_steps)]

    @pytest.mark.parametrize(("kv_len", "num_steps", "words"), [((0, 5), 2, "kv_len"), ((5,), -1, "num_steps")])
    def test_fast_path_rejects_bad_arguments(
        self, model: ProfiledCostModel, kv_len: tuple[int, ...], num_steps: int, words: str
    ) -> None:
        """An empty context or a negative step count is an error, not an empty answer."""
        with pytest.raises(ValueError, match=words):
            model.decode_step_times(arr(*kv_len), num_steps)


def roofline_profile() -> ProfiledCostModel:
    """A profile whose 'measurements' come from the roofline, as a realistic monotone table."""
    roofline = RooflineCostModel.from_names("H200", "llama-3-8b")

    def measured(p: int, prefix: float, d: int, c: float) -> float:
        num_new = arr(*([1] * d + [p] * (p > 0)))
        kv_len = arr(*([int(c)] * d + [int(prefix) + p] * (p > 0)))
        return roofline.step_time(num_new, kv_len) if len(num_new) else 0.0

    axes = ((0, 64, 128, 256, 512, 1024, 2048), (0, 1024, 4096), (0, 1, 16, 64), (128, 1024, 4096))
    return ProfiledCostModel(grid_points(measured, axes))


PROFILE = roofline_profile()
decodes = st.lists(st.integers(2, 8000), max_size=80)
prefill = st.tuples(st.integers(2, 6000), st.integers(0, 10_000))


class TestBatchMonotone:
    @given(decodes=decodes, prefill=prefill, k=st.integers(1, 3000), data=st.data())
    @settings(max_examples=100)
    def test_more_context_never_faster(
        self, decodes: list[int], prefill: tuple[int, int], k: int, data: st.DataObject
    ) -> None:
        """A longer context for any slice never shortens the step."""
        num_new = arr(*([1] * len(decodes)), prefill[0])
        kv_len = arr(*decodes, prefill[0] + prefill[1])
        i = data.draw(st.integers(0, len(num_new) - 1))
        longer = kv_len.copy()
        longer[i] += k
        low, high = PROFILE.step_time(num_new, kv_len), PROFILE.step_time(num_new, longer)
        assert high >= low * (1 - 1e-12)

    @given(decodes=decodes, prefill=prefill, k=st.integers(1, 3000))
    @settings(max_examples=100)
    def test_bigger_chunk_never_faster(self, decodes: list[int], prefill: tuple[int, int], k: int) -> None:
        """Growing the step's prefill chunk (what the SLO chunk sizer searches over) never shortens it."""
        num_new = arr(*([1] * len(decodes)), prefill[0])
        kv_len = arr(*decodes, prefill[0] + prefill[1])
        bigger_new, bigger_kv = num_new.copy(), kv_len.copy()
        bigger_new[-1] += k
        bigger_kv[-1] += k
        low, high = PROFILE.step_time(num_new, kv_len), PROFILE.step_time(bigger_new, bigger_kv)
        assert high >= low * (1 - 1e-12)

    def test_tracks_the_roofline_it_was_measured_from(self) -> None:
        """Off the grid, a profile of the roofline stays within 20% of it (its max() kinks fall between nodes)."""
        roofline = RooflineCostModel.from_names("H200", "llama-3-8b")
        rng = np.random.default_rng(3)
        for _ in range(50):
            d = int(rng.integers(1, 64))
            num_new = arr(*([1] * d), int(rng.integers(2, 2048)))
            kv_len = np.append(np.full(d, int(rng.integers(128, 4096))), num_new[-1] + int(rng.integers(0, 4096)))
            assert PROFILE.step_time(num_new, kv_len) == pytest.approx(roofline.step_time(num_new, kv_len), rel=0.2)


def test_step_overhead_is_added_to_every_non_empty_step() -> None:
    """A profiled model with host overhead adds it to each step, decode runs included, never to an empty step."""
    grid = [
        ProfilePoint(p, 0, d, c, 0.001 + 1e-5 * p + 1e-4 * d + 1e-7 * c)
        for p in (0, 100)
        for d in (0, 10)
        for c in (10, 100)
    ]
    plain, padded = ProfiledCostModel(grid), ProfiledCostModel(grid, step_overhead_s=0.0007)
    num_new, kv_len = np.array([50, 1, 1]), np.array([50, 40, 60])
    assert padded.step_time(num_new, kv_len) == pytest.approx(plain.step_time(num_new, kv_len) + 0.0007)
    assert padded.step_time(np.empty(0, np.int64), np.empty(0, np.int64)) == 0.0
    runs = padded.decode_step_times(np.array([40, 60]), 5)
    assert runs.tolist() == [padded.step_time(np.ones(2, np.int64), np.array([40, 60]) + j) for j in range(5)]
