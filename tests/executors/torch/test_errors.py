"""Bad input at the executor's boundaries: plans it cannot run, checkpoints that do not fit, bad configs."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import attrs  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from phasesched import InvalidPlanError, PhaseschedError, Request, Scheduler, SchedulerConfig  # noqa: E402
from phasesched.errors import UnknownNameError  # noqa: E402
from phasesched_torch import (  # noqa: E402
    CheckpointError,
    LlamaConfig,
    LlamaModel,
    MissingTensorError,
    PlanNotExecutableError,
    StateDictError,
    TensorShapeError,
    UnexpectedTensorError,
    UnsupportedConfigError,
    create_executor,
    expected_shapes,
)
from tests.executors.torch.helpers import TINY, synthetic_plan  # noqa: E402


def random_state_dict(config: LlamaConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen) * 0.1 for name, shape in expected_shapes(config).items()}


def first_step(scheduler: Scheduler, request: Request):
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
    def test_file_and_sharded_directory(self, tmp_path) -> None:
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
