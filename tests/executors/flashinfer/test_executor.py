"""The executor on the CPU: its plumbing on a FlashInfer stand-in, validation, lazy import, packaging."""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

pytest.importorskip("torch")
import torch

pytest.importorskip("phasesched_flashinfer", reason="install executors/flashinfer")

import attrs
import numpy as np

import phasesched_flashinfer
from phasesched import EXECUTORS, Executor, InvalidPlanError
from phasesched.costmodel import RAGGED, DecodeBatching
from phasesched.costmodel.batching import decode_batching_of
from phasesched_flashinfer import (
    FlashInferAttention,
    FlashInferExecutor,
    FlashInferUnavailableError,
    MetadataStaging,
    create_executor,
    load_flashinfer,
    step_metadata,
)
from phasesched_flashinfer._check import LockstepReport, attention_kernel_check, lockstep_compare
from phasesched_flashinfer._timing import decode_plan, time_decode
from phasesched_torch import LlamaConfig, LlamaModel, PlanNotExecutableError, TorchExecutor, UnsupportedConfigError
from tests.executors.flashinfer import fake_flashinfer
from tests.executors.flashinfer.helpers import (
    CPU_MODEL,
    CPU_MODEL_LLAMA31,
    FAKE,
    chunked_policy,
    executor_pair,
    fake_executor,
    mixed_requests,
)
from tests.executors.torch.helpers import TINY, synthetic_plan

FLASHINFER_IMPORTABLE = importlib.util.find_spec("flashinfer") is not None


class TestAgainstTheTorchExecutor:
    @pytest.mark.parametrize(
        ("config", "dtype", "rope_call"),
        [
            (CPU_MODEL, torch.bfloat16, "rope"),
            (CPU_MODEL, torch.float16, "rope"),
            (CPU_MODEL_LLAMA31, torch.bfloat16, "rope_llama31"),
        ],
    )
    def test_lockstep_tokens_and_logits(self, config: LlamaConfig, dtype: torch.dtype, rope_call: str) -> None:
        """Same plans, same weights: logits within bf16/fp16 noise, tokens equal but at near ties."""
        fake_flashinfer.CALLS.clear()
        reference, candidate = executor_pair(config, dtype, num_pages=64, page_size=4)
        report = lockstep_compare(
            reference,
            candidate,
            mixed_requests((3, 9, 21, 40), 512, max_new_tokens=5),
            chunked_policy(8),
            num_pages=64,
            page_size=4,
            rel_tol=1e-2,
        )
        assert report.passed, report
        assert report.mixed_steps > 0
        assert report.decode_only_steps > 0
        assert report.token_mismatches <= 1, report
        assert fake_flashinfer.CALLS[rope_call] > 0
        assert candidate.backend.path_counts["decode"] == report.decode_only_steps
        assert candidate.backend.path_counts["prefill"] == report.steps - report.decode_only_steps

    def test_plans_once_per_step_and_runs_once_per_layer(self) -> None:
        """A mixed step plans the prefill wrapper once and runs it per layer; a decode step, the decode wrapper."""
        executor = fake_executor(LlamaModel.random(CPU_MODEL, dtype=torch.bfloat16), num_pages=32, page_size=4)
        layers = CPU_MODEL.num_layers
        fake_flashinfer.CALLS.clear()
        executor.execute(synthetic_plan([0, 6], [5, 1], [[0, 1], [2, 3]], page_size=4))
        assert dict(fake_flashinfer.CALLS) == {
            "prefill.plan": 1,
            "prefill.run": layers,
            "rope": layers,
            "append": layers,
        }
        fake_flashinfer.CALLS.clear()
        executor.execute(synthetic_plan([5, 6, 0], [1, 1, 1], [[0, 1], [2, 3], [4]], page_size=4))
        assert dict(fake_flashinfer.CALLS) == {"decode.plan": 1, "decode.run": layers, "rope": layers, "append": layers}

    def test_kv_cache_matches_the_reference(self) -> None:
        """After a step both executors hold the same rotated keys and values in the same slots."""
        reference, candidate = executor_pair(CPU_MODEL, torch.bfloat16, num_pages=16, page_size=4)
        plan = synthetic_plan([0, 3], [7, 2], [[5, 1], [9, 2]], page_size=4)
        reference.execute(plan)
        candidate.execute(plan)
        for ours, want in zip(candidate.kv_cache, reference.kv_cache, strict=True):
            torch.testing.assert_close(ours[:16].float(), want[:16].float(), atol=2e-2, rtol=2e-2)
            assert torch.count_nonzero(ours[16]) == 0  # the scratch page is untouched outside graphs


