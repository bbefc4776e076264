"""The executor conformance suite for the FlashInfer executor.

The FlashInfer executor on a CPU stand-in runs everywhere; the FlashInfer
executor on its real kernels runs where CUDA and flashinfer are (the GPU check runs it).
"""

from __future__ import annotations

import importlib.util

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("phasesched_flashinfer", reason="install executors/flashinfer")

from phasesched_flashinfer import FlashInferExecutor  # noqa: E402
from phasesched_flashinfer._check import CHECK_MODEL  # noqa: E402
from phasesched_torch import LlamaModel  # noqa: E402
from tests.executors.conformance import ExecutorConformance, MakeExecutor  # noqa: E402
from tests.executors.flashinfer.helpers import CPU_MODEL, fake_executor  # noqa: E402

GPU_READY = torch.cuda.is_available() and importlib.util.find_spec("flashinfer") is not None


class TestFlashInferExecutorOnCPUStandIn(ExecutorConformance):
    """The FlashInfer executor's plumbing on the CPU stand-in for flashinfer."""

    VOCAB_SIZE = CPU_MODEL.vocab_size

    @pytest.fixture(scope="class")
    @classmethod
    def make_executor(cls) -> MakeExecutor:
        model = LlamaModel.random(CPU_MODEL, seed=0, dtype=torch.bfloat16)
        return lambda num_pages, page_size: fake_executor(model, num_pages=num_pages, page_size=page_size)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU_READY, reason="needs CUDA and flashinfer")
class TestFlashInferExecutorOnGPU(ExecutorConformance):
    """The FlashInfer executor on its real kernels."""

    VOCAB_SIZE = CHECK_MODEL.vocab_size

    @pytest.fixture(scope="class")
    @classmethod
    def make_executor(cls) -> MakeExecutor:
        model = LlamaModel.random(CHECK_MODEL, seed=0, dtype=torch.bfloat16, device="cuda")
        return lambda num_pages, page_size: FlashInferExecutor(model, num_pages=num_pages, page_size=page_size)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU_READY, reason="needs CUDA and flashinfer")
class TestFlashInferExecutorWithGraphsOnGPU(ExecutorConformance):
    """The FlashInfer executor replaying CUDA graphs for decode-only steps."""

    VOCAB_SIZE = CHECK_MODEL.vocab_size

    @pytest.fixture(scope="class")
    @classmethod
    def make_executor(cls) -> MakeExecutor:
        model = LlamaModel.random(CHECK_MODEL, seed=0, dtype=torch.bfloat16, device="cuda")
        return lambda num_pages, page_size: FlashInferExecutor(
            model, num_pages=num_pages, page_size=page_size, use_cuda_graph=True, graph_batch_sizes=(1, 2, 4, 8)
        )
