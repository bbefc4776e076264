"""phasesched policies inside vLLM's V1 scheduler.

Run vLLM with ``--scheduler-cls phasesched_vllm.PhaseschedScheduler`` and choose the policy with
``--additional-config '{"phasesched": {"policy": "sarathi"}}'`` (any name registered under
``phasesched.policies``, plugins included). Tested with vLLM 0.32.0 only.

The scheduler class is imported on first access, so that importing this package (for its
config helpers, or :mod:`phasesched_vllm.testing`, which must set vLLM's platform before vLLM is
imported) does not import vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from phasesched_vllm._config import CONFIG_KEY as CONFIG_KEY
from phasesched_vllm._config import AdapterConfig as AdapterConfig
from phasesched_vllm._config import policy_from_vllm as policy_from_vllm

if TYPE_CHECKING:
    from phasesched_vllm._scheduler import AdapterError as AdapterError
    from phasesched_vllm._scheduler import PhaseschedScheduler as PhaseschedScheduler

__all__ = ["CONFIG_KEY", "AdapterConfig", "AdapterError", "PhaseschedScheduler", "policy_from_vllm"]


def __getattr__(name: str) -> Any:
    if name in ("PhaseschedScheduler", "AdapterError"):
        from phasesched_vllm import _scheduler  # noqa: PLC0415 -- imports vLLM, on first use only

        return getattr(_scheduler, name)
    msg = f"module 'phasesched_vllm' has no attribute {name!r}"
    raise AttributeError(msg)
