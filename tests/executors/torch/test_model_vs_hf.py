"""The torch executor, driven by the real scheduler, against ``transformers``' Llama, Mistral and Qwen2.

A tiny HF model gets random weights (no download), its state dict is loaded into our model, and
for several prompts the greedy tokens the scheduler collects from our executor must equal
``generate(do_sample=False)``, with the logits of every sampled step equal to fp32 tolerance. The
scheduling varies everything the executor must be indifferent to: chunk sizes, page sizes, batch
mixes of prefill chunks and decodes, and preemption with recompute. Sliding-window configs use a
window shorter than the prompts, so prefill chunks and decodes both cross it.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import cast

import pytest

pytest.importorskip("torch")
import torch

pytest.importorskip("transformers")
import attrs
import transformers
from safetensors.torch import save_file

from phasesched import PolicyOptions, SchedulingPolicy, load_policy
from phasesched.policies import FixedChunk, NoChunking, TokenBudget
from phasesched_torch import Llama3RopeScaling, LlamaConfig, create_executor, rope_inv_freq
from tests.executors.torch.helpers import TINY, EngineRun, make_requests, random_prompts, run_engine

LLAMA3_TIED = LlamaConfig(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=1,
    head_dim=32,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    rms_norm_eps=1e-5,
    # A short original context so the scaled (long-wavelength) and blended bands both apply.
    rope_scaling=Llama3RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32
    ),
)
BIASED = attrs.evolve(
    TINY, hidden_size=96, num_heads=6, num_kv_heads=2, head_dim=16, num_layers=3, attention_bias=True, mlp_bias=True
)
# The window (8 positions, itself included) is shorter than most prompts and far shorter than
# prompt + generation, so prefill chunks of 7 start and end on both sides of it.
MISTRAL = attrs.evolve(TINY, vocab_size=384, model_type="mistral", sliding_window=8, rms_norm_eps=1e-5)
QWEN2 = attrs.evolve(TINY, vocab_size=384, model_type="qwen2", num_kv_heads=1, rope_theta=1e6)
QWEN2_WINDOW = attrs.evolve(QWEN2, sliding_window=6, tie_word_embeddings=True)
CONFIGS = {
    "tiny": TINY,
    "llama3-tied": LLAMA3_TIED,
    "biased": BIASED,
    "mistral-window": MISTRAL,
    "qwen2": QWEN2,
    "qwen2-window": QWEN2_WINDOW,
}

PROMPT_LENGTHS = (5, 13, 21, 34, 3)
MAX_NEW = 8


def hf_model(config: LlamaConfig, seed: int = 0) -> transformers.PreTrainedModel:
    """A float32 eager-attention HF model of ``config.model_type`` with weights large enough to make every bug visible.

    Matrices and biases are drawn with std 0.2 (ten times the default init, biases non-zero) and
    norm weights in [0.5, 1.5), so a missing bias, a wrong norm or a wrong rotation changes tokens.
    """
    hf_config = transformers.AutoConfig.for_model(
        config.model_type,
        **config.to_hf(),
        attn_implementation="eager",
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    # transformers leaves from_config() and PreTrainedModel.eval() unannotated.
    model: transformers.PreTrainedModel = transformers.AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
        hf_config, attn_implementation="eager"
    ).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(torch.rand(param.shape, generator=gen) + 0.5)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    return model


Reference = tuple[list[tuple[int, ...]], list[list[torch.Tensor]]]
"""generate()'s greedy tokens and per-step logits, one entry per prompt."""


