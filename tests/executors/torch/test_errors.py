"""Bad input at the executor's boundaries: plans it cannot run, checkpoints that do not fit, bad configs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
import attrs
import torch
from safetensors.torch import save_file

from phasesched import InvalidPlanError, PhaseschedError, Request, Scheduler, SchedulerConfig, StepPlan
from phasesched.errors import UnknownNameError, UnsupportedModelError
from phasesched_torch import (
    CheckpointError,
    DeviceUnavailableError,
    LlamaConfig,
    LlamaModel,
    MissingTensorError,
    PlanNotExecutableError,
    StateDictError,
    TensorShapeError,
    UnexpectedTensorError,
    UnsupportedArchitectureError,
    UnsupportedConfigError,
    create_executor,
    expected_shapes,
)
from tests.executors.torch.helpers import TINY, synthetic_plan


def random_state_dict(config: LlamaConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen) * 0.1 for name, shape in expected_shapes(config).items()}


def first_step(scheduler: Scheduler, request: Request) -> StepPlan:
    scheduler.add_request(request)
    return scheduler.schedule()


class TestBadPlans:
    @pytest.mark.parametrize("page", [8, 99, -1])
    def test_page_outside_the_cache(self, page: int) -> None:
        """A page id outside the cache raises PlanNotExecutableError (an InvalidPlanError) naming it; nothing runs."""
        executor = create_executor(model="tiny", num_pages=8, page_size=4)
        before = [c.clone() for c in executor.kv_cache]
        plan = synthetic_plan([0, 0], [3, 6], [[1], [2, page]], page_size=4)
        message = (
            rf"slice 1 \(request 's1'\) references KV page {page} \(kv_indices\[2\]={page}\), "
            r"outside the cache's 8 pages \(ids 0\.\.7\)"
        )
        with pytest.raises(PlanNotExecutableError, match=message) as info:
            executor.execute(plan)
        assert isinstance(info.value, InvalidPlanError)
        assert all(torch.equal(a, b) for a, b in zip(before, executor.kv_cache, strict=True))

    def test_plan_without_input_ids(self) -> None:
        """A length-only request's plan carries no token ids and cannot run on a model."""
        executor = create_executor(model="tiny", num_pages=16, page_size=4)
        plan = first_step(Scheduler(SchedulerConfig(num_pages=16, page_size=4)), Request("a", prompt_len=5))
        assert plan.input_ids is None
        with pytest.raises(PlanNotExecutableError, match="no input_ids"):
            executor.execute(plan)

    def test_token_outside_the_vocabulary(self) -> None:
        """A token id the embedding does not have is rejected (on CUDA it would be a device assert)."""
        executor = create_executor(model="tiny", num_pages=16, page_size=4)
        plan = first_step(
            Scheduler(SchedulerConfig(num_pages=16, page_size=4)), Request("a", prompt_token_ids=[1, 512, 3])
        )
        with pytest.raises(PlanNotExecutableError, match="token id 512"):
            executor.execute(plan)

    def test_page_size_mismatch(self) -> None:
        """A scheduler with another page size cannot drive this cache."""
        executor = create_executor(model="tiny", num_pages=16, page_size=8)
        plan = first_step(Scheduler(SchedulerConfig(num_pages=16, page_size=4)), Request("a", prompt_token_ids=[1]))
        with pytest.raises(PlanNotExecutableError, match="4-token pages"):
            executor.execute(plan)

    def test_inconsistent_plan(self) -> None:
        """A plan whose metadata disagrees with itself is rejected through StepPlan.check_layout."""
        plan = synthetic_plan([0], [6], [[1, 2]], page_size=4)
        broken = attrs.evolve(plan, kv_last_page_len=plan.kv_last_page_len + 1)
        executor = create_executor(model="tiny", num_pages=8, page_size=4)
        with pytest.raises(PlanNotExecutableError, match="kv_last_page_len"):
            executor.execute(broken)


