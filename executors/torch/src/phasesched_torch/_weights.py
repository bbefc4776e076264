"""Model weights: checked loading from ``transformers`` state dicts, and seeded random init.

Checkpoints use ``LlamaForCausalLM`` names (``model.layers.0.self_attn.q_proj.weight``, ...),
which Mistral's and Qwen2's share.
Every tensor is checked against the config before anything is converted, so a wrong checkpoint
fails with the name of the first tensor at fault instead of a shape error deep in a matmul.
q/k/v and gate/up projections are fused into one matrix each: one matmul instead of three (two)
per layer, which is what a serving engine does too.
"""

from __future__ import annotations

from collections.abc import Mapping
from os import PathLike
from pathlib import Path

import attrs
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from phasesched_torch._config import LlamaConfig
from phasesched_torch._errors import CheckpointError, MissingTensorError, TensorShapeError, UnexpectedTensorError

__all__ = ["LayerWeights", "LlamaWeights", "expected_shapes", "load_safetensors"]

# Older checkpoints saved RoPE's inverse frequencies as buffers; they are recomputed, not loaded.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_LM_HEAD = "lm_head.weight"
_EMBED = "model.embed_tokens.weight"
_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_GATE_UP = ("mlp.gate_proj", "mlp.up_proj")


@attrs.frozen(eq=False)
class LayerWeights:
    """One decoder layer's tensors (``H`` hidden, ``I`` intermediate, ``D`` head dim).

    Attributes:
        input_norm: ``[H]``: RMSNorm before attention.
        qkv: ``[(Hq + 2 * Hkv) * D, H]``: q, k and v projections stacked in that order.
        qkv_bias: ``[(Hq + 2 * Hkv) * D]`` or ``None``.
        o_proj: ``[H, Hq * D]``.
        o_bias: ``[H]`` or ``None``.
        post_norm: ``[H]``: RMSNorm before the MLP.
        gate_up: ``[2 * I, H]``: gate and up projections stacked.
        gate_up_bias: ``[2 * I]`` or ``None``.
        down: ``[H, I]``.
        down_bias: ``[H]`` or ``None``.

    """

    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o_proj: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None


@attrs.frozen(eq=False)
class LlamaWeights:
    """All of a model's tensors, on one device in one dtype.

    Attributes:
        embed: ``[V, H]``: token embeddings.
        layers: One entry per decoder layer.
        norm: ``[H]``: the final RMSNorm.
        lm_head: ``[V, H]``: the output projection (the same tensor as ``embed`` when tied and
            the checkpoint carries no ``lm_head.weight`` of its own).

    """

    embed: torch.Tensor
    layers: tuple[LayerWeights, ...]
    norm: torch.Tensor
    lm_head: torch.Tensor


def expected_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a ``LlamaForCausalLM`` checkpoint of ``config`` holds, by name, with its shape.

    ``lm_head.weight`` is listed only for untied models. A tied checkpoint may still carry it
    (``LlamaForCausalLM.state_dict()`` does); it is then the LM head, as ``transformers`` 5
    makes it (a checkpoint's own head, when it differs from the embedding, is kept untied).
    """
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_heads * d, config.num_kv_heads * d
    per_layer: dict[str, tuple[int, ...]] = {
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "mlp.gate_proj.weight": (i, h),
        "mlp.up_proj.weight": (i, h),
        "mlp.down_proj.weight": (h, i),
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
    }
    if config.qkv_bias:
        per_layer |= {"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)}
    if config.attention_bias:
        per_layer["self_attn.o_proj.bias"] = (h,)
    if config.mlp_bias:
        per_layer |= {"mlp.gate_proj.bias": (i,), "mlp.up_proj.bias": (i,), "mlp.down_proj.bias": (h,)}
    shapes = {_EMBED: (config.vocab_size, h), "model.norm.weight": (h,)}
    for layer in range(config.num_layers):
        shapes |= {f"model.layers.{layer}.{name}": shape for name, shape in per_layer.items()}
    if not config.tie_word_embeddings:
        shapes[_LM_HEAD] = (config.vocab_size, h)
    return shapes


def check_state_dict(config: LlamaConfig, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Raise a :class:`StateDictError` naming the first tensor (in name order) that does not fit.

    Raises:
        MissingTensorError: A tensor the model needs is absent.
        UnexpectedTensorError: A tensor has no place in this model.
        TensorShapeError: A tensor's shape disagrees with the config.

    """
    expected = expected_shapes(config)
    missing = sorted(expected.keys() - state_dict.keys())
    if missing:
        raise MissingTensorError(missing[0])
    optional = {_LM_HEAD: (config.vocab_size, config.hidden_size)} if config.tie_word_embeddings else {}
    for name in sorted(state_dict):
        shape = expected.get(name, optional.get(name))
        if shape is None:
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            raise UnexpectedTensorError(name)
        actual = tuple(state_dict[name].shape)
        if actual != shape:
            raise TensorShapeError(name, shape, actual)


def weights_from_state_dict(
    config: LlamaConfig, state_dict: Mapping[str, torch.Tensor], *, device: torch.device, dtype: torch.dtype
) -> LlamaWeights:
    """Check, convert and fuse a ``LlamaForCausalLM`` state dict.

    Raises:
        StateDictError: See :func:`check_state_dict`; nothing is converted then.

    """
    check_state_dict(config, state_dict)

    def get(name: str) -> torch.Tensor:
        return state_dict[name].detach().to(device=device, dtype=dtype)

    def cat(prefix: str, names: tuple[str, ...], suffix: str) -> torch.Tensor:
        return torch.cat([get(f"{prefix}{n}.{suffix}") for n in names])

    layers = []
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}."
        layers.append(
            LayerWeights(
                input_norm=get(p + "input_layernorm.weight"),
                qkv=cat(p, _QKV, "weight"),
                qkv_bias=cat(p, _QKV, "bias") if config.qkv_bias else None,
                o_proj=get(p + "self_attn.o_proj.weight"),
                o_bias=get(p + "self_attn.o_proj.bias") if config.attention_bias else None,
                post_norm=get(p + "post_attention_layernorm.weight"),
                gate_up=cat(p, _GATE_UP, "weight"),
                gate_up_bias=cat(p, _GATE_UP, "bias") if config.mlp_bias else None,
                down=get(p + "mlp.down_proj.weight"),
                down_bias=get(p + "mlp.down_proj.bias") if config.mlp_bias else None,
            )
        )
    embed = get(_EMBED)
    lm_head = embed if _shares_embedding(state_dict) else get(_LM_HEAD)
    return LlamaWeights(embed=embed, layers=tuple(layers), norm=get("model.norm.weight"), lm_head=lm_head)


