"""The adapter's settings, read from vLLM's ``--additional-config``."""

from __future__ import annotations

import pytest

from phasesched_vllm import AdapterConfig, policy_from_vllm


class TestAdapterConfig:
    def test_absent_means_the_vllm_preset(self) -> None:
        """Without a "phasesched" key the adapter runs the vllm preset."""
        assert AdapterConfig.from_additional_config({}) == AdapterConfig(policy="vllm")

    def test_known_keys_are_read(self) -> None:
        """Every documented key reaches the config."""
        config = AdapterConfig.from_additional_config({"phasesched": {"policy": "sarathi", "chunk_size": 256}})
        assert (config.policy, config.chunk_size) == ("sarathi", 256)

    def test_an_unknown_key_is_refused_with_the_known_ones(self) -> None:
        """A misspelt key stops vLLM at startup and lists the valid keys."""
        with pytest.raises(ValueError, match="chunk_size"):
            AdapterConfig.from_additional_config({"phasesched": {"chunksize": 256}})

    def test_a_non_object_is_refused(self) -> None:
        """The "phasesched" value must be a JSON object."""
        with pytest.raises(TypeError, match="JSON object"):
            AdapterConfig.from_additional_config({"phasesched": "sarathi"})


class TestPolicyFromVllm:
    def test_the_budget_defaults_to_vllms_limits(self) -> None:
        """The vllm preset takes vLLM's --max-num-batched-tokens and --max-num-seqs."""
        policy = policy_from_vllm(AdapterConfig(), max_model_len=4096, max_num_batched_tokens=2048, max_num_seqs=64)
        assert (policy.budget.max_num_batched_tokens, policy.budget.max_num_seqs) == (2048, 64)

    def test_the_budget_never_exceeds_vllms(self) -> None:
        """A larger budget in the config is capped at what vLLM's buffers hold."""
        config = AdapterConfig(max_num_batched_tokens=100_000, max_num_seqs=1000)
        policy = policy_from_vllm(config, max_model_len=4096, max_num_batched_tokens=2048, max_num_seqs=64)
        assert (policy.budget.max_num_batched_tokens, policy.budget.max_num_seqs) == (2048, 64)

    def test_a_smaller_budget_in_the_config_holds(self) -> None:
        """Sarathi's budget can be set below vLLM's in the config."""
        config = AdapterConfig(policy="sarathi", max_num_batched_tokens=512)
        policy = policy_from_vllm(config, max_model_len=4096, max_num_batched_tokens=8192, max_num_seqs=64)
        assert policy.budget.max_num_batched_tokens == 512