class TestBadStateDicts:
    def test_missing_tensor(self) -> None:
        """A missing tensor raises MissingTensorError naming it."""
        state = random_state_dict(TINY)
        del state["model.layers.1.mlp.down_proj.weight"]
        with pytest.raises(MissingTensorError, match=r"model\.layers\.1\.mlp\.down_proj\.weight") as info:
            LlamaModel.from_state_dict(TINY, state)
        assert info.value.tensor == "model.layers.1.mlp.down_proj.weight"
        assert isinstance(info.value, StateDictError)
        assert isinstance(info.value, PhaseschedError)

    def test_misshaped_tensor(self) -> None:
        """A tensor of the wrong shape raises TensorShapeError naming it and both shapes."""
        state = random_state_dict(TINY)
        state["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(64, 64)
        with pytest.raises(TensorShapeError, match=r"k_proj\.weight.*\(64, 64\).*\(32, 64\)") as info:
            create_executor(model=TINY, num_pages=4, state_dict=state)
        assert info.value.tensor == "model.layers.0.self_attn.k_proj.weight"
        assert info.value.expected == (32, 64)

    def test_unexpected_tensor(self) -> None:
        """A tensor the model has no place for (a third layer) raises UnexpectedTensorError naming it."""
        state = random_state_dict(attrs.evolve(TINY, num_layers=3))
        with pytest.raises(UnexpectedTensorError, match=r"model\.layers\.2\."):
            LlamaModel.from_state_dict(TINY, state)

    def test_untied_model_needs_its_lm_head(self) -> None:
        """An untied config without lm_head.weight is missing a tensor."""
        state = random_state_dict(TINY)
        del state["lm_head.weight"]
        with pytest.raises(MissingTensorError, match="lm_head"):
            LlamaModel.from_state_dict(TINY, state)

    def test_tied_model_accepts_or_omits_lm_head(self) -> None:
        """A tied config loads with or without lm_head.weight, and its head is the embedding."""
        tied = attrs.evolve(TINY, tie_word_embeddings=True)
        state = random_state_dict(tied)
        assert "lm_head.weight" not in state
        model = LlamaModel.from_state_dict(tied, state)
        assert model.weights.lm_head is model.weights.embed
        LlamaModel.from_state_dict(tied, {**state, "lm_head.weight": state["model.embed_tokens.weight"]})

    def test_legacy_rotary_buffers_are_ignored(self) -> None:
        """Old checkpoints' rotary_emb.inv_freq buffers are recomputed, not rejected."""
        state = random_state_dict(TINY)
        state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(8)
        LlamaModel.from_state_dict(TINY, state)


class TestSafetensors:
    def test_file_and_sharded_directory(self, tmp_path: Path) -> None:
        """A safetensors file and a directory of shards load the same weights as the in-memory dict."""
        state = random_state_dict(TINY)
        save_file(state, tmp_path / "model.safetensors")
        names = sorted(state)
        shards = tmp_path / "shards"
        shards.mkdir()
        save_file({n: state[n] for n in names[::2]}, shards / "model-00001-of-00002.safetensors")
        save_file({n: state[n] for n in names[1::2]}, shards / "model-00002-of-00002.safetensors")
        reference = LlamaModel.from_state_dict(TINY, state)
        for source in (tmp_path / "model.safetensors", shards):
            executor = create_executor(model=TINY, num_pages=4, state_dict=source)
            assert torch.equal(executor.model.weights.layers[1].gate_up, reference.weights.layers[1].gate_up)
            assert torch.equal(executor.model.weights.lm_head, state["lm_head.weight"])

    def test_missing_checkpoint(self, tmp_path: Path) -> None:
        """A path with no checkpoint raises CheckpointError naming it."""
        with pytest.raises(CheckpointError, match="no safetensors checkpoint") as info:
            create_executor(model=TINY, num_pages=4, state_dict=tmp_path)
        assert info.value.path == tmp_path


class TestBadConfigs:
    @pytest.mark.parametrize(
        ("change", "message"),
        [
            ({"hidden_act": "gelu"}, "hidden_act"),
            ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "yarn"),
            ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}}, "partial"),
            ({"hidden_size": None}, "hidden_size"),
        ],
    )
    def test_unsupported_hf_configs(self, change: dict[str, object], message: str) -> None:
        """HF configs this model cannot represent raise UnsupportedConfigError."""
        with pytest.raises(UnsupportedConfigError, match=message):
            LlamaConfig.from_hf({**TINY.to_hf(), **change})

    def test_invalid_shapes(self) -> None:
        """Head counts that do not divide, or an odd head_dim, are rejected by the config."""
        with pytest.raises(ValueError, match="multiple"):
            attrs.evolve(TINY, num_kv_heads=3)
        with pytest.raises(ValueError, match="even"):
            attrs.evolve(TINY, head_dim=15)

    def test_unknown_names(self) -> None:
        """Unknown presets and dtypes raise UnknownNameError listing the known ones."""
        with pytest.raises(UnknownNameError, match="llama-3-8b"):
            create_executor(model="llama-9")
        with pytest.raises(UnknownNameError, match="bfloat16"):
            create_executor(dtype="float8")
        with pytest.raises(UnknownNameError):
            create_executor(dtype=torch.int8)


