"""Rotary position embeddings at absolute positions, including Llama 3.1's frequency scaling.

Keys are rotated *before* they are written to the cache (FlashInfer's ``pos_encoding_mode="NONE"``
convention), so a cached key never needs its position again. The rotation is Hugging Face's
``rotate_half`` form (first half / second half, not interleaved pairs) and is computed in
float32, then cast back, as FlashInfer's kernels do.
"""

from __future__ import annotations

import math

import torch

from phasesched_torch._config import Llama3RopeScaling, LlamaConfig

__all__ = ["apply_rope", "rope_angles", "rope_inv_freq"]


def rope_inv_freq(config: LlamaConfig, device: torch.device | str = "cpu") -> torch.Tensor:
    """Inverse frequencies of each rotated pair.

    Computed on the CPU exactly as ``transformers`` does, then moved, so positions rotate
    bit-identically to the reference implementation in float32.

    Returns:
        float32 ``[head_dim // 2]``.

    """
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    if config.rope_scaling is not None:
        inv_freq = _llama3_scale(inv_freq, config.rope_scaling)
    return inv_freq.to(device)


def _llama3_scale(inv_freq: torch.Tensor, scaling: Llama3RopeScaling) -> torch.Tensor:
    """Divide long wavelengths by ``factor``, keep short ones, blend the band in between."""
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosines and sines of every token's rotation angles; computed once per step, used by every layer.

    Args:
        positions: int ``[T]``: absolute position of each token.
        inv_freq: float32 ``[head_dim // 2]`` from :func:`rope_inv_freq`.

    Returns:
        ``(cos, sin)``, each float32 ``[T, head_dim // 2]``.

    """
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each head of each token by its position's angles.

    Args:
        x: ``[T, H, head_dim]``, any float dtype.
        cos: float32 ``[T, head_dim // 2]``.
        sin: float32 ``[T, head_dim // 2]``.

    Returns:
        ``[T, H, head_dim]`` in ``x.dtype``.

    """
    half = x.shape[-1] // 2
    xf = x.to(torch.float32)
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)
