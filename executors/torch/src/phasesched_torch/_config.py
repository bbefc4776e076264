"""The model configuration: a frozen value, readable from Hugging Face configs, with named presets.

Field names follow the shapes they set (``num_layers``, ``num_kv_heads``) rather than
``transformers``' historical names; :meth:`LlamaConfig.from_hf` and :meth:`LlamaConfig.to_hf`
translate. Presets give the published Llama 3 shapes so a profiler can time a real-sized model
with random weights, without a checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from phasesched.errors import UnknownNameError
from phasesched_torch._errors import UnsupportedConfigError

__all__ = ["PRESETS", "Llama3RopeScaling", "LlamaConfig"]

_positive = attrs.validators.gt(0)
_positive_float = attrs.validators.gt(0.0)


@attrs.frozen
class Llama3RopeScaling:
    """Llama 3.1's RoPE frequency scaling (``rope_type: "llama3"`` in Hugging Face configs).

    Wavelengths longer than ``original_max_position_embeddings / low_freq_factor`` are divided
    by ``factor``, those shorter than ``... / high_freq_factor`` are kept, and the band between
    is blended, so the model extrapolates to longer contexts without retraining short-range heads.

    Attributes:
        factor: Divisor of the low frequencies.
        low_freq_factor: Sets the wavelength above which frequencies are fully scaled.
        high_freq_factor: Sets the wavelength below which frequencies are kept.
        original_max_position_embeddings: The pre-training context length.

    """

    factor: float = attrs.field(default=8.0, validator=_positive_float)
    low_freq_factor: float = attrs.field(default=1.0, validator=_positive_float)
    high_freq_factor: float = attrs.field(default=4.0, validator=_positive_float)
    original_max_position_embeddings: int = attrs.field(default=8192, validator=_positive)

    def __attrs_post_init__(self) -> None:
        if self.high_freq_factor <= self.low_freq_factor:
            msg = f"high_freq_factor ({self.high_freq_factor}) must exceed low_freq_factor ({self.low_freq_factor})"
            raise ValueError(msg)


def _default_head_dim(config: LlamaConfig) -> int:
    return config.hidden_size // config.num_heads


@attrs.frozen
class LlamaConfig:
    """A Llama-architecture decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU MLP.

    Attributes:
        vocab_size: Rows of the embedding and of the LM head.
        hidden_size: Width of the residual stream.
        intermediate_size: Width of the SwiGLU MLP.
        num_layers: Decoder layers.
        num_heads: Query heads.
        num_kv_heads: Key/value heads; query head ``h`` reads kv head ``h // (num_heads // num_kv_heads)``.
        head_dim: Width of one head (defaults to ``hidden_size // num_heads``).
        rms_norm_eps: RMSNorm epsilon.
        rope_theta: RoPE base.
        rope_scaling: Llama 3.1 frequency scaling, or ``None`` for plain RoPE.
        tie_word_embeddings: The LM head reuses the embedding matrix.
        attention_bias: q/k/v/o projections carry biases.
        mlp_bias: gate/up/down projections carry biases.
        max_position_embeddings: The context length the model was trained for (informational:
            RoPE is computed on the fly, so longer positions run).

    >>> config = LlamaConfig.preset("tiny")
    >>> config.num_heads // config.num_kv_heads, config.head_dim
    (2, 16)
    >>> LlamaConfig.from_hf(config.to_hf()) == config
    True

    """

    vocab_size: int = attrs.field(validator=_positive)
    hidden_size: int = attrs.field(validator=_positive)
    intermediate_size: int = attrs.field(validator=_positive)
    num_layers: int = attrs.field(validator=_positive)
    num_heads: int = attrs.field(validator=_positive)
    num_kv_heads: int = attrs.field(validator=_positive)
    head_dim: int = attrs.field(default=attrs.Factory(_default_head_dim, takes_self=True), validator=_positive)
    rms_norm_eps: float = attrs.field(default=1e-6, validator=_positive_float)
    rope_theta: float = attrs.field(default=10000.0, validator=_positive_float)
    rope_scaling: Llama3RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    max_position_embeddings: int = attrs.field(default=2048, validator=_positive)

    def __attrs_post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            msg = f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            raise ValueError(msg)
        if self.head_dim % 2:
            msg = f"head_dim must be even for rotary embeddings, got {self.head_dim}"
            raise ValueError(msg)

    @property
    def group_size(self) -> int:
        """Query heads per kv head."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def preset(cls, name: str) -> LlamaConfig:
        """The preset called ``name`` (see :data:`PRESETS`).

        Raises:
            UnknownNameError: No preset has that name; the message lists those that do.

        """
        config = PRESETS.get(name)
        if config is None:
            msg = f"no model preset named {name!r}; known: {', '.join(sorted(PRESETS))}"
            raise UnknownNameError(msg)
        return config

    @classmethod
    def from_hf(cls, config: Mapping[str, Any] | Any) -> LlamaConfig:
        """Read a Hugging Face Llama config: a ``config.json`` dict or a ``transformers`` config.

        Both RoPE spellings are understood: ``rope_parameters`` (transformers 5) and the older
        ``rope_theta`` plus ``rope_scaling``.

        Raises:
            UnsupportedConfigError: A required field is missing, or the config asks for
                something this model does not implement (another activation or RoPE type).

        """
        values = _hf_values(config)
        act = values.get("hidden_act", "silu")
        if act != "silu":
            msg = f"hidden_act {act!r} is not supported (Llama uses 'silu')"
            raise UnsupportedConfigError(msg)
        heads = int(_required(values, "num_attention_heads"))
        hidden = int(_required(values, "hidden_size"))
        theta, scaling = _rope_from_hf(values)
        return cls(
            vocab_size=int(_required(values, "vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(_required(values, "intermediate_size")),
            num_layers=int(_required(values, "num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=int(values.get("num_key_value_heads") or heads),
            head_dim=int(values.get("head_dim") or hidden // heads),
            rms_norm_eps=float(values.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(values.get("tie_word_embeddings", False)),
            attention_bias=bool(values.get("attention_bias", False)),
            mlp_bias=bool(values.get("mlp_bias", False)),
            max_position_embeddings=int(values.get("max_position_embeddings", 2048)),
        )

    def to_hf(self) -> dict[str, Any]:
        """Keyword arguments for ``transformers.LlamaConfig`` (transformers 5 RoPE spelling)."""
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope = {"rope_type": "llama3", "rope_theta": self.rope_theta, **attrs.asdict(self.rope_scaling)}
        return {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": rope,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "mlp_bias": self.mlp_bias,
            "max_position_embeddings": self.max_position_embeddings,
        }


def _hf_values(config: Mapping[str, Any] | Any) -> Mapping[str, Any]:
    if isinstance(config, Mapping):
        return config
    to_dict = getattr(config, "to_dict", None)
    if to_dict is None:
        msg = f"expected a config dict or a transformers config, got {type(config).__name__}"
        raise TypeError(msg)
    values = to_dict()
    assert isinstance(values, Mapping)
    return values


def _required(values: Mapping[str, Any], key: str) -> Any:
    if values.get(key) is None:
        msg = f"the config has no {key!r}"
        raise UnsupportedConfigError(msg)
    return values[key]


def _rope_from_hf(values: Mapping[str, Any]) -> tuple[float, Llama3RopeScaling | None]:
    params: Mapping[str, Any] = values.get("rope_parameters") or values.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", values.get("rope_theta", 10000.0)))
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedConfigError("partial_rotary_factor != 1 is not supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type == "llama3":
        scaling = Llama3RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
        return theta, scaling
    msg = f"rope_type {rope_type!r} is not supported (only 'default' and 'llama3')"
    raise UnsupportedConfigError(msg)


_LLAMA31_ROPE = Llama3RopeScaling(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)
_LLAMA3_8B = LlamaConfig(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    max_position_embeddings=8192,
)
_LLAMA3_70B = attrs.evolve(
    _LLAMA3_8B, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64, head_dim=128
)

PRESETS: Mapping[str, LlamaConfig] = {
    # Small enough for CPU tests: two layers, GQA with two query heads per kv head.
    "tiny": LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2
    ),
    "llama-3-8b": _LLAMA3_8B,
    "llama-3.1-8b": attrs.evolve(_LLAMA3_8B, rope_scaling=_LLAMA31_ROPE, max_position_embeddings=131072),
    "llama-3-70b": _LLAMA3_70B,
    "llama-3.1-70b": attrs.evolve(_LLAMA3_70B, rope_scaling=_LLAMA31_ROPE, max_position_embeddings=131072),
    "llama-3.2-1b": LlamaConfig(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        tie_word_embeddings=True,
        rope_scaling=Llama3RopeScaling(factor=32.0, original_max_position_embeddings=8192),
        max_position_embeddings=131072,
    ),
}
"""Named model shapes: ``tiny`` for tests, published Llama 3 shapes for profiling with random weights."""