def one_line(error: BaseException) -> str:
    """The error's message, checked to be a single line."""
    message = str(error)
    assert "\n" not in message, message
    return message


def write_folder(root: Path, config: dict[str, object] | None, state: dict[str, torch.Tensor] | None) -> Path:
    """A model folder: ``config.json`` (unless ``None``) and ``model.safetensors`` (unless ``None``)."""
    root.mkdir(exist_ok=True)
    if config is not None:
        (root / "config.json").write_text(json.dumps(config), encoding="utf-8")
    if state is not None:
        save_file(state, root / "model.safetensors")
    return root


class TestRefusedModels:
    @pytest.mark.parametrize("model_type", ["qwen3", "phi3", "mixtral", "gemma", "qwen2_moe"])
    def test_other_architectures_are_refused(self, model_type: str) -> None:
        """A transformers config of an architecture not implemented is refused, naming it, not built as a Llama."""
        transformers = pytest.importorskip("transformers")
        values = transformers.AutoConfig.for_model(model_type).to_dict()
        with pytest.raises(UnsupportedArchitectureError, match=model_type) as info:
            create_executor(model=values, num_pages=4)
        assert info.value.architecture == model_type
        assert isinstance(info.value, UnsupportedModelError)
        assert "llama, mistral, qwen2" in one_line(info.value)

    @pytest.mark.parametrize(
        ("change", "refused"),
        [
            ({"architectures": ["Qwen3ForCausalLM"]}, "Qwen3ForCausalLM"),
            ({"architectures": ["MixtralForCausalLM"]}, "MixtralForCausalLM"),
            (
                {"model_type": "llama", "architectures": ["LlamaForSequenceClassification"]},
                "LlamaForSequenceClassification",
            ),
            ({"model_type": "llama", "architectures": ["MistralForCausalLM"]}, "MistralForCausalLM"),
        ],
    )
    def test_architectures_entries_are_checked(self, change: dict[str, object], refused: str) -> None:
        """An ``architectures`` entry that is not the causal LM class of a supported model_type is refused."""
        with pytest.raises(UnsupportedArchitectureError) as info:
            LlamaConfig.from_hf({**TINY.to_hf(), **change})
        assert info.value.architecture == refused

    def test_architecture_names_the_model_type(self) -> None:
        """A dict naming only its class reads as that model_type; one naming nothing reads as a Llama."""
        bare = {k: v for k, v in TINY.to_hf().items() if k != "architectures"}
        assert LlamaConfig.from_hf(bare) == TINY
        mistral = LlamaConfig.from_hf({**bare, "architectures": ["MistralForCausalLM"], "sliding_window": 16})
        assert (mistral.model_type, mistral.sliding_window) == ("mistral", 16)

    def test_constructed_configs_are_checked(self) -> None:
        """A LlamaConfig built by hand is held to the same rules as one read from transformers."""
        with pytest.raises(UnsupportedArchitectureError, match="qwen3"):
            attrs.evolve(TINY, model_type="qwen3")
        with pytest.raises(UnsupportedConfigError, match="llama has no sliding window"):
            attrs.evolve(TINY, sliding_window=8)
        with pytest.raises(UnsupportedConfigError, match="fixes its biases"):
            attrs.evolve(TINY, model_type="mistral", attention_bias=True)

    @pytest.mark.parametrize(
        "values",
        [
            {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
            {"model_type": "mistral", "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]},
            {"model_type": "mistral", "layer_types": ["chunked_attention", "chunked_attention"]},
        ],
    )
    def test_mixed_layer_types_are_refused(self, values: dict[str, object]) -> None:
        """Layers that mix sliding-window and full attention (or another kind) are refused, not run with one window."""
        with pytest.raises(UnsupportedConfigError, match="layer_types"):
            LlamaConfig.from_hf({**TINY.to_hf(), "architectures": None, **values})

    def test_window_defaults_follow_transformers(self) -> None:
        """A Mistral config without sliding_window gets transformers' default; Qwen2 needs use_sliding_window."""
        transformers = pytest.importorskip("transformers")
        bare = {**TINY.to_hf(), "architectures": None, "attention_bias": True}
        mistral = LlamaConfig.from_hf({**bare, "model_type": "mistral"})
        assert mistral.sliding_window == transformers.MistralConfig().sliding_window
        assert not mistral.attention_bias  # MistralForCausalLM has no biases, whatever the dict says
        qwen2 = LlamaConfig.from_hf({**bare, "model_type": "qwen2", "sliding_window": 4})
        assert qwen2.sliding_window is None
        assert (qwen2.qkv_bias, qwen2.attention_bias) == (True, False)

    @pytest.mark.parametrize("rope_type", ["linear", "dynamic", "yarn", "longrope"])
    def test_other_rope_types_are_refused(self, rope_type: str) -> None:
        """RoPE scalings other than default and llama3 are refused, naming the type."""
        rope = {"rope_type": rope_type, "rope_theta": 1e4, "factor": 2.0}
        with pytest.raises(UnsupportedConfigError, match=rope_type):
            LlamaConfig.from_hf({**TINY.to_hf(), "rope_parameters": rope})

    @pytest.mark.parametrize("spelling", ["rope_parameters", "rope_scaling"])
    def test_llama3_rope_without_factor(self, spelling: str) -> None:
        """A llama3 rope block without factor is a one-line UnsupportedConfigError, not a KeyError."""
        rope = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0}
        rope |= {"original_max_position_embeddings": 8192, "rope_theta": 5e5}
        with pytest.raises(UnsupportedConfigError, match="rope scaling of type 'llama3' has no 'factor'") as info:
            LlamaConfig.from_hf({**TINY.to_hf(), "rope_parameters": None, spelling: rope})
        one_line(info.value)

    def test_invalid_values_are_typed(self) -> None:
        """A config.json whose values break the config's own checks raises a PhaseschedError."""
        with pytest.raises(UnsupportedConfigError, match="vocab_size"):
            LlamaConfig.from_hf({**TINY.to_hf(), "vocab_size": 0})
        with pytest.raises(PhaseschedError, match="multiple"):
            LlamaConfig.from_hf({**TINY.to_hf(), "num_key_value_heads": 3})

    def test_attention_that_ignores_the_window_is_refused(self) -> None:
        """A sliding-window model refuses a StepAttention that does not declare its window; nothing is written."""
        config = attrs.evolve(TINY, model_type="mistral", sliding_window=4)
        executor = create_executor(model=config, num_pages=8, page_size=4)
        batch = executor.prepare(synthetic_plan([0], [6], [[1, 2]], page_size=4))
        inner = batch.attention

        def windowless(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
            return inner(q, k, v, kv_cache)

        with pytest.raises(UnsupportedConfigError, match="sliding window of 4 tokens"):
            executor.model.forward(attrs.evolve(batch, attention=windowless), executor.kv_cache)
        assert all(not cache.any() for cache in executor.kv_cache)
        executor.model.forward(batch, executor.kv_cache)  # the executor's own attention declares it


class TestModelFolders:
    def test_folder_loads_config_and_weights(self, tmp_path: Path) -> None:
        """A folder with config.json and safetensors builds that config with those weights."""
        state = random_state_dict(TINY)
        folder = write_folder(tmp_path / "m", TINY.to_hf(), state)
        executor = create_executor(model=folder, num_pages=4)
        assert executor.model.config == TINY
        assert torch.equal(executor.model.weights.lm_head, state["lm_head.weight"])
        assert create_executor(model=str(folder), num_pages=4).model.config == TINY

    def test_missing_config_json(self, tmp_path: Path) -> None:
        """A folder without config.json is a one-line CheckpointError naming the folder."""
        folder = write_folder(tmp_path / "m", None, random_state_dict(TINY))
        with pytest.raises(CheckpointError, match=r"no config\.json") as info:
            create_executor(model=folder, num_pages=4)
        assert info.value.path == folder
        one_line(info.value)

    def test_config_json_that_is_not_json(self, tmp_path: Path) -> None:
        """A config.json that does not parse is a one-line CheckpointError naming the file."""
        folder = write_folder(tmp_path / "m", None, None)
        (folder / "config.json").write_text('{"hidden_size": 64,', encoding="utf-8")
        with pytest.raises(CheckpointError, match="not a readable JSON config") as info:
            create_executor(model=folder, num_pages=4)
        assert info.value.path == folder / "config.json"
        one_line(info.value)

    @pytest.mark.parametrize("keep", [0.5, 0.001])
    def test_truncated_safetensors(self, tmp_path: Path, keep: float) -> None:
        """A truncated safetensors file is a one-line CheckpointError naming the file."""
        folder = write_folder(tmp_path / "m", TINY.to_hf(), random_state_dict(TINY))
        file = folder / "model.safetensors"
        data = file.read_bytes()
        file.write_bytes(data[: int(len(data) * keep)])
        with pytest.raises(CheckpointError, match="not a readable safetensors file") as info:
            create_executor(model=folder, num_pages=4)
        assert info.value.path == file
        one_line(info.value)

    def test_folder_without_weights(self, tmp_path: Path) -> None:
        """A folder with a config but no safetensors is a CheckpointError, not random weights."""
        folder = write_folder(tmp_path / "m", TINY.to_hf(), None)
        with pytest.raises(CheckpointError, match="no safetensors checkpoint"):
            create_executor(model=folder, num_pages=4)

    def test_llama3_rope_without_factor_in_a_folder(self, tmp_path: Path) -> None:
        """A folder whose config.json has a llama3 rope block without factor fails before reading weights."""
        rope = {"rope_type": "llama3", "rope_theta": 5e5, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
        config = {**TINY.to_hf(), "rope_parameters": {**rope, "original_max_position_embeddings": 64}}
        folder = write_folder(tmp_path / "m", config, None)
        with pytest.raises(UnsupportedConfigError, match="no 'factor'") as info:
            create_executor(model=folder, num_pages=4)
        one_line(info.value)

    def test_neither_preset_nor_folder(self, tmp_path: Path) -> None:
        """A name that is no preset and no path raises UnknownNameError listing the presets."""
        with pytest.raises(UnknownNameError, match=r"no model folder there; known presets: .*tiny"):
            create_executor(model=str(tmp_path / "absent"), num_pages=4)


class TestDevices:
    @pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch that sees no CUDA device")
    def test_cuda_without_cuda(self) -> None:
        """device='cuda' on a CPU-only torch is a one-line DeviceUnavailableError before any weight is built."""
        with pytest.raises(DeviceUnavailableError, match="sees no CUDA device") as info:
            create_executor(model="llama-3-70b", device="cuda")
        one_line(info.value)
        assert isinstance(info.value, PhaseschedError)

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
    def test_cuda_index_past_the_last(self) -> None:
        """A CUDA index past the visible devices is a DeviceUnavailableError."""
        with pytest.raises(DeviceUnavailableError, match="CUDA device"):
            create_executor(model="tiny", device=f"cuda:{torch.cuda.device_count()}")

    def test_not_a_device(self) -> None:
        """A device string torch does not parse is a DeviceUnavailableError."""
        with pytest.raises(DeviceUnavailableError, match="not a torch device"):
            create_executor(model="tiny", device="gpu0")
