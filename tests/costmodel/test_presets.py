"""Hardware and model presets: datasheet and config numbers, derived sizes, lookups."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from phasesched.costmodel import (
    HARDWARE_PRESETS,
    MODEL_PRESETS,
    Hardware,
    ModelSpec,
    hardware_by_name,
    model_by_name,
)
from phasesched.errors import PhaseschedError, UnknownNameError


class TestHardware:
    @pytest.mark.parametrize(
        ("name", "flops", "bandwidth", "memory", "link"),
        [
            ("H100-SXM", 989e12, 3.35e12, 79.18 * 2**30, 900e9),
            ("H200", 989e12, 4.8e12, 139.81 * 2**30, 900e9),
            ("A100-80GB", 312e12, 2.039e12, 79.15 * 2**30, 600e9),
        ],
    )
    def test_datasheet_numbers(self, name: str, flops: float, bandwidth: float, memory: float, link: float) -> None:
        """Each preset carries its datasheet's dense BF16 peak, HBM bandwidth, capacity and NVLink."""
        hw = hardware_by_name(name)
        assert (hw.peak_flops, hw.hbm_bandwidth, hw.memory_bytes, hw.link_bandwidth) == (flops, bandwidth, memory, link)

    def test_link_bandwidth_per_direction_is_half(self) -> None:
        """A ring all-reduce uses one direction: half the bidirectional datasheet figure."""
        assert hardware_by_name("H100-SXM").link_bandwidth_per_direction == 450e9
        assert hardware_by_name("A100-80GB").link_bandwidth_per_direction == 300e9

    def test_lookup_ignores_case(self) -> None:
        """Names match case-insensitively."""
        assert hardware_by_name("h100-sxm") is HARDWARE_PRESETS["H100-SXM"]

    def test_unknown_name_lists_known_ones(self) -> None:
        """An unknown name raises the typed error, naming every preset."""
        with pytest.raises(UnknownNameError) as info:
            hardware_by_name("B200")
        assert isinstance(info.value, PhaseschedError)
        assert isinstance(info.value, LookupError)
        for name in ("H100-SXM", "H200", "A100-80GB"):
            assert name in str(info.value)

    @pytest.mark.parametrize("field", ["compute_efficiency", "attention_efficiency", "bandwidth_efficiency"])
    @pytest.mark.parametrize("value", [0.0, 1.5, -0.1])
    def test_efficiencies_are_fractions(self, field: str, value: float) -> None:
        """An efficiency outside (0, 1] is rejected."""
        changes: dict[str, Any] = {field: value}
        with pytest.raises(ValueError, match=field):
            attrs.evolve(hardware_by_name("H200"), **changes)

    def test_peaks_must_be_positive(self) -> None:
        """A zero bandwidth is rejected."""
        with pytest.raises(ValueError, match="hbm_bandwidth"):
            attrs.evolve(hardware_by_name("H200"), hbm_bandwidth=0.0)

    def test_presets_are_hardware(self) -> None:
        """The registry maps each name to a Hardware of that name."""
        assert all(isinstance(hw, Hardware) and hw.name == name for name, hw in HARDWARE_PRESETS.items())


class TestModelSpec:
    def test_llama_3_8b_parameter_count(self) -> None:
        """Llama-3-8B has the 8,030,261,248 parameters its checkpoint holds."""
        assert model_by_name("llama-3-8b").num_params == 8_030_261_248

    def test_llama_3_70b_parameter_count(self) -> None:
        """Llama-3-70B has the 70,553,706,496 parameters its checkpoint holds."""
        assert model_by_name("llama-3-70b").num_params == 70_553_706_496

    def test_derived_sizes_8b(self) -> None:
        """Weights, per-token KV and per-token matmul FLOPs of Llama-3-8B, by hand."""
        m = model_by_name("llama-3-8b")
        per_layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336
        assert m.layer_linear_params == per_layer
        assert m.linear_flops_per_token == 2 * 32 * per_layer
        assert m.lm_head_params == 128256 * 4096
        assert m.step_weight_bytes == 2 * (32 * per_layer + 128256 * 4096)
        assert m.weight_bytes == 2 * 8_030_261_248
        assert m.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
        assert m.attention_flops_per_pair == 4 * 32 * 32 * 128

    def test_kv_bytes_70b(self) -> None:
        """Llama-3-70B stores 320 KiB of KV per token (80 layers, 8 KV heads of 128)."""
        assert model_by_name("llama-3-70b").kv_bytes_per_token == 327_680

    def test_tied_embeddings_drop_the_head_from_the_footprint(self) -> None:
        """A tied LM head is stored once but still streamed once per step."""
        m = model_by_name("llama-3-8b")
        tied = attrs.evolve(m, tie_embeddings=True)
        assert m.num_params - tied.num_params == m.lm_head_params
        assert tied.step_weight_bytes == m.step_weight_bytes

    def test_fp8_halves_weights_and_kv(self) -> None:
        """One-byte weights and KV halve the weight and KV sizes."""
        m = model_by_name("llama-3-8b")
        fp8 = attrs.evolve(m, bytes_per_param=1, kv_bytes_per_element=1)
        assert fp8.step_weight_bytes * 2 == m.step_weight_bytes
        assert fp8.kv_bytes_per_token * 2 == m.kv_bytes_per_token

    def test_tensor_parallel_must_divide_heads(self) -> None:
        """A TP degree that does not divide the query heads is rejected; 1/2/4/8 are fine."""
        m = model_by_name("llama-3-70b")
        for tp in (1, 2, 4, 8):
            m.check_tensor_parallel(tp)
        with pytest.raises(ValueError, match="num_heads"):
            m.check_tensor_parallel(3)
        with pytest.raises(ValueError, match="num_heads"):
            m.check_tensor_parallel(0)

    def test_kv_heads_replicate_beyond_their_count(self) -> None:
        """With more GPUs than KV heads each GPU keeps one (replicated) KV head."""
        m = model_by_name("llama-3-70b")
        m.check_tensor_parallel(16)
        assert m.kv_heads_per_gpu(16) == 1
        assert m.kv_heads_per_gpu(4) == 2

    def test_kv_heads_neither_dividing_nor_multiple_rejected(self) -> None:
        """Six KV heads cannot be spread over four GPUs."""
        m = ModelSpec("odd", 2, 1536, 24, 6, 64, 4096, 1000)
        with pytest.raises(ValueError, match="num_kv_heads"):
            m.check_tensor_parallel(4)

    def test_heads_must_group_over_kv_heads(self) -> None:
        """Query heads must be a multiple of KV heads (GQA)."""
        with pytest.raises(ValueError, match="multiple"):
            ModelSpec("bad", 2, 1024, 8, 3, 128, 4096, 1000)

    def test_unknown_name_lists_known_ones(self) -> None:
        """An unknown model name raises the typed error, naming every preset."""
        with pytest.raises(UnknownNameError, match="llama-3-8b, llama-3-70b"):
            model_by_name("llama-2-7b")

    def test_lookup_ignores_case(self) -> None:
        """Names match case-insensitively."""
        assert model_by_name("Llama-3-70B") is MODEL_PRESETS["llama-3-70b"]