class TestValidation:
    def test_rejects_float32(self) -> None:
        """FlashInfer's paged kernels take bf16 or fp16; a float32 model is refused before any import."""
        with pytest.raises(UnsupportedConfigError, match="bfloat16 or float16"):
            FlashInferExecutor(LlamaModel.random(CPU_MODEL), num_pages=8, kernels=FAKE)

    def test_rejects_head_dims_without_kernels(self) -> None:
        """head_dim 16 (the torch tiny preset) has no FlashInfer kernel."""
        with pytest.raises(UnsupportedConfigError, match="head_dim 16"):
            FlashInferExecutor(LlamaModel.random(TINY, dtype=torch.bfloat16), num_pages=8, kernels=FAKE)

    def test_rejects_sliding_windows(self) -> None:
        """A Mistral window is refused when the executor is built, before any step could attend past it."""
        config = attrs.evolve(CPU_MODEL, model_type="mistral", sliding_window=8)
        with pytest.raises(UnsupportedConfigError, match="sliding_window=8"):
            FlashInferExecutor(LlamaModel.random(config, dtype=torch.bfloat16), num_pages=8, kernels=FAKE)

    def test_real_kernels_need_a_cuda_model(self) -> None:
        """Without a stand-in, a model on the CPU is refused with FlashInferUnavailableError."""
        with pytest.raises(FlashInferUnavailableError, match="CUDA"):
            FlashInferExecutor(LlamaModel.random(CPU_MODEL, dtype=torch.bfloat16), num_pages=8)

    @pytest.mark.parametrize("sizes", [(), (4, 2), (0, 1)])
    def test_graph_batch_sizes_must_increase(self, sizes: tuple[int, ...]) -> None:
        """Graph buckets are positive and strictly increasing."""
        with pytest.raises(ValueError, match="graph"):
            fake_executor(
                LlamaModel.random(CPU_MODEL, dtype=torch.bfloat16),
                num_pages=8,
                page_size=4,
                use_cuda_graph=True,
                graph_batch_sizes=sizes,
            )

    def test_scratch_page_cannot_be_planned(self) -> None:
        """The extra page graph padding writes lies outside the pages plans may use."""
        executor = fake_executor(LlamaModel.random(CPU_MODEL, dtype=torch.bfloat16), num_pages=8, page_size=4)
        assert executor.scratch_page == 8
        assert executor.kv_cache[0].shape[0] == 9
        with pytest.raises(PlanNotExecutableError, match=r"\(kv_indices\[0\]=8\), outside the cache's 8 pages"):
            executor.execute(synthetic_plan([0], [3], [[8]], page_size=4))
        assert isinstance(PlanNotExecutableError("x"), InvalidPlanError)

    def test_attention_refuses_queries_the_plan_does_not_describe(self) -> None:
        """q of another dtype or row count would be misread by the kernels: a ValueError instead."""
        executor = fake_executor(LlamaModel.random(CPU_MODEL, dtype=torch.bfloat16), num_pages=8, page_size=4)
        batch = executor.prepare(synthetic_plan([0], [3], [[0]], page_size=4))
        attention = batch.attention
        assert isinstance(attention, FlashInferAttention)
        cache = executor.kv_cache[0]
        k = torch.zeros(3, 1, 128, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match="does not fit"):
            attention(torch.zeros(3, 4, 128), k, k, cache)
        with pytest.raises(ValueError, match="does not fit"):
            attention(torch.zeros(2, 4, 128, dtype=torch.bfloat16), k[:2], k[:2], cache)

    @pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
    def test_create_executor_without_cuda(self) -> None:
        """The entry point says plainly that it needs CUDA, before building any weights."""
        with pytest.raises(FlashInferUnavailableError, match="needs a CUDA device"):
            create_executor(model="tiny", device="cpu")
        with pytest.raises(FlashInferUnavailableError, match="needs a CUDA device"):
            create_executor()

    @pytest.mark.parametrize(
        ("jit_env", "explicit", "expected"),
        [
            (None, None, False),  # 2 query heads per kv head: FlashInfer's CUDA-core decode
            ("", None, False),  # empty: FlashInfer compiles (its test is `if os.environ.get(...)`)
            ("0", None, True),  # any other value disables FlashInfer's JIT, "0" and "false" too
            ("false", None, True),
            ("1", None, True),  # JIT disabled (the offline bundle): tensor cores, whose module is prebuilt
            ("1", False, False),  # an explicit choice stands
            (None, True, True),
        ],
    )
    def test_decode_kernel_with_jit_disabled(
        self, monkeypatch: pytest.MonkeyPatch, jit_env: str | None, explicit: bool | None, expected: bool
    ) -> None:
        """A small GQA group decodes on tensor cores when JIT is off: the bundle has no CUDA-core decode module."""
        if jit_env is None:
            monkeypatch.delenv("FLASHINFER_DISABLE_JIT", raising=False)
        else:
            monkeypatch.setenv("FLASHINFER_DISABLE_JIT", jit_env)
        config = attrs.evolve(CPU_MODEL, num_heads=4, num_kv_heads=2)
        executor = fake_executor(
            LlamaModel.random(config, dtype=torch.bfloat16), num_pages=8, page_size=4, decode_tensor_cores=explicit
        )
        assert executor.backend.decode_tensor_cores is expected
        assert executor.backend.decode.use_tensor_cores is expected  # type: ignore[attr-defined]  # the fake's
        fake_flashinfer.CALLS.clear()
        executor.execute(synthetic_plan([5, 6], [1, 1], [[0, 1], [2, 3]], page_size=4))
        assert fake_flashinfer.CALLS["decode.run"] == config.num_layers

    @pytest.mark.skipif(FLASHINFER_IMPORTABLE, reason="flashinfer is installed here")
    def test_missing_flashinfer_is_a_clear_error(self) -> None:
        """Without flashinfer, building the kernels says what to install."""
        with pytest.raises(FlashInferUnavailableError, match=r"flashinfer cannot be imported.*\[gpu\]"):
            load_flashinfer()


