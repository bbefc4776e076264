"""The lockstep check can fail: every planted kernel-call bug fails it on the CPU stand-in."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
import torch

pytest.importorskip("phasesched_flashinfer", reason="install executors/flashinfer")

from phasesched_flashinfer import FlashInferExecutor
from phasesched_flashinfer._check import (
    FLOOR_FACTOR,
    LockstepReport,
    calibrated_lockstep,
    cast_model,
    check_workloads,
)
from phasesched_flashinfer._planted import PLANTED_BUGS, plant
from phasesched_torch import LlamaModel
from tests.executors.flashinfer import fake_flashinfer
from tests.executors.flashinfer.helpers import CPU_MODEL, FAKE

NUM_PAGES, PAGE_SIZE = 64, 4


def _run(dtype: torch.dtype, bug: str | None) -> LockstepReport:
    """The check's calibrated lockstep of the stand-in executor, with ``bug`` planted (or none)."""
    model = LlamaModel.random(CPU_MODEL, seed=3, dtype=dtype, std=0.05)
    kernels = FAKE if bug is None else plant(FAKE, bug)
    candidate = FlashInferExecutor(model, num_pages=NUM_PAGES, page_size=PAGE_SIZE, kernels=kernels)
    workloads = check_workloads(CPU_MODEL.vocab_size, chunked_prompts=(3, 9, 21, 40), chunk_size=8)
    return calibrated_lockstep(model, candidate, workloads, num_pages=NUM_PAGES, page_size=PAGE_SIZE)


class TestCalibratedLockstep:
    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
    def test_correct_calls_pass_well_inside_the_tolerance(self, dtype: torch.dtype) -> None:
        """Without a bug the stand-in stays within half the tolerance, and few rows are near ties."""
        report = _run(dtype, None)
        assert report.passed, report
        assert report.floor is not None
        assert report.floor > 0
        assert report.rel_tol == pytest.approx(FLOOR_FACTOR * report.floor)
        assert report.max_rel_logit_diff <= report.rel_tol / 2
        assert report.near_tie_share <= 0.2, report

    def test_flashinfer_rounding_stays_well_inside_the_tolerance(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """With FlashInfer's rounding emulated (bf16 probabilities into PV) it stays under half the tolerance."""
        monkeypatch.setattr(fake_flashinfer._Planned, "run", fake_flashinfer.flashinfer_rounding)
        report = _run(torch.bfloat16, None)
        assert report.passed, report
        assert report.max_rel_logit_diff > 0
        assert report.max_rel_logit_diff <= report.rel_tol / 2, report

    def test_decode_only_steps_come_first_and_short(self) -> None:
        """The workloads reach a decode-only step right after the first prefill, over caches of a few tokens."""
        report = _run(torch.bfloat16, None)
        assert report.first_decode_only_step == 1
        assert report.min_decode_context is not None
        assert report.min_decode_context <= 3
        assert report.mixed_steps > 0
        assert report.decode_only_steps >= 7

    def test_float32_weights_are_the_same_weights(self) -> None:
        """The float32 reference holds exactly the low-precision weights, upcast."""
        model = LlamaModel.random(CPU_MODEL, seed=3, dtype=torch.bfloat16)
        wide = cast_model(model, torch.float32)
        assert wide.dtype == torch.float32
        assert torch.equal(wide.weights.layers[1].qkv, model.weights.layers[1].qkv.float())
        assert torch.equal(wide.weights.lm_head, model.weights.lm_head.float())


class TestPlantedBugs:
    @pytest.mark.parametrize("bug", PLANTED_BUGS)
    def test_each_bug_fails_the_check(self, bug: str) -> None:
        """A plausible kernel-call bug moves logits by many tolerances: the comparison fails."""
        report = _run(torch.bfloat16, bug)
        assert not report.passed
        assert report.max_rel_logit_diff > 4 * report.rel_tol, report

    def test_unknown_bug(self) -> None:
        """Planting a bug that does not exist is refused, naming the known ones."""
        with pytest.raises(ValueError, match="decode_kv_len_minus_one"):
            plant(FAKE, "off_by_two")
