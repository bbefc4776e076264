"""Which phasesched policy the adapter runs, read from vLLM's own config.

vLLM hands a custom scheduler class nothing but its ``VllmConfig``; the channel for settings of
such plugins is ``--additional-config`` (``VllmConfig.additional_config``), a JSON object. The
adapter reads the ``"phasesched"`` key of it::

    --scheduler-cls phasesched_vllm.PhaseschedScheduler
    --additional-config '{"phasesched": {"policy": "sarathi", "chunk_size": 512}}'

No environment variable is read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from phasesched import PolicyOptions, SchedulingPolicy, load_policy
from phasesched.policies import TokenBudget

__all__ = ["CONFIG_KEY", "AdapterConfig", "policy_from_vllm"]

CONFIG_KEY = "phasesched"
"""The key of ``--additional-config`` the adapter reads."""

_FIELDS = ("policy", "chunk_size", "max_num_batched_tokens", "max_num_seqs", "tbt_target_s")


@attrs.frozen
class AdapterConfig:
    """The ``"phasesched"`` object of vLLM's ``--additional-config``.

    Attributes:
        policy: A registered policy name (``phasesched.POLICIES``), built-in or plugin.
        chunk_size: ``PolicyOptions.chunk_size`` for presets that have one.
        max_num_batched_tokens: The policy's token budget; default: vLLM's
            ``--max-num-batched-tokens``. Never above vLLM's, whose buffers are sized by it.
        max_num_seqs: The policy's sequence cap; default: vLLM's ``--max-num-seqs``.
        tbt_target_s: ``PolicyOptions.tbt_target_s`` for SLO-adaptive presets.

    """

    policy: str = "vllm"
    chunk_size: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    tbt_target_s: float | None = None

    @classmethod
    def from_additional_config(cls, additional: object) -> AdapterConfig:
        """Read the ``"phasesched"`` key of ``VllmConfig.additional_config`` (absent: the ``vllm`` preset).

        Raises:
            TypeError: The key holds something other than a JSON object.
            ValueError: The object has keys other than the fields above.

        """
        section: object = additional.get(CONFIG_KEY, {}) if isinstance(additional, Mapping) else {}
        if not isinstance(section, Mapping):
            msg = f"additional_config[{CONFIG_KEY!r}] must be a JSON object, got {section!r}"
            raise TypeError(msg)
        unknown = sorted(set(section) - set(_FIELDS))
        if unknown:
            msg = f"unknown keys {unknown} in additional_config[{CONFIG_KEY!r}]; known: {list(_FIELDS)}"
            raise ValueError(msg)
        values: dict[str, Any] = dict(section)
        return cls(**values)


def policy_from_vllm(
    config: AdapterConfig, *, max_model_len: int, max_num_batched_tokens: int, max_num_seqs: int
) -> SchedulingPolicy:
    """Load the configured policy for a vLLM deployment with these limits.

    The policy's budget defaults to vLLM's limits and is capped by them: vLLM's model runner
    sizes its input buffers by ``max_num_batched_tokens`` and ``max_num_seqs``.
    """
    options = PolicyOptions(
        max_model_len=max_model_len,
        max_num_seqs=config.max_num_seqs or max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens or max_num_batched_tokens,
        chunk_size=config.chunk_size,
        tbt_target_s=config.tbt_target_s,
    )
    policy = load_policy(config.policy, options)
    budget = TokenBudget(
        max_num_batched_tokens=min(policy.budget.max_num_batched_tokens, max_num_batched_tokens),
        max_num_seqs=min(policy.budget.max_num_seqs, max_num_seqs),
    )
    return attrs.evolve(policy, budget=budget)