class TestStaging:
    def test_growth_inside_inference_mode(self) -> None:
        """Buffers grown by a step (under inference_mode) still take steps prepared outside it."""
        executor = fake_executor(LlamaModel.random(CPU_MODEL, dtype=torch.bfloat16), num_pages=6000, page_size=4)
        executor.execute(decode_plan(3000, 5, page_size=4, vocab_size=512))
        batch = executor.prepare(synthetic_plan([0], [3], [[0]], page_size=4))
        assert batch.input_ids.tolist() == [0, 1, 2]

    def test_grows_and_keeps_values(self) -> None:
        """A step larger than the staging buffers grows them; host and device views hold the step."""
        staging = MetadataStaging(torch.device("cpu"))
        small = step_metadata(synthetic_plan([0], [3], [[0]], page_size=4))
        big = step_metadata(decode_plan(3000, 40, page_size=4, vocab_size=512))
        for meta in (small, big, small):
            host, dev = staging.upload(meta)
            assert dev.kv_indices.tolist() == meta.kv_indices.tolist()
            assert host.kv_indptr.tolist() == meta.kv_indptr.tolist()
            assert dev.input_ids.tolist() == meta.input_ids.tolist()


class TestHarness:
    def test_lockstep_of_an_executor_with_itself_is_exact(self) -> None:
        """Two torch executors on one model agree bit for bit: the comparison measures zero."""
        model = LlamaModel.random(TINY, seed=1)
        report = lockstep_compare(
            TorchExecutor(model, num_pages=32, page_size=4),
            TorchExecutor(model, num_pages=32, page_size=4),
            mixed_requests((5, 13), 512, max_new_tokens=3),
            chunked_policy(4),
            num_pages=32,
            page_size=4,
            rel_tol=0.0,
        )
        assert report.passed
        assert report.max_abs_logit_diff == 0.0
        assert report.token_mismatches == 0
        assert report.sampled_tokens == 6

    def test_lockstep_catches_a_different_model(self) -> None:
        """Different weights are a failure, not noise."""
        report = lockstep_compare(
            TorchExecutor(LlamaModel.random(TINY, seed=1), num_pages=32, page_size=4),
            TorchExecutor(LlamaModel.random(TINY, seed=2), num_pages=32, page_size=4),
            mixed_requests((5, 13), 512, max_new_tokens=3),
            chunked_policy(4),
            num_pages=32,
            page_size=4,
            rel_tol=2e-2,
        )
        assert not report.passed
        assert report.max_rel_logit_diff > 10 * report.rel_tol  # the logits fail; any token may then differ

    def test_lockstep_report_counts_near_ties(self) -> None:
        """A token may differ only where the reference's top-two margin is within twice the row's deviation."""
        from phasesched import StepResult  # noqa: PLC0415
        from phasesched_torch import StepLogits  # noqa: PLC0415

        plan = synthetic_plan([5, 6, 7], [1, 1, 1], [[0, 1], [2, 3], [4, 5]], page_size=4)
        ids = ("s0", "s1", "s2")
        # Every row moves by 0.006: margins up to 0.012 are near ties.
        # Row 0: margin 0.01, tokens differ: allowed. Row 1: margin 0.005, tokens agree.
        # Row 2: a clear winner (margin 0.5), tokens differ: unexplained.
        ref = torch.tensor([[1.0, 0.99, 0.0], [1.0, 0.995, 0.0], [1.0, 0.5, 0.0]])
        cand = ref + torch.tensor([[-0.006, 0.006, 0.0]])
        report = LockstepReport(rel_tol=1e-2)

        def add(tokens: list[int]) -> None:
            """One step whose reference samples token 0 everywhere and the other sampled ``tokens``."""
            results = (StepResult(0, np.array([0, 0, 0])), StepResult(0, np.array(tokens)))
            report.add(plan, StepLogits(0, ids, ref), StepLogits(0, ids, cand), results)

        add([1, 0, 0])
        assert (report.sampled_tokens, report.near_ties, report.token_mismatches) == (3, 2, 1)
        assert (report.near_tie_mismatches, report.unexplained_mismatches) == (1, 0)
        assert report.near_tie_share == pytest.approx(2 / 3)
        assert report.passed
        add([0, 0, 1])
        assert (report.token_mismatches, report.near_tie_mismatches, report.unexplained_mismatches) == (2, 1, 1)
        assert not report.passed

    def test_counts_where_decode_only_steps_start(self) -> None:
        """The report says when the first decode-only step came and how short its context was."""
        report = LockstepReport(rel_tol=1.0)
        report._count_step(synthetic_plan([0, 0], [5, 3], [[0, 1], [2]], page_size=4))
        report._count_step(synthetic_plan([5, 3], [1, 1], [[0, 1], [2]], page_size=4))
        assert (report.steps, report.decode_only_steps, report.first_decode_only_step) == (2, 1, 1)
        assert report.min_decode_context == 4
        assert report.mixed_steps == 0

    def test_attention_kernel_check(self) -> None:
        """The kernel comparison runs both wrappers on its batches (the stand-in is the reference)."""
        result = attention_kernel_check(
            FAKE, device=torch.device("cpu"), dtype=torch.bfloat16, num_heads=8, num_kv_heads=2
        )
        assert result == {"prefill_max_abs_diff": 0.0, "decode_max_abs_diff": 0.0}

    def test_time_decode(self) -> None:
        """The decode timing measures every part and the step includes its attention."""
        executor = fake_executor(LlamaModel.random(CPU_MODEL, dtype=torch.bfloat16), num_pages=64, page_size=4)
        timing = time_decode(executor, batch_size=3, context=30, repeats=2, warmup=1)
        assert (timing.batch_size, timing.context, timing.graph_step_s) == (3, 30, None)
        parts = (timing.step_s, timing.prepare_s, timing.forward_s, timing.attention_s, timing.rope_append_s)
        assert all(isinstance(value, float) and value > 0 for value in parts)
        # Wall-clock medians of separate runs need not add up, so no inequality between them is
        # asserted (issue 10); the fraction is exactly the quotient of the two measured fields.
        assert timing.attention_fraction == timing.attention_s / timing.step_s

    def test_decode_plan_is_valid(self) -> None:
        """The synthetic decode plan passes the plan's own consistency checks."""
        plan = decode_plan(5, 33, page_size=16, vocab_size=7)
        plan.check_layout()
        assert plan.num_decodes == 5
        assert plan.kv_len.tolist() == [33] * 5
        assert plan.input_ids is not None
        assert np.all(plan.input_ids < 7)


