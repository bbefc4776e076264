"""The executor as a plugin: registration, packaging, synthetic plans, dtypes, devices, doctests."""

from __future__ import annotations

import doctest
import importlib
import subprocess
import sys
from importlib.metadata import version

import pytest

pytest.importorskip("torch")
import numpy as np
import torch

import phasesched_torch
from phasesched import EXECUTORS, Executor, PolicyOptions, Scheduler, SchedulerConfig, load_policy
from phasesched_torch import LlamaModel, TorchExecutor, create_executor
from tests.executors.torch.helpers import TINY, make_requests, random_prompts, run_engine, synthetic_plan


class TestPlugin:
    def test_registered_entry_point(self) -> None:
        """phasesched.EXECUTORS finds the factory under "torch", and it builds an Executor."""
        assert "torch" in EXECUTORS.names()
        assert EXECUTORS.get("torch") is create_executor
        executor = EXECUTORS.get("torch")(model="tiny", num_pages=8, page_size=4)
        assert isinstance(executor, Executor)
        assert isinstance(executor, TorchExecutor)

    def test_version_from_metadata(self) -> None:
        """__version__ comes from the installed distribution."""
        assert phasesched_torch.__version__ == version("phasesched-torch")

    def test_public_names_resolve(self) -> None:
        """Every name in __all__ exists."""
        for name in phasesched_torch.__all__:
            assert hasattr(phasesched_torch, name), name

    def test_phasesched_does_not_import_torch(self) -> None:
        """Importing phasesched, and listing its executors, never imports torch."""
        code = (
            "import sys, phasesched; names = phasesched.EXECUTORS.names(); "
            "assert 'torch' in names, names; assert 'torch' not in sys.modules, 'torch was imported'"
        )
        subprocess.run([sys.executable, "-c", code], check=True, timeout=120)

    def test_doctests(self) -> None:
        """The package's docstring examples run."""
        attempted = 0
        for module in ("_attention", "_config", "_executor", "_kv_cache", "_model", "_sampling"):
            result = doctest.testmod(importlib.import_module(f"phasesched_torch.{module}"))
            assert result.failed == 0, module
            attempted += result.attempted
        assert attempted >= 5


class TestExecute:
    def test_empty_plan(self) -> None:
        """An idle step returns no tokens and takes no time."""
        executor = create_executor(model="tiny", num_pages=8, page_size=4)
        plan = Scheduler(SchedulerConfig(num_pages=8, page_size=4)).schedule()
        result = executor.execute(plan)
        assert result.token_ids.shape == (0,)
        assert result.duration_s == 0.0

    def test_synthetic_profiler_plan(self) -> None:
        """Decodes deep into contexts that were never written, beside a prefill chunk, run and time."""
        executor = create_executor(model="tiny", num_pages=64, page_size=16)
        pages = [list(range(20)), list(range(20, 39)), [39, 40, 41]]  # 316, 301 and 36 tokens
        plan = synthetic_plan([315, 300, 16], [1, 1, 20], pages, page_size=16)
        result = executor.execute(plan)
        assert result.token_ids.dtype == np.int32
        assert result.token_ids.shape == (3,)
        assert np.all((result.token_ids >= 0) & (result.token_ids < 512))
        assert result.duration_s is not None
        assert result.duration_s > 0
        assert executor.last_logits is not None
        assert torch.isfinite(executor.last_logits.logits).all()
        # The step wrote exactly its own tokens: position 315 of slice 0 is page 19, row 11.
        assert executor.kv_cache[0][19, 0, 11].abs().sum() > 0
        assert executor.kv_cache[0][19, 0, 10].abs().sum() == 0

    def test_non_sampling_slices_get_minus_one(self) -> None:
        """Slices that stop short of their last known token return -1 and no logits."""
        executor = create_executor(model="tiny", num_pages=16, page_size=4)
        scheduler = Scheduler(
            SchedulerConfig(num_pages=16, page_size=4), load_policy("sarathi", PolicyOptions(chunk_size=4))
        )
        for request in make_requests(random_prompts((10, 2), 512), 2):
            scheduler.add_request(request)
        plan = scheduler.schedule()
        assert plan.samples.tolist() == [False]
        result = executor.execute(plan)
        assert result.token_ids.tolist() == [-1]
        assert executor.last_logits is not None
        assert executor.last_logits.logits.shape == (0, 512)
        with pytest.raises(KeyError):
            executor.last_logits.of("r0")

    def test_num_layers_override_and_hf_dict(self) -> None:
        """A preset can be cut to fewer layers, and a config.json dict is a valid model argument."""
        assert len(create_executor(model="tiny", num_layers=1, num_pages=4).kv_cache) == 1
        executor = create_executor(model=TINY.to_hf(), num_pages=4)
        assert executor.model.config == TINY

    @pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
    def test_half_precision(self, dtype: str) -> None:
        """bf16 and fp16 executors run the engine loop; their logits track float32's."""
        state = {n: t.float() for n, t in _state_dict().items()}
        logits = {}
        for name in ("float32", dtype):
            executor = create_executor(model=TINY, num_pages=32, page_size=4, dtype=name, state_dict=state)
            assert executor.kv_cache[0].dtype == getattr(torch, name)
            run = run_engine(
                executor,
                load_policy("sarathi", PolicyOptions(chunk_size=8)),
                make_requests(random_prompts((7, 12), 512), 1),
                num_pages=32,
                page_size=4,
            )
            logits[name] = torch.stack([run.logits["r0"][0], run.logits["r1"][0]])
        torch.testing.assert_close(logits[dtype], logits["float32"], atol=0.05, rtol=0.05)

    @pytest.mark.gpu
    @pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
    def test_cuda_matches_cpu(self) -> None:
        """On CUDA the same weights and plans give the CPU's greedy tokens and close logits."""
        runs = {}
        for device in ("cpu", "cuda"):
            executor = create_executor(model=TINY, num_pages=32, page_size=4, device=device, state_dict=_state_dict())
            runs[device] = run_engine(
                executor,
                load_policy("sarathi", PolicyOptions(chunk_size=8)),
                make_requests(random_prompts((7, 12, 30), 512), 6),
                num_pages=32,
                page_size=4,
            )
        assert runs["cuda"].outputs() == runs["cpu"].outputs()
        for rid, ours in runs["cuda"].logits.items():
            torch.testing.assert_close(
                torch.stack(ours).cpu(), torch.stack(runs["cpu"].logits[rid]), atol=1e-3, rtol=1e-3
            )


def _state_dict() -> dict[str, torch.Tensor]:
    """A checkpoint-shaped state dict with larger-than-default weights (sharper, less tied logits)."""
    model = LlamaModel.random(TINY, seed=5, std=0.2)
    w = model.weights
    state = {"model.embed_tokens.weight": w.embed, "model.norm.weight": w.norm, "lm_head.weight": w.lm_head}
    for i, layer in enumerate(w.layers):
        q, k, v = torch.split(layer.qkv, [64, 32, 32])
        gate, up = layer.gate_up.chunk(2)
        p = f"model.layers.{i}."
        state |= {
            p + "self_attn.q_proj.weight": q,
            p + "self_attn.k_proj.weight": k,
            p + "self_attn.v_proj.weight": v,
            p + "self_attn.o_proj.weight": layer.o_proj,
            p + "mlp.gate_proj.weight": gate,
            p + "mlp.up_proj.weight": up,
            p + "mlp.down_proj.weight": layer.down,
            p + "input_layernorm.weight": layer.input_norm,
            p + "post_attention_layernorm.weight": layer.post_norm,
        }
    return state
