"""The roofline cost model: hand-computed step times, monotonicity, the decode fast path."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phasesched.costmodel import (
    CostModel,
    DecodeFastForward,
    RooflineCostModel,
    causal_pairs,
    decode_step_times,
    hardware_by_name,
)
from phasesched.errors import UnknownNameError

# Llama-3-8B, by hand: matmul parameters in the layers and in the LM head; bytes a step streams.
LAYERS_8B = 6_979_321_856
HEAD_8B = 525_336_576
WEIGHTS_8B = 2 * (LAYERS_8B + HEAD_8B)
KV_8B = 131_072  # bytes per token: 2 (K, V) x 32 layers x 8 heads x 128 x 2 bytes
PAIR_FLOPS_8B = 4 * 32 * 32 * 128  # QK^T and PV over 32 layers of 32 heads of 128
H200_FLOPS = 989e12 * 0.7
H200_ATTENTION = 989e12 * 0.5
H200_BYTES = 4.8e12 * 0.8


def ones(n: int) -> np.ndarray:
    return np.ones(n, dtype=np.int64)


def arr(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


@pytest.fixture
def h200_8b() -> RooflineCostModel:
    return RooflineCostModel.from_names("H200", "llama-3-8b")


class TestHandComputed:
    def test_batch_1_decode_is_bound_by_weight_streaming(self, h200_8b: RooflineCostModel) -> None:
        """A batch-1 decode takes at least weights / bandwidth, and within 1.5x of it."""
        floor = WEIGHTS_8B / 4.8e12
        t = h200_8b.step_time(ones(1), arr(1024))
        assert floor <= t <= 1.5 * floor

    def test_batch_1_decode_value(self, h200_8b: RooflineCostModel) -> None:
        """The batch-1 decode time equals the hand-computed weight + KV streaming + overhead."""
        expected = WEIGHTS_8B / H200_BYTES + KV_8B * (1024 + 1) / H200_BYTES + 0.5e-3
        assert h200_8b.step_time(ones(1), arr(1024)) == pytest.approx(expected, rel=1e-12)

    def test_first_512_token_chunk_compute(self, h200_8b: RooflineCostModel) -> None:
        """A 512-token prompt chunk's FLOPs over peak x efficiency, per component, by hand."""
        b = h200_8b.breakdown(arr(512), arr(512))
        assert b.linear_compute_s == pytest.approx((2 * LAYERS_8B * 512 + 2 * HEAD_8B) / H200_FLOPS, rel=1e-12)
        assert b.attention_compute_s == pytest.approx(PAIR_FLOPS_8B * (512 * 513 // 2) / H200_ATTENTION, rel=1e-12)
        assert b.linear_s == b.linear_compute_s  # 512 tokens: compute-bound on H200
        expected = b.linear_compute_s + b.attention_compute_s + 0.5e-3
        assert h200_8b.step_time(arr(512), arr(512)) == pytest.approx(expected, rel=1e-12)

    def test_later_chunk_attends_to_its_prefix(self, h200_8b: RooflineCostModel) -> None:
        """A 512-token chunk after 1,536 cached tokens computes 1536*512 + 512*513/2 pairs."""
        b = h200_8b.breakdown(arr(512), arr(2048))
        assert b.attention_compute_s == pytest.approx(PAIR_FLOPS_8B * 917_760 / H200_ATTENTION, rel=1e-12)
        assert b.attention_memory_s == pytest.approx(KV_8B * (2048 + 512) / H200_BYTES, rel=1e-12)

    def test_whole_16k_prefill(self, h200_8b: RooflineCostModel) -> None:
        """A 16,384-token prompt in one step: compute-bound linear layers plus causal attention."""
        n = 16_384
        linear = (2 * LAYERS_8B * n + 2 * HEAD_8B) / H200_FLOPS
        attention = PAIR_FLOPS_8B * (n * (n + 1) // 2) / H200_ATTENTION
        assert h200_8b.step_time(arr(n), arr(n)) == pytest.approx(linear + attention + 0.5e-3, rel=1e-12)

    def test_large_decode_batch_reads_every_context(self, h200_8b: RooflineCostModel) -> None:
        """256 decodes at context 1,024 stream 256 x 1,025 tokens of KV."""
        b = h200_8b.breakdown(ones(256), np.full(256, 1024))
        assert b.attention_memory_s == pytest.approx(KV_8B * 256 * 1025 / H200_BYTES, rel=1e-12)
        assert b.linear_memory_s == pytest.approx(WEIGHTS_8B / H200_BYTES, rel=1e-12)

    def test_tensor_parallel_all_reduce(self) -> None:
        """TP8 adds two ring all-reduces per layer: 2(p-1)/p x tokens x hidden x 2 bytes, plus latency."""
        model = RooflineCostModel.from_names("H100-SXM", "llama-3-70b", tensor_parallel=8)
        b = model.breakdown(ones(4), np.full(4, 2048))
        one = 2 * 7 / 8 * (4 * 8192 * 2) / (450e9 * 0.8) + 8e-6
        assert b.allreduce_s == pytest.approx(2 * 80 * one, rel=1e-12)
        assert b.linear_memory_s == pytest.approx(139_003_428_864 / 8 / (3.35e12 * 0.8), rel=1e-12)
        kv_per_gpu = 2 * 80 * 1 * 128 * 2
        assert b.attention_memory_s == pytest.approx(kv_per_gpu * 4 * 2049 / (3.35e12 * 0.8), rel=1e-12)

    def test_no_all_reduce_without_tensor_parallelism(self, h200_8b: RooflineCostModel) -> None:
        """TP1 has no all-reduce term."""
        assert h200_8b.breakdown(arr(512), arr(512)).allreduce_s == 0.0

    def test_tensor_parallelism_speeds_up_a_decode(self) -> None:
        """Sharding 70B over more GPUs shortens a decode step (weights per GPU shrink)."""
        times = [
            RooflineCostModel.from_names("H100-SXM", "llama-3-70b", tensor_parallel=tp).step_time(
                ones(8), np.full(8, 1024)
            )
            for tp in (2, 4, 8)
        ]
        assert times[0] > times[1] > times[2]

    def test_empty_step_takes_no_time(self, h200_8b: RooflineCostModel) -> None:
        """No slices, no step: zero seconds, not the overhead."""
        assert h200_8b.step_time(arr(), arr()) == 0.0

    def test_overrides_replace_hardware_defaults(self) -> None:
        """Efficiencies default to the hardware's and can be overridden by keyword."""
        default = RooflineCostModel.from_names("A100-80GB", "llama-3-8b")
        assert default.compute_efficiency == hardware_by_name("A100-80GB").compute_efficiency
        slower = RooflineCostModel.from_names("A100-80GB", "llama-3-8b", compute_efficiency=0.375)
        assert slower.breakdown(arr(512), arr(512)).linear_compute_s == pytest.approx(
            2 * default.breakdown(arr(512), arr(512)).linear_compute_s, rel=1e-12
        )

    def test_kv_capacity(self, h200_8b: RooflineCostModel) -> None:
        """KV tokens that fit at 90% of 139.81 GiB beside the weights, vLLM's activation and non-torch reserves."""
        reserve = 2 * 8_030_261_248 + 1024 * 128256 * 38.7 + 0.13 * 2**30
        assert h200_8b.kv_capacity_tokens() == int((0.9 * 139.81 * 2**30 - reserve) // (16 * KV_8B)) * 16
        assert RooflineCostModel.from_names("A100-80GB", "llama-3-70b").kv_capacity_tokens() == 0

    def test_rejects_tensor_parallel_not_dividing_heads(self) -> None:
        """TP3 cannot shard 32 heads."""
        with pytest.raises(ValueError, match="tensor_parallel=3"):
            RooflineCostModel.from_names("H200", "llama-3-8b", tensor_parallel=3)

    def test_rejects_unknown_names(self) -> None:
        """Unknown preset names raise the typed error."""
        with pytest.raises(UnknownNameError, match="H200"):
            RooflineCostModel.from_names("TPU-v5", "llama-3-8b")

    @pytest.mark.parametrize(("num_new", "kv_len"), [((1, 2), (5,)), ((0,), (5,)), ((6,), (5,))])
    def test_rejects_malformed_batches(
        self, h200_8b: RooflineCostModel, num_new: tuple[int, ...], kv_len: tuple[int, ...]
    ) -> None:
        """Mismatched shapes, empty slices and contexts shorter than the slice are errors."""
        with pytest.raises(ValueError, match="num_new"):
            h200_8b.step_time(arr(*num_new), arr(*kv_len))

    def test_is_a_cost_model_with_fast_path(self, h200_8b: RooflineCostModel) -> None:
        """The roofline satisfies both Protocols."""
        assert isinstance(h200_8b, CostModel)
        assert isinstance(h200_8b, DecodeFastForward)


class TestCausalPairs:
    @given(st.lists(st.tuples(st.integers(1, 300), st.integers(0, 300)), min_size=1, max_size=8))
    def test_equals_the_sum_over_query_tokens(self, slices: list[tuple[int, int]]) -> None:
        """Token i of n at context L sees L - n + i + 1 keys; the closed form agrees."""
        num_new = arr(*(n for n, _ in slices))
        kv_len = num_new + arr(*(p for _, p in slices))
        brute = [sum(int(kv) - int(n) + i + 1 for i in range(int(n))) for n, kv in zip(num_new, kv_len, strict=True)]
        assert causal_pairs(num_new, kv_len).tolist() == brute


MODELS = [
    RooflineCostModel.from_names("H200", "llama-3-8b"),
    RooflineCostModel.from_names("H100-SXM", "llama-3-70b", tensor_parallel=8),
    RooflineCostModel.from_names("A100-80GB", "llama-3-8b", tensor_parallel=2),
]
batches = st.lists(st.tuples(st.integers(1, 4096), st.integers(0, 16384)), min_size=1, max_size=48)
growth = st.integers(1, 2048)


def batch_arrays(slices: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    num_new = arr(*(n for n, _ in slices))
    return num_new, num_new + arr(*(p for _, p in slices))


class TestBreakdown:
    @pytest.mark.parametrize("model", MODELS, ids=["8b-h200", "70b-h100-tp8", "8b-a100-tp2"])
    @given(slices=batches)
    @settings(max_examples=40)
    def test_step_time_is_the_breakdowns_total_to_the_bit(
        self, model: RooflineCostModel, slices: list[tuple[int, int]]
    ) -> None:
        """step_time sums the terms without a breakdown, in the breakdown's order: the same float."""
        num_new, kv_len = batch_arrays(slices)
        assert model.step_time(num_new, kv_len) == model.breakdown(num_new, kv_len).total_s


class TestMonotone:
    @pytest.mark.parametrize("model", MODELS, ids=["8b-h200", "70b-h100-tp8", "8b-a100-tp2"])
    @given(slices=batches, k=growth, data=st.data())
    @settings(max_examples=40)
    def test_more_tokens_never_faster(
        self, model: RooflineCostModel, slices: list[tuple[int, int]], k: int, data: st.DataObject
    ) -> None:
        """Extending a slice by k tokens (its context grows with it) never shortens the step."""
        num_new, kv_len = batch_arrays(slices)
        i = data.draw(st.integers(0, len(slices) - 1))
        more_new, more_kv = num_new.copy(), kv_len.copy()
        more_new[i] += k
        more_kv[i] += k
        assert model.step_time(more_new, more_kv) >= model.step_time(num_new, kv_len)

    @pytest.mark.parametrize("model", MODELS, ids=["8b-h200", "70b-h100-tp8", "8b-a100-tp2"])
    @given(slices=batches, k=growth, data=st.data())
    @settings(max_examples=40)
    def test_more_context_never_faster(
        self, model: RooflineCostModel, slices: list[tuple[int, int]], k: int, data: st.DataObject
    ) -> None:
        """A longer cached prefix for one slice never shortens the step."""
        num_new, kv_len = batch_arrays(slices)
        i = data.draw(st.integers(0, len(slices) - 1))
        longer = kv_len.copy()
        longer[i] += k
        assert model.step_time(num_new, longer) >= model.step_time(num_new, kv_len)

    @pytest.mark.parametrize("model", MODELS, ids=["8b-h200", "70b-h100-tp8", "8b-a100-tp2"])
    @given(slices=batches, data=st.data())
    @settings(max_examples=40)
    def test_computing_more_of_a_fixed_context_never_faster(
        self, model: RooflineCostModel, slices: list[tuple[int, int]], data: st.DataObject
    ) -> None:
        """Recomputing cached tokens (more query tokens, same context) never shortens the step."""
        num_new, kv_len = batch_arrays(slices)
        i = data.draw(st.integers(0, len(slices) - 1))
        more = num_new.copy()
        more[i] = data.draw(st.integers(int(num_new[i]), int(kv_len[i])))
        assert model.step_time(more, kv_len) >= model.step_time(num_new, kv_len)

    @pytest.mark.parametrize("model", MODELS, ids=["8b-h200", "70b-h100-tp8", "8b-a100-tp2"])
    @given(slices=batches, extra=st.tuples(st.integers(1, 4096), st.integers(0, 16384)))
    @settings(max_examples=40)
    def test_another_slice_never_faster(
        self, model: RooflineCostModel, slices: list[tuple[int, int]], extra: tuple[int, int]
    ) -> None:
        """Adding a slice to the batch never shortens the step."""
        num_new, kv_len = batch_arrays(slices)
        more_new, more_kv = batch_arrays([*slices, extra])
        assert model.step_time(more_new, more_kv) >= model.step_time(num_new, kv_len)


class LinearCost:
    """A cost model without the fast path: a millisecond plus a microsecond per token."""

    def step_time(self, num_new: np.ndarray, kv_len: np.ndarray) -> float:
        return 1e-3 + 1e-6 * float(np.sum(num_new)) + 1e-9 * float(np.sum(kv_len))


class TestDecodeFastForward:
    @pytest.mark.parametrize("model", MODELS, ids=["8b-h200", "70b-h100-tp8", "8b-a100-tp2"])
    @given(kv_len=st.lists(st.integers(1, 200_000), max_size=64), num_steps=st.integers(0, 40))
    @settings(max_examples=40)
    def test_equals_stepping_one_by_one(self, model: RooflineCostModel, kv_len: list[int], num_steps: int) -> None:
        """The vectorized durations equal step_time on each step's contexts, exactly."""
        ctx = arr(*kv_len)
        fast = model.decode_step_times(ctx, num_steps)
        slow = [model.step_time(ones(len(ctx)), ctx + j) for j in range(num_steps)]
        assert fast.dtype == np.float64
        assert fast.shape == (num_steps,)
        assert fast.tolist() == slow

    def test_helper_uses_the_fast_path(self) -> None:
        """The module helper returns what the model's own decode_step_times returns."""

        class Spy(LinearCost):
            def decode_step_times(self, kv_len: np.ndarray, num_steps: int) -> np.ndarray:
                return np.full(num_steps, 42.0)

        assert decode_step_times(Spy(), arr(5, 6), 3).tolist() == [42.0, 42.0, 42.0]

    def test_helper_loops_without_fast_path(self) -> None:
        """Without the fast path the helper prices each step with step_time."""
        model = LinearCost()
        assert not isinstance(model, DecodeFastForward)
        got = decode_step_times(model, arr(10, 20), 3)
        assert got.tolist() == [model.step_time(ones(2), arr(10, 20) + j) for j in range(3)]

    def test_helper_rejects_negative_steps(self, h200_8b: RooflineCostModel) -> None:
        """A negative step count is an error."""
        with pytest.raises(ValueError, match="num_steps"):
            decode_step_times(h200_8b, arr(10), -1)

    @pytest.mark.parametrize(("kv_len", "num_steps", "words"), [((0, 5), 2, "kv_len"), ((5,), -1, "num_steps")])
    def test_fast_path_rejects_bad_arguments(
        self, h200_8b: RooflineCostModel, kv_len: tuple[int, ...], num_steps: int, words: str
    ) -> None:
        """An empty context or a negative step count is an error, not an empty answer."""
        with pytest.raises(ValueError, match=words):
            h200_8b.decode_step_times(arr(*kv_len), num_steps)

    def test_contexts_grow_by_one_per_step(self, h200_8b: RooflineCostModel) -> None:
        """Each later decode step reads B more tokens of KV than the one before."""
        times = h200_8b.decode_step_times(np.full(64, 1024), 3)
        step = KV_8B * 64 / H200_BYTES
        assert np.diff(times) == pytest.approx([step, step], rel=1e-6)
