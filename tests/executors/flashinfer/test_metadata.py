"""StepPlan -> FlashInfer metadata, held against the torch reference's own indexing (CPU)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
import torch

pytest.importorskip("phasesched_flashinfer", reason="install executors/flashinfer")

import functools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from phasesched import StepPlan
from phasesched_flashinfer import (
    MetadataTensors,
    StepMetadata,
    pack_metadata,
    pad_decode,
    pick_bucket,
    step_metadata,
)
from phasesched_torch import (
    LlamaConfig,
    LlamaModel,
    TorchAttention,
    TorchExecutor,
    append_paged_kv_cache,
    kv_write_slots,
    paged_attention,
)
from tests.executors.flashinfer.helpers import step_plans

TINY = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4, num_kv_heads=2)


@functools.cache
def _reference(page_size: int) -> TorchExecutor:
    return TorchExecutor(LlamaModel.random(TINY, seed=0), num_pages=1, page_size=page_size)


def _t(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(array))


def _reference_batch(plan: StepPlan) -> tuple[TorchAttention, torch.Tensor, torch.Tensor]:
    """What the torch executor derives from ``plan`` (prepare only reads the plan and the model)."""
    batch = _reference(plan.page_size).prepare(plan)
    assert isinstance(batch.attention, TorchAttention)
    return batch.attention, batch.input_ids, batch.sample_rows


class TestStepMetadata:
    @given(step_plans())
    @settings(max_examples=60, deadline=None)
    def test_write_slots_match_the_torch_executor(self, plan: StepPlan) -> None:
        """Each row's (slice, position) lands in the slot the torch executor writes."""
        meta = step_metadata(plan)
        attention, input_ids, sample_rows = _reference_batch(plan)
        pages, offsets = kv_write_slots(
            _t(meta.batch_indices), _t(meta.positions), _t(meta.kv_indices), _t(meta.kv_indptr), plan.page_size
        )
        assert torch.equal(pages, attention.write_slots[0])
        assert torch.equal(offsets, attention.write_slots[1])
        assert meta.input_ids.tolist() == input_ids.tolist()
        assert meta.sample_rows.tolist() == sample_rows.tolist()

    @given(step_plans())
    @settings(max_examples=60, deadline=None)
    def test_positions_follow_flashinfers_append_rule(self, plan: StepPlan) -> None:
        """Row i of slice b is at kv_len[b] - (qo_indptr[b + 1] - i), as get_batch_indices_positions computes."""
        meta = step_metadata(plan)
        b = meta.batch_indices
        expected = meta.kv_len[b] - (meta.qo_indptr[b + 1] - np.arange(meta.num_tokens))
        assert meta.positions.tolist() == expected.tolist()
        assert meta.kv_len.tolist() == plan.kv_len.tolist()
        assert meta.batch_indices.tolist() == np.repeat(np.arange(plan.batch_size), plan.num_new).tolist()

    @given(step_plans())
    @settings(max_examples=30, deadline=None)
    def test_attention_on_converted_metadata_equals_the_plans(self, plan: StepPlan) -> None:
        """The converted metadata describes the same attention problem as the plan's own arrays."""
        meta = step_metadata(plan)
        num_pages = int(plan.kv_indices.max()) + 1
        generator = torch.Generator().manual_seed(0)
        cache = torch.randn(num_pages, 2, plan.page_size, 2, 8, generator=generator)
        q = torch.randn(plan.num_tokens, 4, 8, generator=generator)
        host = MetadataTensors.view(torch.from_numpy(pack_metadata(meta)), meta)
        ours, _ = paged_attention(q, cache, host.qo_indptr, host.kv_indptr, host.kv_indices, host.kv_last_page_len)
        want, _ = paged_attention(q, cache, plan.qo_indptr, plan.kv_indptr, plan.kv_indices, plan.kv_last_page_len)
        torch.testing.assert_close(ours, want, atol=0, rtol=0)

    @given(step_plans())
    @settings(max_examples=40, deadline=None)
    def test_every_row_is_int32_and_contiguous(self, plan: StepPlan) -> None:
        """The kernels take int32 arrays; none may alias the plan's read-only arrays."""
        meta = step_metadata(plan)
        for name in (
            "qo_indptr",
            "kv_indptr",
            "kv_indices",
            "kv_last_page_len",
            "batch_indices",
            "positions",
            "input_ids",
            "sample_rows",
        ):
            array = getattr(meta, name)
            assert array.dtype == np.int32, name
            assert array.flags.c_contiguous, name

    def test_empty_or_idless_plans_are_rejected(self) -> None:
        """Only a non-empty plan with token ids has kernel metadata."""
        from phasesched import Scheduler, SchedulerConfig  # noqa: PLC0415

        with pytest.raises(ValueError, match="non-empty"):
            step_metadata(Scheduler(SchedulerConfig(num_pages=4, page_size=4)).schedule())