def _shares_embedding(state_dict: Mapping[str, torch.Tensor]) -> bool:
    """Whether the LM head is the embedding: no head in the checkpoint, or one equal to it.

    A tied config whose checkpoint carries a different ``lm_head.weight`` keeps that head, as
    ``transformers`` 5 does (it warns and leaves the two untied).
    """
    head, embed = state_dict.get(_LM_HEAD), state_dict[_EMBED]
    same_kind = head is not None and (head.dtype, head.device) == (embed.dtype, embed.device)
    return head is None or (same_kind and torch.equal(head, embed))


def random_weights(
    config: LlamaConfig, *, seed: int, device: torch.device, dtype: torch.dtype, std: float = 0.02
) -> LlamaWeights:
    """Seeded random weights: normal(0, ``std``) matrices, zero biases, unit norms (``transformers``' init).

    Generated directly on ``device`` in ``dtype``, so a 8B-parameter model needs no host copy.
    """
    generator = torch.Generator(device=device).manual_seed(seed)
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    qkv_rows = (config.num_heads + 2 * config.num_kv_heads) * d

    def normal(*shape: int) -> torch.Tensor:
        return torch.empty(shape, device=device, dtype=dtype).normal_(0.0, std, generator=generator)

    def bias(size: int, present: bool) -> torch.Tensor | None:
        return torch.zeros(size, device=device, dtype=dtype) if present else None

    def ones() -> torch.Tensor:
        return torch.ones(h, device=device, dtype=dtype)

    layers = tuple(
        LayerWeights(
            input_norm=ones(),
            qkv=normal(qkv_rows, h),
            qkv_bias=bias(qkv_rows, config.qkv_bias),
            o_proj=normal(h, config.num_heads * d),
            o_bias=bias(h, config.attention_bias),
            post_norm=ones(),
            gate_up=normal(2 * i, h),
            gate_up_bias=bias(2 * i, config.mlp_bias),
            down=normal(h, i),
            down_bias=bias(h, config.mlp_bias),
        )
        for _ in range(config.num_layers)
    )
    embed = normal(config.vocab_size, h)
    lm_head = embed if config.tie_word_embeddings else normal(config.vocab_size, h)
    return LlamaWeights(embed=embed, layers=layers, norm=ones(), lm_head=lm_head)


def load_safetensors(path: str | PathLike[str]) -> dict[str, torch.Tensor]:
    """Read a safetensors checkpoint: one file, or a directory of ``*.safetensors`` shards.

    Tensors are loaded on the CPU; :meth:`LlamaModel.from_state_dict` moves them to the model's device.

    Raises:
        CheckpointError: The path does not exist, the directory holds no shard, or a file is
            not a readable safetensors file (truncated, say); the error names the file.

    """
    root = Path(path)
    files = sorted(root.glob("*.safetensors")) if root.is_dir() else [root]
    if not files or not files[0].is_file():
        raise CheckpointError(root, "no safetensors checkpoint here")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(_load_file(file))
    return tensors


def _load_file(file: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(file, device="cpu")
    except (SafetensorError, OSError) as error:
        raise CheckpointError(file, f"not a readable safetensors file ({error})") from error