class TestPackaging:
    def test_registered_entry_point(self) -> None:
        """phasesched.EXECUTORS finds the factory under "flashinfer"."""
        assert "flashinfer" in EXECUTORS.names()
        assert EXECUTORS.get("flashinfer") is create_executor

    def test_is_an_executor(self) -> None:
        """The executor satisfies phasesched's Executor protocol."""
        executor = fake_executor(LlamaModel.random(CPU_MODEL, dtype=torch.bfloat16), num_pages=4, page_size=4)
        assert isinstance(executor, Executor)

    def test_version_and_py_typed(self) -> None:
        """__version__ comes from the installed distribution; the package is typed."""
        assert phasesched_flashinfer.__version__ == version("phasesched-flashinfer")
        assert (Path(phasesched_flashinfer.__file__).parent / "py.typed").is_file()

    def test_public_names_resolve(self) -> None:
        """Every name in __all__ exists and is documented."""
        for name in phasesched_flashinfer.__all__:
            obj = getattr(phasesched_flashinfer, name)
            if not name.startswith("__") and callable(obj):
                assert (obj.__doc__ or "").strip(), name

    def test_import_never_imports_flashinfer(self) -> None:
        """phasesched, this package, its harness and the registry never import flashinfer."""
        code = (
            "import sys, phasesched, phasesched_flashinfer, phasesched_flashinfer._check; "
            "names = phasesched.EXECUTORS.names(); assert 'flashinfer' in names, names; "
            "assert 'flashinfer' not in sys.modules, 'flashinfer was imported'"
        )
        subprocess.run([sys.executable, "-c", code], check=True, timeout=120)

    def test_doctests(self) -> None:
        """The package's docstring examples (if any) run."""
        for module in ("_attention", "_check", "_executor", "_graphs", "_kernels", "_metadata", "_planted", "_timing"):
            result = doctest.testmod(importlib.import_module(f"phasesched_flashinfer.{module}"))
            assert result.failed == 0, module


