"""Decoder-only transformer shapes (Llama-style: GQA attention, gated MLP) and their costs.

A cost model needs a handful of derived numbers from a model: the bytes a step streams from
HBM (its matmul weights), the FLOPs each token spends in them, and the KV bytes each token of
context costs. They are derived here once from the published config, so a preset is just its
``config.json`` transcribed.
"""

from __future__ import annotations

import types
from collections.abc import Mapping

import attrs

from phasesched.errors import InvalidArgumentError, UnknownNameError
from phasesched.validators import typed

__all__ = ["MODEL_PRESETS", "ModelSpec", "model_by_name"]

_positive = typed(attrs.validators.gt(0))


@attrs.frozen
class ModelSpec:
    """A Llama-style decoder's shape (the fields of its Hugging Face ``config.json``).

    Attributes:
        name: Preset name (``"llama-3-8b"``).
        num_layers: ``num_hidden_layers``.
        hidden_size: ``hidden_size``.
        num_heads: ``num_attention_heads`` (query heads).
        num_kv_heads: ``num_key_value_heads`` (GQA).
        head_dim: Per-head dimension (``hidden_size / num_attention_heads`` for Llama).
        intermediate_size: Gated MLP width (gate, up and down projections).
        vocab_size: ``vocab_size``.
        bytes_per_param: 2 for BF16 weights, 1 for FP8.
        tie_embeddings: ``tie_word_embeddings``: the LM head reuses the embedding table.
        kv_bytes_per_element: 2 for a BF16 KV cache, 1 for FP8.
        activation_bytes: Bytes per activation element, what tensor-parallel all-reduces move.
        embedding_dtype_bytes: Bytes per parameter of the embedding, LM head and norms as stored,
            when they differ from ``bytes_per_param`` (FP8 checkpoints keep them in BF16: 2).

    >>> m = model_by_name("llama-3-8b")
    >>> round(m.num_params / 1e9, 2), m.kv_bytes_per_token
    (8.03, 131072)

    """

    name: str
    num_layers: int = attrs.field(validator=_positive)
    hidden_size: int = attrs.field(validator=_positive)
    num_heads: int = attrs.field(validator=_positive)
    num_kv_heads: int = attrs.field(validator=_positive)
    head_dim: int = attrs.field(validator=_positive)
    intermediate_size: int = attrs.field(validator=_positive)
    vocab_size: int = attrs.field(validator=_positive)
    bytes_per_param: int = attrs.field(default=2, validator=_positive)
    tie_embeddings: bool = False
    kv_bytes_per_element: int = attrs.field(default=2, validator=_positive)
    activation_bytes: int = attrs.field(default=2, validator=_positive)
    embedding_dtype_bytes: int | None = attrs.field(default=None, validator=attrs.validators.optional(_positive))

    def __attrs_post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            msg = f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            raise InvalidArgumentError(msg)

    @property
    def embedding_bytes_per_param(self) -> int:
        """Bytes per parameter of the embedding, LM head and norms as stored."""
        return self.bytes_per_param if self.embedding_dtype_bytes is None else self.embedding_dtype_bytes

    @property
    def layer_linear_params(self) -> int:
        """Matmul parameters of one layer — Q, K, V and O projections plus gate, up and down."""
        q_and_o = 2 * self.hidden_size * self.num_heads * self.head_dim
        k_and_v = 2 * self.hidden_size * self.num_kv_heads * self.head_dim
        return q_and_o + k_and_v + 3 * self.hidden_size * self.intermediate_size

    @property
    def linear_params(self) -> int:
        """Matmul parameters every token passes through (all layers, without the LM head)."""
        return self.num_layers * self.layer_linear_params

    @property
    def lm_head_params(self) -> int:
        """Parameters of the LM head (``vocab_size x hidden_size``, tied or not)."""
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        """All parameters — embedding, layers (with their two RMSNorms), final norm, LM head."""
        norms = (2 * self.num_layers + 1) * self.hidden_size
        embedding = self.vocab_size * self.hidden_size
        head = 0 if self.tie_embeddings else self.lm_head_params
        return embedding + self.linear_params + norms + head

    @property
    def weight_bytes(self) -> int:
        """Bytes the weights occupy in HBM."""
        return self.num_params * self.bytes_per_param

    @property
    def step_weight_bytes(self) -> int:
        """Bytes a step streams from HBM — every matmul weight once, LM head included.

        The embedding lookup reads one row per token, not the table, so it is left out (a
        tied table is read once, as the LM head).
        """
        return (self.linear_params + self.lm_head_params) * self.bytes_per_param

    @property
    def linear_flops_per_token(self) -> int:
        """FLOPs one token spends in the layers' matmuls (two per multiply-add)."""
        return 2 * self.linear_params

    @property
    def lm_head_flops_per_token(self) -> int:
        """FLOPs of the LM head for one token whose logits are computed."""
        return 2 * self.lm_head_params

    @property
    def attention_flops_per_pair(self) -> int:
        """FLOPs of one (query token, key token) pair over all layers and heads — QK^T and PV."""
        return 4 * self.num_layers * self.num_heads * self.head_dim

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes one token of context occupies (K and V, all layers)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_bytes_per_element

    def check_tensor_parallel(self, tensor_parallel: int) -> None:
        """Raise :class:`~phasesched.errors.InvalidArgumentError` unless the model shards over ``tensor_parallel`` GPUs.

        Query heads must split evenly; KV heads must split evenly or, when fewer than the GPUs,
        divide them (each KV head is then replicated, as vLLM does).
        """
        tp = tensor_parallel
        if tp < 1 or self.num_heads % tp:
            msg = f"tensor_parallel={tp} must be a positive divisor of num_heads={self.num_heads}"
            raise InvalidArgumentError(msg)
        if self.num_kv_heads % tp and tp % self.num_kv_heads:
            msg = f"tensor_parallel={tp} neither divides nor is a multiple of num_kv_heads={self.num_kv_heads}"
            raise InvalidArgumentError(msg)

    def kv_heads_per_gpu(self, tensor_parallel: int) -> int:
        """KV heads each GPU stores under ``tensor_parallel``-way sharding (at least one)."""
        return max(1, self.num_kv_heads // tensor_parallel)


LLAMA_3_8B = ModelSpec(
    name="llama-3-8b",
    num_layers=32,
    hidden_size=4096,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    intermediate_size=14336,
    vocab_size=128256,
)
"""Meta-Llama-3-8B (``config.json`` on the Hugging Face hub): 8.03B parameters, GQA 32/8."""

LLAMA_3_70B = ModelSpec(
    name="llama-3-70b",
    num_layers=80,
    hidden_size=8192,
    num_heads=64,
    num_kv_heads=8,
    head_dim=128,
    intermediate_size=28672,
    vocab_size=128256,
)
"""Meta-Llama-3-70B (``config.json`` on the Hugging Face hub): 70.6B parameters, GQA 64/8."""

MODEL_PRESETS: Mapping[str, ModelSpec] = types.MappingProxyType({m.name: m for m in (LLAMA_3_8B, LLAMA_3_70B)})
"""Every model preset by name (read-only)."""


def model_by_name(name: str) -> ModelSpec:
    """The preset called ``name`` (case-insensitive).

    Raises:
        UnknownNameError: No preset has that name; the message lists the known ones.

    """
    for known, model in MODEL_PRESETS.items():
        if known.lower() == name.lower():
            return model
    msg = f"no model preset named {name!r}; known: {', '.join(MODEL_PRESETS)}"
    raise UnknownNameError(msg)
