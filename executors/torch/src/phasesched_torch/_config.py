"""The model configuration: a frozen value, readable from Hugging Face configs, with named presets.

Field names follow the shapes they set (``num_layers``, ``num_kv_heads``) rather than
``transformers``' historical names; :meth:`LlamaConfig.from_hf` and :meth:`LlamaConfig.to_hf`
translate. Presets give the published Llama 3 shapes so a profiler can time a real-sized model
with random weights, without a checkpoint.

Three architectures share this decoder (:data:`ARCHITECTURES`): Llama, Mistral (Llama plus a
sliding attention window) and Qwen2 (Llama plus q/k/v biases). Any other ``model_type`` or
``architectures`` entry, and any config feature the decoder does not implement, is refused with
an :class:`UnsupportedConfigError` rather than silently run as a Llama.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from phasesched.errors import InvalidArgumentError, PhaseschedError, UnknownNameError
from phasesched_torch._errors import UnsupportedArchitectureError, UnsupportedConfigError

__all__ = ["ARCHITECTURES", "PRESETS", "Llama3RopeScaling", "LlamaConfig"]

ARCHITECTURES: Mapping[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
"""The Hugging Face ``model_type`` values this decoder implements, each with its model class."""

# transformers' MistralConfig and Qwen2Config default: a config.json without the key gets it.
_HF_DEFAULT_WINDOW = 4096
_HF_QWEN2_MAX_WINDOW_LAYERS = 28
_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")

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
            raise InvalidArgumentError(msg)


def _default_head_dim(config: LlamaConfig) -> int:
    return config.hidden_size // config.num_heads


@attrs.frozen
class LlamaConfig:
    """A Llama-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU MLP.

    ``model_type`` picks what the architecture fixes: ``"mistral"`` may set ``sliding_window``
    and has no biases; ``"qwen2"`` has q/k/v biases (no o or MLP bias) and may set
    ``sliding_window``; ``"llama"`` has no window and optional ``attention_bias``/``mlp_bias``.

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
        attention_bias: q/k/v/o projections carry biases (Llama only).
        mlp_bias: gate/up/down projections carry biases (Llama only).
        max_position_embeddings: The context length the model was trained for (informational:
            RoPE is computed on the fly, so longer positions run).
        model_type: The Hugging Face ``model_type``, a key of :data:`ARCHITECTURES`.
        sliding_window: Each query attends to the last ``sliding_window`` positions, itself
            included (``transformers``' definition), in every layer; ``None`` for full attention.

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
    model_type: str = "llama"
    sliding_window: int | None = attrs.field(default=None, validator=attrs.validators.optional(_positive))

    def __attrs_post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            msg = f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            raise InvalidArgumentError(msg)
        if self.head_dim % 2:
            msg = f"head_dim must be even for rotary embeddings, got {self.head_dim}"
            raise InvalidArgumentError(msg)
        if self.model_type not in ARCHITECTURES:
            raise UnsupportedArchitectureError(self.model_type, tuple(ARCHITECTURES))
        if self.model_type != "llama" and (self.attention_bias or self.mlp_bias):
            msg = f"{self.model_type} fixes its biases; attention_bias and mlp_bias apply to llama only"
            raise UnsupportedConfigError(msg)
        if self.model_type == "llama" and self.sliding_window is not None:
            msg = "llama has no sliding window (transformers' LlamaForCausalLM ignores it); use model_type='mistral'"
            raise UnsupportedConfigError(msg)

    @property
    def group_size(self) -> int:
        """Query heads per kv head."""
        return self.num_heads // self.num_kv_heads

    @property
    def qkv_bias(self) -> bool:
        """Whether q, k and v projections carry biases (``attention_bias``, or Qwen2's fixed ones)."""
        return self.attention_bias or self.model_type == "qwen2"

    @property
    def window_left(self) -> int:
        """The sliding window in FlashInfer's terms, the farthest key position back a query sees (-1 for none)."""
        return -1 if self.sliding_window is None else self.sliding_window - 1

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
        """Read a Hugging Face config: a ``config.json`` dict or a ``transformers`` config.

        The architecture comes from ``model_type`` (else ``architectures``; a dict with
        neither is read as a Llama). Both RoPE spellings are understood: ``rope_parameters``
        (transformers 5) and the older ``rope_theta`` plus ``rope_scaling``. Fields an
        architecture's ``transformers`` class ignores (a Mistral's ``attention_bias``) are
        ignored here too.

        Raises:
            UnsupportedArchitectureError: The ``model_type`` or an ``architectures`` entry is
                not in :data:`ARCHITECTURES` (the error names it).
            UnsupportedConfigError: A required field is missing or invalid, or the config asks
                for something this model does not implement (another activation or RoPE type,
                layers that mix sliding-window and full attention).

        """
        values = _hf_values(config)
        model_type = _model_type(values)
        act = values.get("hidden_act", "silu")
        if act != "silu":
            msg = f"hidden_act {act!r} is not supported (only 'silu')"
            raise UnsupportedConfigError(msg)
        try:
            return cls(**_fields_from_hf(values, model_type))
        except PhaseschedError:
            raise
        except (ValueError, TypeError) as error:
            msg = f"invalid {model_type} config: {error}"
            raise UnsupportedConfigError(msg) from error

    def to_hf(self) -> dict[str, Any]:
        """Keyword arguments for the ``transformers`` config of ``model_type`` (transformers 5 RoPE spelling).

        ``transformers.AutoConfig.for_model(config.model_type, **config.to_hf())`` builds it.
        """
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope = {"rope_type": "llama3", "rope_theta": self.rope_theta, **attrs.asdict(self.rope_scaling)}
        return {
            "architectures": [ARCHITECTURES[self.model_type]],
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
            "max_position_embeddings": self.max_position_embeddings,
            **self._hf_variant(),
        }

    def _hf_variant(self) -> dict[str, Any]:
        """The keys in which the three architectures' ``transformers`` configs differ."""
        if self.model_type == "mistral":
            return {"sliding_window": self.sliding_window}
        if self.model_type == "qwen2":
            if self.sliding_window is None:
                return {"use_sliding_window": False}
            return {"use_sliding_window": True, "sliding_window": self.sliding_window, "max_window_layers": 0}
        return {"attention_bias": self.attention_bias, "mlp_bias": self.mlp_bias}


def _hf_values(config: Mapping[str, Any] | Any) -> Mapping[str, Any]:
    if isinstance(config, Mapping):
        return config
    to_dict = getattr(config, "to_dict", None)
    if to_dict is None:
        msg = f"expected a config dict or a transformers config, got {type(config).__name__}"
        raise UnsupportedConfigError(msg)
    values = to_dict()
    assert isinstance(values, Mapping)
    return values


def _required(values: Mapping[str, Any], key: str) -> Any:
    if values.get(key) is None:
        msg = f"the config has no {key!r}"
        raise UnsupportedConfigError(msg)
    return values[key]


def _model_type(values: Mapping[str, Any]) -> str:
    """The config's ``model_type``, checked against :data:`ARCHITECTURES` and its ``architectures`` list."""
    by_class = {name: model_type for model_type, name in ARCHITECTURES.items()}
    architectures = tuple(values.get("architectures") or ())
    model_type = values.get("model_type")
    if model_type is None:  # a bare dict of Llama fields, or one naming only its class
        model_type = by_class.get(architectures[0], architectures[0]) if architectures else "llama"
    if model_type not in ARCHITECTURES:
        supported = ARCHITECTURES.values() if model_type in architectures else ARCHITECTURES
        raise UnsupportedArchitectureError(str(model_type), tuple(supported))
    for name in architectures:
        if by_class.get(name) != model_type:
            raise UnsupportedArchitectureError(str(name), (ARCHITECTURES[model_type],))
    return str(model_type)


def _fields_from_hf(values: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    """:class:`LlamaConfig`'s keyword arguments from a checked config dict."""
    heads = int(_required(values, "num_attention_heads"))
    hidden = int(_required(values, "hidden_size"))
    num_layers = int(_required(values, "num_hidden_layers"))
    theta, scaling = _rope_from_hf(values)
    biases = model_type == "llama"  # Mistral's and Qwen2's transformers classes fix their biases
    return {
        "vocab_size": int(_required(values, "vocab_size")),
        "hidden_size": hidden,
        "intermediate_size": int(_required(values, "intermediate_size")),
        "num_layers": num_layers,
        "num_heads": heads,
        "num_kv_heads": int(values.get("num_key_value_heads") or heads),
        "head_dim": int(values.get("head_dim") or hidden // heads),
        "rms_norm_eps": float(values.get("rms_norm_eps", 1e-6)),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "tie_word_embeddings": bool(values.get("tie_word_embeddings", False)),
        "attention_bias": biases and bool(values.get("attention_bias", False)),
        "mlp_bias": biases and bool(values.get("mlp_bias", False)),
        "max_position_embeddings": int(values.get("max_position_embeddings", 2048)),
        "model_type": model_type,
        "sliding_window": _sliding_window(values, model_type, num_layers),
    }


def _sliding_window(values: Mapping[str, Any], model_type: str, num_layers: int) -> int | None:
    """The window every layer uses, read as ``transformers`` reads it; mixed layers are refused."""
    if model_type == "llama":
        return None  # LlamaForCausalLM has no window, whatever the dict says
    window = values.get("sliding_window", _HF_DEFAULT_WINDOW)
    if model_type == "qwen2" and not values.get("use_sliding_window", False):
        window = None
    kinds = set(_layer_types(values, model_type, window, num_layers))
    if not kinds <= _LAYER_TYPES or len(kinds) > 1:
        msg = f"layer_types {sorted(kinds)} are not supported (every layer must use one of {sorted(_LAYER_TYPES)})"
        raise UnsupportedConfigError(msg)
    if kinds == {"full_attention"} and model_type == "qwen2":
        return None
    return None if window is None else int(window)


def _layer_types(values: Mapping[str, Any], model_type: str, window: object, num_layers: int) -> list[str]:
    """Each layer's attention kind: the config's ``layer_types``, else as ``Qwen2Config`` derives them."""
    given = values.get("layer_types")
    if given is not None:
        return [str(kind) for kind in given]
    if model_type != "qwen2":
        return []
    first = int(values.get("max_window_layers", _HF_QWEN2_MAX_WINDOW_LAYERS))
    return ["sliding_attention" if window is not None and i >= first else "full_attention" for i in range(num_layers)]


def _rope_from_hf(values: Mapping[str, Any]) -> tuple[float, Llama3RopeScaling | None]:
    params: Mapping[str, Any] = values.get("rope_parameters") or values.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", values.get("rope_theta", 10000.0)))
    if float(params.get("partial_rotary_factor", values.get("partial_rotary_factor", 1.0))) != 1.0:
        raise UnsupportedConfigError("partial_rotary_factor != 1 is not supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type == "llama3":
        missing = [key for key in _LLAMA3_KEYS if params.get(key) is None]
        if missing:
            msg = f"rope scaling of type 'llama3' has no {missing[0]!r}"
            raise UnsupportedConfigError(msg)
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
