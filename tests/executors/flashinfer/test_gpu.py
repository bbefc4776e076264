"""The FlashInfer executor on its real kernels, against the torch reference on the same GPU.

Skipped without CUDA and flashinfer. The offline GPU check (``executors/flashinfer/gpu_check``)
runs these with the prebuilt bundle; numbers it reports come from the same harness
(:mod:`phasesched_flashinfer._check`).
"""

from __future__ import annotations

import importlib.util

import pytest

pytest.importorskip("torch")
import torch

pytest.importorskip("phasesched_flashinfer", reason="install executors/flashinfer")

import attrs

from phasesched_flashinfer import FlashInferExecutor, load_flashinfer
from phasesched_flashinfer._check import (
    CHECK_MODEL,
    attention_kernel_check,
    calibrated_lockstep,
    check_workloads,
    lockstep_compare,
)
from phasesched_flashinfer._planted import PLANTED_BUGS, plant
from phasesched_flashinfer._timing import decode_plan
from phasesched_torch import Llama3RopeScaling, LlamaConfig, LlamaModel, TorchExecutor
from tests.executors.flashinfer.helpers import chunked_policy, mixed_requests

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (torch.cuda.is_available() and importlib.util.find_spec("flashinfer") is not None),
        reason="needs CUDA and flashinfer",
    ),
]

CHECK_MODEL_LLAMA31 = attrs.evolve(CHECK_MODEL, rope_scaling=Llama3RopeScaling(original_max_position_embeddings=256))
TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 1e-2}
PROMPTS = (1, 7, 37, 64, 130, 300, 513)


def _pair(config: LlamaConfig, dtype: torch.dtype, num_pages: int) -> tuple[TorchExecutor, FlashInferExecutor]:
    model = LlamaModel.random(config, seed=11, dtype=dtype, device="cuda", std=0.05)
    return TorchExecutor(model, num_pages=num_pages, page_size=16), FlashInferExecutor(
        model, num_pages=num_pages, page_size=16
    )


class TestKernels:
    @pytest.mark.parametrize(("dtype", "atol"), [(torch.bfloat16, 2e-2), (torch.float16, 5e-3)])
    def test_wrappers_match_the_reference_attention(self, dtype: torch.dtype, atol: float) -> None:
        """Prefill (mixed batch) and tensor-core decode wrappers equal the float32 reference within dtype noise."""
        result = attention_kernel_check(load_flashinfer(), device=torch.device("cuda"), dtype=dtype)
        assert result["prefill_max_abs_diff"] <= atol, result
        assert result["decode_max_abs_diff"] <= atol, result


class TestAgainstTheTorchExecutor:
    @pytest.mark.parametrize(
        ("config", "dtype"),
        [(CHECK_MODEL, torch.bfloat16), (CHECK_MODEL, torch.float16), (CHECK_MODEL_LLAMA31, torch.bfloat16)],
    )
    def test_lockstep(self, config: LlamaConfig, dtype: torch.dtype) -> None:
        """Short-context decodes and chunked prefills: logits within 4 measured rounding floors, tokens equal."""
        model = LlamaModel.random(config, seed=11, dtype=dtype, device="cuda", std=0.05)
        candidate = FlashInferExecutor(model, num_pages=256, page_size=16)
        workloads = check_workloads(config.vocab_size, chunked_prompts=PROMPTS, chunk_size=64)
        report = calibrated_lockstep(model, candidate, workloads, num_pages=256, page_size=16)
        assert report.passed, report
        assert report.mixed_steps > 0
        assert report.first_decode_only_step == 1
        assert candidate.backend.path_counts["decode"] == report.decode_only_steps

    @pytest.mark.parametrize("bug", PLANTED_BUGS)
    def test_planted_bug_fails(self, bug: str) -> None:
        """Each planted kernel-call bug, on the real kernels, fails the same comparison."""
        model = LlamaModel.random(CHECK_MODEL, seed=11, dtype=torch.bfloat16, device="cuda", std=0.05)
        candidate = FlashInferExecutor(model, num_pages=256, page_size=16, kernels=plant(load_flashinfer(), bug))
        workloads = check_workloads(CHECK_MODEL.vocab_size, chunked_prompts=PROMPTS, chunk_size=64)
        report = calibrated_lockstep(model, candidate, workloads, num_pages=256, page_size=16)
        assert not report.passed, report

    def test_decode_at_long_context(self) -> None:
        """A decode-only step over contexts of up to 1,500 tokens (split-KV) matches the reference."""
        reference, candidate = _pair(CHECK_MODEL, torch.bfloat16, num_pages=600)
        plan = decode_plan(6, 1500, page_size=16, vocab_size=CHECK_MODEL.vocab_size)
        reference.execute(plan)
        candidate.execute(plan)
        assert reference.last_logits is not None
        assert candidate.last_logits is not None
        want, got = reference.last_logits.logits, candidate.last_logits.logits
        assert float((got - want).abs().max() / want.abs().max()) <= TOLERANCE[torch.bfloat16]


class TestCudaGraphs:
    def test_graphs_match_eager_decodes(self) -> None:
        """Decode steps replayed from CUDA graphs give the eager executor's tokens and logits."""
        model = LlamaModel.random(CHECK_MODEL, seed=11, dtype=torch.bfloat16, device="cuda", std=0.05)
        eager = FlashInferExecutor(model, num_pages=256, page_size=16)
        graphs = FlashInferExecutor(
            model, num_pages=256, page_size=16, use_cuda_graph=True, graph_batch_sizes=(1, 2, 4, 8)
        )
        report = lockstep_compare(
            eager,
            graphs,
            mixed_requests(PROMPTS, CHECK_MODEL.vocab_size, max_new_tokens=8),
            chunked_policy(64),
            num_pages=256,
            page_size=16,
            rel_tol=1e-2,
        )
        assert report.passed, report
        assert graphs.graphs is not None
        assert graphs.graphs.replays == report.decode_only_steps > 0
        assert torch.count_nonzero(graphs.kv_cache[0][256]) > 0  # padding rows wrote the scratch page
