"""KV capacity as vLLM sizes it: GiB totals, weights as stored, activation reserve, utilization."""

from __future__ import annotations

import attrs
import pytest

from phasesched.costmodel import hardware_by_name, model_by_name
from phasesched.costmodel.memory import GIB, MemoryBudget, memory_budget, serving_defaults, weight_bytes_per_gpu
from phasesched.sim.deployment import Deployment

LLAMA_70B_FP8 = attrs.evolve(model_by_name("llama-3-70b"), bytes_per_param=1, embedding_dtype_bytes=2)
"""Llama-3.3-70B-Instruct-FP8-dynamic: FP8 linear layers, BF16 embedding, LM head and norms."""


def vllm_num_blocks(total_gib: float, utilization: float, non_kv_gib: float, kv_bytes_per_token: int) -> int:
    """vLLM's formula, written out: (total x utilization - weights - activations - non-torch) // block bytes."""
    block_bytes = 16 * kv_bytes_per_token
    return int((total_gib * GIB * utilization - non_kv_gib * GIB) // block_bytes)


class TestAgainstVllmLogs:
    """The KV cache vLLM V1 reported on an H100 (79.18 GiB) at gpu_memory_utilization 0.9."""

    @pytest.mark.parametrize(
        ("model", "tp", "weights_gib", "kv_gib"),
        [
            (model_by_name("llama-3-8b"), 1, 14.99, 51.38),  # Llama-3.1-8B-Instruct, same shapes
            (LLAMA_70B_FP8, 2, 33.88, 32.0),
        ],
    )
    def test_kv_cache_within_one_percent(self, model: object, tp: int, weights_gib: float, kv_gib: float) -> None:
        """Weights and KV cache both land within 1% of what vLLM logged."""
        budget = memory_budget(hardware_by_name("H100-SXM"), model, tp)  # type: ignore[arg-type]
        assert budget.weight_bytes / GIB == pytest.approx(weights_gib, rel=0.01)
        assert budget.kv_cache_bytes / GIB == pytest.approx(kv_gib, rel=0.01)


class TestFormula:
    def test_llama_70b_tp2_on_a100(self) -> None:
        """Llama-3-70B TP2 on 2 x A100-80GB at 0.9, written out from vLLM's formula independently."""
        # Per GPU: 79.15 GiB total; BF16 weights (70.55B params: embedding and LM head 128256 x 8192
        # each, split 2 ways, layers split 2 ways, norms replicated); A100 serving defaults of 2048
        # tokens and 256 sequences, whose sampler reserve (256 x 128256 logits x 38.7 B) dominates;
        # 0.55 GiB non-torch with TP; KV of 80 layers x 4 KV heads x 128 x 2 (K, V) x 2 bytes.
        layers = 80 * (2 * 8192 * 64 * 128 + 2 * 8192 * 8 * 128 + 3 * 8192 * 28672)
        weights = (2 * 128256 * 8192 / 2 + layers / 2 + 161 * 8192) * 2
        activations = 256 * 128256 * 38.7
        non_kv_gib = (weights + activations) / GIB + 0.55
        expected = vllm_num_blocks(79.15, 0.9, non_kv_gib, 80 * 4 * 128 * 2 * 2)
        deployment = Deployment("A100-80GB", "llama-3-70b", tensor_parallel=2)
        assert deployment.kv_pages() == expected
        assert 20_000 < deployment.kv_tokens() < 30_000  # not 8.8K (80e9-byte GPUs) nor 41.5K (no reserve)

    def test_gpu_memory_utilization_moves_only_the_kv(self) -> None:
        """Raising the utilization from 0.9 to 0.95 adds exactly 5% of the GPU to the KV cache."""
        low = Deployment(gpu_memory_utilization=0.9).memory()
        high = Deployment(gpu_memory_utilization=0.95).memory()
        assert high.kv_cache_bytes - low.kv_cache_bytes == pytest.approx(0.05 * 139.81 * GIB)

    def test_fp8_keeps_embedding_and_head_in_bf16(self) -> None:
        """An FP8 checkpoint stores the vocab tables at 2 bytes, so its weights exceed half the BF16 ones."""
        bf16 = weight_bytes_per_gpu(model_by_name("llama-3-70b"), 2)
        fp8 = weight_bytes_per_gpu(LLAMA_70B_FP8, 2)
        vocab_tables = 128256 * 8192 * 2 / 2 * 2  # two tables, split 2 ways, 2 bytes
        assert fp8 == pytest.approx(bf16 / 2 + vocab_tables / 2, rel=1e-3)

    def test_no_room_is_zero_pages(self) -> None:
        """A budget whose weights exceed the requested memory holds no page."""
        budget = MemoryBudget(80 * GIB, 0.9, 80 * GIB, 0, 0, 1024)
        assert budget.kv_cache_bytes < 0
        assert budget.num_pages(16) == 0

    def test_model_that_does_not_fit_is_refused_with_the_budget(self) -> None:
        """Llama-3-70B on one A100 fails with the memory breakdown in the message."""
        with pytest.raises(ValueError, match=r"weights 131\.\d+.*KV cache -"):
            Deployment("A100-80GB", "llama-3-70b").kv_pages()

    def test_serving_defaults(self) -> None:
        """vLLM's defaults by device: large on Hopper, small on A100."""
        assert serving_defaults(hardware_by_name("H100-SXM")) == (8192, 1024)
        assert serving_defaults(hardware_by_name("A100-80GB")) == (2048, 256)

    def test_explicit_limits_shrink_the_reserve(self) -> None:
        """A smaller max_num_seqs leaves a smaller sampler reserve and so more KV."""
        default = Deployment().memory()
        small = Deployment(max_num_seqs=128).memory()
        assert small.activation_bytes < default.activation_bytes
        assert small.kv_cache_bytes > default.kv_cache_bytes