class TestPacking:
    @given(step_plans(), st.integers(0, 50))
    @settings(max_examples=40, deadline=None)
    def test_round_trip_through_one_buffer(self, plan: StepPlan, slack: int) -> None:
        """Every segment reads back from its view of one packed int32 buffer, whatever its spare room."""
        meta = step_metadata(plan)
        packed = pack_metadata(meta)
        buffer = torch.zeros(len(packed) + slack, dtype=torch.int32)
        buffer[: len(packed)] = torch.from_numpy(packed)
        views = MetadataTensors.view(buffer, meta)
        for name in (
            "qo_indptr",
            "kv_indptr",
            "kv_indices",
            "kv_last_page_len",
            "batch_indices",
            "positions",
            "input_ids",
            "sample_rows",
        ):
            assert getattr(views, name).tolist() == getattr(meta, name).tolist(), name
            assert getattr(views, name).is_contiguous(), name

    def test_view_rejects_a_wrong_buffer(self) -> None:
        """A buffer of another dtype, rank or too small a size is refused, not misread."""
        meta = step_metadata(_decode_plan())
        size = len(pack_metadata(meta))
        for bad in (
            torch.zeros(size, dtype=torch.int64),
            torch.zeros(1, size, dtype=torch.int32),
            torch.zeros(size - 1, dtype=torch.int32),
        ):
            with pytest.raises(ValueError, match="int32 buffer"):
                MetadataTensors.view(bad, meta)


def _decode_plan() -> StepPlan:
    from tests.executors.torch.helpers import synthetic_plan  # noqa: PLC0415

    return synthetic_plan([5, 17], [1, 1], [[3, 1], [0, 4, 2, 5, 6]], page_size=4)


class TestDecodePadding:
    @given(step_plans(decode_only=True), st.integers(0, 7))
    @settings(max_examples=40, deadline=None)
    def test_padding_leaves_real_slices_alone(self, plan: StepPlan, extra: int) -> None:
        """Real rows attend exactly as unpadded; padding rows write only the scratch page."""
        meta = step_metadata(plan)
        scratch = int(plan.kv_indices.max()) + 1
        padded = pad_decode(meta, meta.batch_size + extra, scratch)
        assert padded.is_decode_only
        assert padded.batch_size == meta.batch_size + extra
        assert padded.num_real == meta.batch_size
        assert padded.sample_rows.tolist() == list(range(padded.batch_size))
        generator = torch.Generator().manual_seed(1)
        cache = torch.randn(scratch + 1, 2, plan.page_size, 2, 8, generator=generator)
        q = torch.randn(padded.batch_size, 4, 8, generator=generator)
        k = torch.randn(padded.batch_size, 2, 8, generator=generator)
        real = slice(0, meta.batch_size)
        unpadded_cache, padded_cache = cache.clone(), cache.clone()
        _append(unpadded_cache, k[real], meta)
        _append(padded_cache, k, padded)
        assert torch.equal(padded_cache[:scratch], unpadded_cache[:scratch])
        assert (extra == 0) == torch.equal(padded_cache[scratch], cache[scratch])
        want, _ = paged_attention(
            q[real], unpadded_cache, meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len
        )
        got, _ = paged_attention(
            q, padded_cache, padded.qo_indptr, padded.kv_indptr, padded.kv_indices, padded.kv_last_page_len
        )
        torch.testing.assert_close(got[real], want, atol=1e-6, rtol=1e-6)

    def test_only_decode_steps_that_fit_are_padded(self) -> None:
        """A step with a multi-row slice, or more slices than the bucket, cannot be padded."""
        from tests.executors.torch.helpers import synthetic_plan  # noqa: PLC0415

        mixed = step_metadata(synthetic_plan([0, 5], [3, 1], [[0], [1, 2]], page_size=4))
        with pytest.raises(ValueError, match="cannot pad"):
            pad_decode(mixed, 8, 9)
        decode = step_metadata(_decode_plan())
        with pytest.raises(ValueError, match="cannot pad"):
            pad_decode(decode, 1, 9)

    @pytest.mark.parametrize(("size", "bucket"), [(1, 1), (2, 2), (3, 4), (16, 16), (17, 32), (256, 256), (257, None)])
    def test_pick_bucket(self, size: int, bucket: int | None) -> None:
        """A step takes the smallest bucket that holds it, none past the largest."""
        assert pick_bucket(size, (1, 2, 4, 8, 16, 32, 64, 128, 256)) == bucket


def _append(cache: torch.Tensor, k: torch.Tensor, meta: StepMetadata) -> None:
    append_paged_kv_cache(
        k,
        -k,
        _t(meta.batch_indices),
        _t(meta.positions),
        cache,
        _t(meta.kv_indices),
        _t(meta.kv_indptr),
        _t(meta.kv_last_page_len),
    )
