"""Says why the vLLM integration tests did not run where vLLM is not installed."""

from __future__ import annotations

import importlib.util

import pytest


@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None or importlib.util.find_spec("phasesched_vllm") is None,
    reason="the vLLM adapter tests need vLLM 0.32 and phasesched-vllm (integrations/vllm/ci.sh builds a venv)",
)
def test_vllm_is_importable() -> None:
    """vLLM and the adapter import together (the other tests here need both)."""
    import vllm  # noqa: PLC0415

    import phasesched_vllm  # noqa: PLC0415

    assert vllm.__version__ == "0.32.0"
    assert phasesched_vllm.PhaseschedScheduler.__name__ == "PhaseschedScheduler"