def generate_reference(model: transformers.PreTrainedModel, prompts: list[list[int]]) -> Reference:
    """Greedy tokens and the logits behind them from ``model.generate``, prompt by prompt."""
    tokens, logits = [], []
    with torch.no_grad():
        for prompt in prompts:
            out = cast("transformers.GenerationMixin", model).generate(  # *ForCausalLM mixes generate() in
                torch.tensor([prompt]),
                max_new_tokens=MAX_NEW,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
            tokens.append(tuple(out.sequences[0, len(prompt) :].tolist()))
            logits.append([step[0] for step in out.logits])
    return tokens, logits


@functools.cache
def reference(
    name: str,
) -> tuple[transformers.PreTrainedModel, list[list[int]], list[tuple[int, ...]], list[list[torch.Tensor]]]:
    """The HF model for ``CONFIGS[name]``, the prompts, and generate()'s greedy tokens and logits."""
    config = CONFIGS[name]
    model = hf_model(config)
    prompts = random_prompts(PROMPT_LENGTHS, config.vocab_size, seed=1)
    tokens, logits = generate_reference(model, prompts)
    return model, prompts, tokens, logits


POLICIES = {
    "chunk-1": SchedulingPolicy(name="chunk-1", budget=TokenBudget(max_num_batched_tokens=8), chunker=FixedChunk(1)),
    "chunk-7": SchedulingPolicy(name="chunk-7", budget=TokenBudget(max_num_batched_tokens=24), chunker=FixedChunk(7)),
    "sarathi-16": load_policy("sarathi", PolicyOptions(chunk_size=16)),
    "whole-prompt": load_policy("no-chunk", PolicyOptions(max_model_len=256)),
    "whole-prompt-custom": SchedulingPolicy(
        name="whole", budget=TokenBudget(max_num_batched_tokens=64), chunker=NoChunking()
    ),
}


def check_against_reference(
    name: str, policy: SchedulingPolicy, *, page_size: int, num_pages: int = 256, max_num_seqs: int | None = None
) -> EngineRun:
    """Run ``CONFIGS[name]`` with the HF model's weights under ``policy``; tokens and logits must match generate()."""
    model, prompts, ref_tokens, ref_logits = reference(name)
    if max_num_seqs is not None:
        policy = attrs.evolve(policy, budget=attrs.evolve(policy.budget, max_num_seqs=max_num_seqs))
    executor = create_executor(
        model=CONFIGS[name], num_pages=num_pages, page_size=page_size, state_dict=model.state_dict()
    )
    run = run_engine(executor, policy, make_requests(prompts, MAX_NEW), num_pages=num_pages, page_size=page_size)
    check_run(run, (ref_tokens, ref_logits))
    return run


def check_run(run: EngineRun, expected: Reference) -> None:
    """Every request's greedy tokens equal the reference's, and its logits are close in fp32."""
    outputs = run.outputs()
    ref_tokens, ref_logits = expected
    for i, tokens in enumerate(ref_tokens):
        assert outputs[f"r{i}"] == tokens, f"request r{i}"
        ours = run.logits[f"r{i}"]
        assert len(ours) == MAX_NEW
        torch.testing.assert_close(torch.stack(ours), torch.stack(ref_logits[i]), atol=1e-4, rtol=1e-4)


class TestGreedyMatchesTransformers:
    @pytest.mark.parametrize("page_size", [1, 16, 5])
    @pytest.mark.parametrize("policy", ["chunk-1", "chunk-7", "sarathi-16", "whole-prompt"])
    def test_chunking_and_page_sizes(self, policy: str, page_size: int) -> None:
        """Greedy tokens and logits equal generate() for every chunk size and page size."""
        run = check_against_reference("tiny", POLICIES[policy], page_size=page_size)
        assert max(p.batch_size for p in run.plans) > 1, "the prompts never shared a step"
        if policy != "whole-prompt":
            assert run.had_mixed_step, "no step mixed prefill chunks with decodes"

    @pytest.mark.parametrize(("policy", "page_size"), [("chunk-7", 5), ("whole-prompt-custom", 16), ("chunk-1", 1)])
    def test_llama3_rope_scaling_tied_embeddings_mqa(self, policy: str, page_size: int) -> None:
        """Llama 3.1 RoPE scaling, tied embeddings, one kv head and head_dim != hidden / heads."""
        check_against_reference("llama3-tied", POLICIES[policy], page_size=page_size)

    def test_attention_and_mlp_biases(self) -> None:
        """A config with q/k/v/o and MLP biases and three query heads per kv head."""
        check_against_reference("biased", POLICIES["chunk-7"], page_size=5)

    @pytest.mark.parametrize("page_size", [4, 3])
    def test_preemption_and_recompute(self, page_size: int) -> None:
        """With too few pages the scheduler preempts; recomputed requests still generate the same tokens."""
        pages_needed = -(-(max(PROMPT_LENGTHS) + MAX_NEW) // page_size)
        run = check_against_reference("tiny", POLICIES["chunk-7"], page_size=page_size, num_pages=pages_needed + 2)
        assert run.num_preemptions > 0, "the scenario was meant to force preemption"

    def test_one_request_at_a_time(self) -> None:
        """max_num_seqs=1 serialises the requests; the executor reuses freed pages for the next one."""
        check_against_reference("tiny", POLICIES["sarathi-16"], page_size=16, num_pages=4, max_num_seqs=1)


class TestOtherArchitectures:
    @pytest.mark.parametrize(("policy", "page_size"), [("chunk-7", 5), ("chunk-1", 3), ("whole-prompt", 16)])
    def test_mistral_sliding_window(self, policy: str, page_size: int) -> None:
        """Mistral's sliding window matches transformers across prefill chunks and decodes past the window."""
        run = check_against_reference("mistral-window", POLICIES[policy], page_size=page_size)
        window = MISTRAL.sliding_window
        assert window is not None
        assert max(len(p) for p in reference("mistral-window")[1]) + MAX_NEW > 2 * window
        if policy == "chunk-7":
            assert any((p.start[p.num_new > 1] > window).any() for p in run.plans), "no chunk started past the window"

    def test_dropping_the_window_is_caught(self) -> None:
        """The same weights without the window give other tokens, so the test above would catch a dropped window."""
        model, prompts, ref_tokens, _ = reference("mistral-window")
        executor = create_executor(
            model=attrs.evolve(MISTRAL, sliding_window=None), num_pages=64, page_size=4, state_dict=model.state_dict()
        )
        run = run_engine(executor, POLICIES["chunk-7"], make_requests(prompts, MAX_NEW), num_pages=64, page_size=4)
        assert run.outputs() != {f"r{i}": tokens for i, tokens in enumerate(ref_tokens)}

    @pytest.mark.parametrize(("name", "policy"), [("qwen2", "chunk-7"), ("qwen2-window", "sarathi-16")])
    def test_qwen2_qkv_bias(self, name: str, policy: str) -> None:
        """Qwen2's q/k/v biases (no o bias), with and without a uniform sliding window, match transformers."""
        check_against_reference(name, POLICIES[policy], page_size=5)
        assert any(k.endswith("q_proj.bias") for k in reference(name)[0].state_dict())
        assert not any(k.endswith("o_proj.bias") for k in reference(name)[0].state_dict())

    @pytest.mark.parametrize("name", ["tied-own-head", "mistral-window"])
    def test_model_folder_matches_from_pretrained(self, name: str, tmp_path: Path) -> None:
        """A saved model folder runs as transformers' from_pretrained runs it (a tied config with its own head kept)."""
        config = attrs.evolve(TINY, tie_word_embeddings=True) if name == "tied-own-head" else CONFIGS[name]
        model = hf_model(config)
        state = {key: tensor.clone().contiguous() for key, tensor in model.state_dict().items()}
        if name == "tied-own-head":
            head = state["lm_head.weight"]
            state["lm_head.weight"] = torch.randn(head.shape, generator=torch.Generator().manual_seed(3)) * 0.2
        save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
        model.config.save_pretrained(tmp_path)
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
        hf.eval()  # type: ignore[no-untyped-call]  # transformers leaves PreTrainedModel.eval() unannotated
        assert torch.equal(hf.lm_head.weight, state["lm_head.weight"]), "transformers no longer keeps the head"
        prompts = random_prompts(PROMPT_LENGTHS, config.vocab_size, seed=1)
        executor = create_executor(model=tmp_path, num_pages=64, page_size=4)
        assert executor.model.config == config
        run = run_engine(executor, POLICIES["chunk-7"], make_requests(prompts, MAX_NEW), num_pages=64, page_size=4)
        check_run(run, generate_reference(hf, prompts))


class TestRopeAndConfig:
    @pytest.mark.parametrize("name", sorted(CONFIGS))
    def test_inverse_frequencies_equal_transformers(self, name: str) -> None:
        """RoPE inverse frequencies (plain and Llama 3.1-scaled) are bit-identical to transformers'."""
        model = reference(name)[0]
        assert torch.equal(rope_inv_freq(CONFIGS[name]), model.model.rotary_emb.inv_freq)

    @pytest.mark.parametrize("name", sorted(CONFIGS))
    def test_from_hf_config_object_round_trips(self, name: str) -> None:
        """LlamaConfig.from_hf reads a transformers config object back to the same config."""
        assert LlamaConfig.from_hf(reference(name)[0].config) == CONFIGS[name]

    def test_from_legacy_config_json(self) -> None:
        """A transformers-4 style config.json (rope_theta + rope_scaling) is understood."""
        legacy = {
            "architectures": ["LlamaForCausalLM"],
            "hidden_act": "silu",
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_attention_heads": 32,
            "num_hidden_layers": 32,
            "num_key_value_heads": 8,
            "rms_norm_eps": 1e-05,
            "rope_theta": 500000.0,
            "vocab_size": 128256,
            "max_position_embeddings": 131072,
            "tie_word_embeddings": False,
            "rope_scaling": {
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
                "rope_type": "llama3",
            },
        }
        assert LlamaConfig.from_hf(legacy) == LlamaConfig.preset("llama-3.1-8b")
