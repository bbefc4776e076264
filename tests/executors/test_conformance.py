"""Every registered executor that runs on a CPU passes the same conformance suite."""

from __future__ import annotations

import importlib.util

import pytest

from phasesched import DeterministicExecutor
from phasesched.costmodel import RooflineCostModel
from phasesched.sim import SimulatedExecutor
from tests.executors.conformance import ExecutorConformance, MakeExecutor


class TestDeterministicExecutor(ExecutorConformance):
    """The test executor."""

    VOCAB_SIZE = 32000
    HOLDS_KV = False
    REPORTS_DURATION = False

    @pytest.fixture(scope="class")
    @classmethod
    def make_executor(cls) -> MakeExecutor:
        return lambda num_pages, page_size: DeterministicExecutor(vocab_size=cls.VOCAB_SIZE)


class TestSimulatedExecutor(ExecutorConformance):
    """The simulator's executor."""

    VOCAB_SIZE = 1
    HOLDS_KV = False

    @pytest.fixture(scope="class")
    @classmethod
    def make_executor(cls) -> MakeExecutor:
        return lambda num_pages, page_size: SimulatedExecutor(RooflineCostModel.from_names())


@pytest.mark.skipif(importlib.util.find_spec("phasesched_torch") is None, reason="install executors/torch")
class TestTorchExecutor(ExecutorConformance):
    """The reference passes the suite (so a failure elsewhere is the other executor's)."""

    VOCAB_SIZE = 512
    HOLDS_KV = True

    @pytest.fixture(scope="class")
    @classmethod
    def make_executor(cls) -> MakeExecutor:
        torch = pytest.importorskip("torch")
        from phasesched_torch import LlamaConfig, LlamaModel, TorchExecutor  # noqa: PLC0415

        config = LlamaConfig(
            vocab_size=cls.VOCAB_SIZE,
            hidden_size=128,
            intermediate_size=256,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=32,
        )
        model = LlamaModel.random(config, seed=0, dtype=torch.float32)
        return lambda num_pages, page_size: TorchExecutor(model, num_pages=num_pages, page_size=page_size)
