"""The Llama forward pass over one step's ragged batch, reading and writing a paged KV cache.

There is no padding and no batch dimension: the step's ``T`` query tokens, from every slice, are
one ``[T, hidden]`` matrix through every projection, and only attention looks at slice
boundaries, through the :class:`~phasesched_torch.PagedAttentionPlan`. Logits are computed only
for rows that sample, since the LM head is the largest matmul of a decode step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from os import PathLike
from typing import Protocol, runtime_checkable

import attrs
import torch
import torch.nn.functional as F  # noqa: N812 -- the universal torch idiom

from phasesched_torch._attention import PagedAttentionPlan, run_paged_attention
from phasesched_torch._config import LlamaConfig
from phasesched_torch._errors import UnsupportedConfigError
from phasesched_torch._kv_cache import write_paged_kv
from phasesched_torch._rope import apply_rope, rope_inv_freq
from phasesched_torch._weights import (
    LayerWeights,
    LlamaWeights,
    load_safetensors,
    random_weights,
    weights_from_state_dict,
)

__all__ = ["ForwardBatch", "LlamaModel", "SlidingWindowAttention", "StepAttention", "TorchAttention"]


class StepAttention(Protocol):
    """One step's attention, planned once from the step's metadata and called by every layer.

    This is the seam an attention library plugs into: the model computes projections, norms
    and the MLP, and hands each layer's unrotated queries, keys and values here.
    :class:`TorchAttention` is the reference; ``phasesched_flashinfer`` provides FlashInfer's.
    """

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        """Rotate ``q`` and ``k`` at the step's positions, write ``k`` and ``v`` into ``kv_cache``, attend.

        Args:
            q: ``[T, Hq, D]`` in the model's dtype, not yet rotated (may be rotated in place).
            k: ``[T, Hkv, D]``, not yet rotated (may be rotated in place).
            v: ``[T, Hkv, D]``.
            kv_cache: One layer's NHD cache ``[num_pages, 2, page_size, Hkv, D]``, written in place.

        Returns:
            ``[T, Hq, D]`` in ``q.dtype``: each row's attention over its slice's cached context,
            this step's own keys included.

        """
        ...


@runtime_checkable
class SlidingWindowAttention(StepAttention, Protocol):
    """A :class:`StepAttention` that declares the sliding window its masks apply.

    A model with ``sliding_window`` set runs only with attention of this kind whose
    ``window_left`` is the config's :attr:`LlamaConfig.window_left`: an attention that does not
    declare its window is assumed to attend to the whole context, and is refused.
    """

    @property
    def window_left(self) -> int:
        """How far back a query sees, in positions before it (-1 for the whole context)."""
        ...


@attrs.frozen(eq=False)
class TorchAttention:
    """The reference :class:`StepAttention`: RoPE, KV writes and paged attention in plain PyTorch.

    Attributes:
        cos: float32 ``[T, head_dim // 2]``: RoPE cosines at each row's absolute position.
        sin: float32 ``[T, head_dim // 2]``: RoPE sines.
        write_slots: ``(pages, offsets)``, each int64 ``[T]``: the cache page each row's key
            and value go to, and the row within it.
        plan: Gather indices and masks for paged attention.

    """

    cos: torch.Tensor
    sin: torch.Tensor
    write_slots: tuple[torch.Tensor, torch.Tensor]
    plan: PagedAttentionPlan

    @property
    def window_left(self) -> int:
        """The plan's sliding window (see :class:`SlidingWindowAttention`)."""
        return self.plan.window_left

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        """See :meth:`StepAttention.__call__`; math in float32 (``q`` and ``k`` are not modified)."""
        q = apply_rope(q, self.cos, self.sin)
        k = apply_rope(k, self.cos, self.sin)
        # Write before attending: this step's own keys are part of the context it attends to.
        write_paged_kv(kv_cache, k, v, self.write_slots)
        out, _ = run_paged_attention(self.plan, q, kv_cache)
        return out


@attrs.frozen(eq=False)
class ForwardBatch:
    """One step's inputs on the model's device, derived once from a plan and read by every layer.

    Attributes:
        input_ids: int64 (or int32) ``[T]``: token of each query row.
        attention: The step's planned attention (RoPE, KV writes, paged attention).
        sample_rows: int64 (or int32) ``[S]``: query rows whose logits are wanted (the last row
            of each sampling slice), in batch order.

    """

    input_ids: torch.Tensor
    attention: StepAttention
    sample_rows: torch.Tensor


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32, cast back before the weight multiplies (``transformers``' order)."""
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


@attrs.frozen(eq=False)
class LlamaModel:
    """A Llama decoder: weights plus the forward pass. Build it with a classmethod.

    Attributes:
        config: The architecture.
        weights: The tensors, on one device in one dtype.
        inv_freq: float32 ``[head_dim // 2]``: RoPE inverse frequencies on that device.

    >>> model = LlamaModel.random(LlamaConfig.preset("tiny"), seed=0)
    >>> len(model.new_kv_cache(num_pages=8, page_size=4))
    2

    """

    config: LlamaConfig
    weights: LlamaWeights
    inv_freq: torch.Tensor

    @classmethod
    def random(
        cls,
        config: LlamaConfig,
        *,
        seed: int = 0,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        std: float = 0.02,
    ) -> LlamaModel:
        """A model with seeded random weights (for tests and for profiling without a checkpoint)."""
        dev = torch.device(device)
        weights = random_weights(config, seed=seed, device=dev, dtype=dtype, std=std)
        return cls(config, weights, rope_inv_freq(config, dev))

    @classmethod
    def from_state_dict(
        cls,
        config: LlamaConfig,
        state_dict: Mapping[str, torch.Tensor],
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> LlamaModel:
        """A model from a ``LlamaForCausalLM`` state dict.

        Raises:
            StateDictError: A tensor is missing, unexpected or mis-shaped (the error names it).

        """
        dev = torch.device(device)
        weights = weights_from_state_dict(config, state_dict, device=dev, dtype=dtype)
        return cls(config, weights, rope_inv_freq(config, dev))

    @classmethod
    def from_safetensors(
        cls,
        config: LlamaConfig,
        path: str | PathLike[str],
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> LlamaModel:
        """A model from a safetensors file or a directory of shards, in ``LlamaForCausalLM`` naming."""
        return cls.from_state_dict(config, load_safetensors(path), device=device, dtype=dtype)

    @property
    def device(self) -> torch.device:
        """Where the weights live."""
        return self.weights.embed.device

    @property
    def dtype(self) -> torch.dtype:
        """The weights' (and the cache's) dtype."""
        return self.weights.embed.dtype

    def new_kv_cache(self, num_pages: int, page_size: int) -> list[torch.Tensor]:
        """A zeroed paged cache: per layer ``[num_pages, 2, page_size, num_kv_heads, head_dim]`` (NHD).

        Zeros rather than uninitialised memory, so a plan that reads pages never written
        (a profiler's synthetic decode) computes finite numbers.
        """
        shape = (num_pages, 2, page_size, self.config.num_kv_heads, self.config.head_dim)
        return [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in range(self.config.num_layers)]

    def forward(self, batch: ForwardBatch, kv_cache: Sequence[torch.Tensor]) -> torch.Tensor:
        """Run one step: write every row's keys and values, and return the sampling rows' logits.

        Args:
            batch: The step's inputs (see :class:`ForwardBatch`).
            kv_cache: One NHD cache tensor per layer, written in place.

        Returns:
            float32 ``[S, vocab_size]``: logits of ``batch.sample_rows``.

        Raises:
            UnsupportedConfigError: The model has a sliding window that ``batch.attention``
                does not declare (see :class:`SlidingWindowAttention`); nothing was written.

        """
        self._check_window(batch.attention)
        config, weights = self.config, self.weights
        x = F.embedding(batch.input_ids, weights.embed)
        for layer, cache in zip(weights.layers, kv_cache, strict=True):
            x = self._layer(layer, x, batch, cache)
        last = _rms_norm(x[batch.sample_rows], weights.norm, config.rms_norm_eps)
        return F.linear(last, weights.lm_head).to(torch.float32)

    def _check_window(self, attention: StepAttention) -> None:
        """Refuse an attention whose window is not the model's (it would be wrong past the window)."""
        want = self.config.window_left
        have = attention.window_left if isinstance(attention, SlidingWindowAttention) else -1
        if have != want:
            msg = (
                f"the {self.config.model_type} model attends within a sliding window of {self.config.sliding_window} "
                f"tokens, but {type(attention).__name__} applies window_left={have} (want {want})"
            )
            raise UnsupportedConfigError(msg)

    def _layer(self, w: LayerWeights, x: torch.Tensor, batch: ForwardBatch, cache: torch.Tensor) -> torch.Tensor:
        """One decoder layer: ``x`` ``[T, H]`` in, ``[T, H]`` out; writes this step's K/V into ``cache``."""
        config, rows = self.config, x.shape[0]
        hq, hkv, d = config.num_heads, config.num_kv_heads, config.head_dim
        h = _rms_norm(x, w.input_norm, config.rms_norm_eps)
        q, k, v = torch.split(F.linear(h, w.qkv, w.qkv_bias), [hq * d, hkv * d, hkv * d], dim=-1)
        attn = batch.attention(q.reshape(rows, hq, d), k.reshape(rows, hkv, d), v.reshape(rows, hkv, d), cache)
        x = x + F.linear(attn.reshape(rows, hq * d), w.o_proj, w.o_bias)
        h = _rms_norm(x, w.post_norm, config.rms_norm_eps)
        gate, up = F.linear(h, w.gate_up, w.gate_up_bias).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, w.down, w.down_bias)