class TestStepAccounting:
    def test_decode_bytes_and_prefill_flops(self) -> None:
        """Bandwidth counts every linear weight and the KV read once; FLOPs count weights per row and causal pairs."""
        from phasesched_flashinfer._timing import StepTiming, step_accounting  # noqa: PLC0415

        model = LlamaModel.random(CPU_MODEL, dtype=torch.bfloat16)
        c = CPU_MODEL
        layer = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim * c.hidden_size  # qkv
        layer += c.hidden_size * c.num_heads * c.head_dim + 3 * c.intermediate_size * c.hidden_size
        linear, head = c.num_layers * layer, c.vocab_size * c.hidden_size
        kv_per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 2
        decode = StepTiming(4, 100, 4, step_s=2e-3, prepare_s=1e-4, forward_s=1e-3, attention_s=5e-4, rope_append_s=0)
        got = step_accounting(model, decode, hbm_bytes_per_s=1e12)
        assert got["hbm_bytes"] == (linear + head) * 2 + 4 * 100 * kv_per_token
        assert got["hbm_utilization"] == pytest.approx(got["hbm_bytes"] / 1e-3 / 1e12)
        assert (got["outside_kernels_s"], got["outside_kernels_share"]) == pytest.approx((1e-3, 0.5))
        prefill = StepTiming(1, 24, 16, step_s=1e-2, prepare_s=0, forward_s=1e-2, attention_s=1e-3, rope_append_s=0)
        got = step_accounting(model, prefill, peak_flops=1e15)
        pairs = 16 * 8 + 16 * 17 // 2  # 16 queries after 8 cached tokens, causal among themselves
        attention = 4 * c.num_heads * c.head_dim * pairs * c.num_layers
        assert got["flops"] == 2 * linear * 16 + 2 * head + attention
        assert got["attention_tflops"] == pytest.approx(attention / 1e-3 / 1e12)
        assert got["flops_utilization"] == pytest.approx(got["flops"] / 1e-2 / 1e15)


class TestDecodeBatching:
    def test_ragged_without_graphs(self) -> None:
        """FlashInfer's kernels read each slice's own pages: the profile reads decodes at their mean context."""
        executor = fake_executor(LlamaModel.random(CPU_MODEL, dtype=torch.bfloat16), num_pages=8, page_size=4)
        assert decode_batching_of(executor) == RAGGED

    def test_graph_sizes_pad_the_batch(self) -> None:
        """With CUDA graphs a decode-only step is read at the captured size that holds it (not the torch buckets)."""
        executor = fake_executor(
            LlamaModel.random(CPU_MODEL, dtype=torch.bfloat16),
            num_pages=16,
            page_size=4,
            use_cuda_graph=True,
            graph_batch_sizes=(1, 2, 4, 8),
            graph_runtime=fake_flashinfer.CpuGraphRuntime(),
        )
        batching = decode_batching_of(executor)
        assert batching == DecodeBatching(batch_sizes=(1, 2, 4, 8))
        assert batching.decode_features(np.array([5, 7, 9])) == (4, 22 / 4)
