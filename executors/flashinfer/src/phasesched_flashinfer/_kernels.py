"""The slice of FlashInfer's API the executor uses, as Protocols, and its lazy import.

``flashinfer`` is imported only by :func:`load_flashinfer`, called when a GPU executor is
built: ``import phasesched_flashinfer`` (and ``phasesched``, and the CPU test-suite) never
needs it. Typing the module as :class:`FlashInferKernels` keeps mypy strict without stubs, and
lets tests run the executor's plumbing on the CPU with a fake that implements the documented
semantics in plain PyTorch.

Signatures follow flashinfer-python 0.7.2 (``BatchPrefillWithPagedKVCacheWrapper.plan`` takes
its options positionally or by keyword; ``BatchDecodeWithPagedKVCacheWrapper.plan`` takes them
by keyword only). Only the parameters the executor passes are listed.
"""

from __future__ import annotations

import importlib
from typing import Protocol, cast

import torch

from phasesched_flashinfer._errors import FlashInferUnavailableError

__all__ = ["DecodeWrapper", "FlashInferKernels", "PrefillWrapper", "load_flashinfer"]


class PrefillWrapper(Protocol):
    """``flashinfer.BatchPrefillWithPagedKVCacheWrapper``: plan once per step, run once per layer."""

    def plan(  # noqa: PLR0913, PLR0917 -- FlashInfer's signature
        self,
        qo_indptr: torch.Tensor,
        paged_kv_indptr: torch.Tensor,
        paged_kv_indices: torch.Tensor,
        paged_kv_last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim_qk: int,
        page_size: int,
        *,
        causal: bool,
        pos_encoding_mode: str,
        q_data_type: torch.dtype,
        kv_data_type: torch.dtype,
    ) -> None:
        """Precompute the step's work partition from host metadata (CPU int32 indptrs)."""
        ...

    def run(self, q: torch.Tensor, paged_kv_cache: torch.Tensor) -> torch.Tensor:
        """Attention of ``q`` ``[T, Hq, D]`` over one layer's cache; returns ``[T, Hq, D]``."""
        ...


class DecodeWrapper(Protocol):
    """``flashinfer.BatchDecodeWithPagedKVCacheWrapper``: one query row per slice."""

    def plan(  # noqa: PLR0913, PLR0917 -- FlashInfer's signature
        self,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        *,
        pos_encoding_mode: str,
        q_data_type: torch.dtype,
        kv_data_type: torch.dtype,
    ) -> None:
        """Precompute the step's work partition from host metadata (CPU int32 indptr)."""
        ...

    def run(self, q: torch.Tensor, paged_kv_cache: torch.Tensor) -> torch.Tensor:
        """Attention of ``q`` ``[B, Hq, D]`` over one layer's cache; returns ``[B, Hq, D]``."""
        ...


class PrefillWrapperFactory(Protocol):
    """The prefill wrapper's constructor."""

    def __call__(self, float_workspace_buffer: torch.Tensor, kv_layout: str, *, backend: str) -> PrefillWrapper:
        """A wrapper sharing ``float_workspace_buffer`` (uint8, on the GPU)."""
        ...


class DecodeWrapperFactory(Protocol):
    """The decode wrapper's constructor."""

    def __call__(  # noqa: PLR0913 -- FlashInfer's signature
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str,
        *,
        use_cuda_graph: bool = False,
        use_tensor_cores: bool = False,
        paged_kv_indptr_buffer: torch.Tensor | None = None,
        paged_kv_indices_buffer: torch.Tensor | None = None,
        paged_kv_last_page_len_buffer: torch.Tensor | None = None,
        backend: str,
    ) -> DecodeWrapper:
        """A wrapper sharing ``float_workspace_buffer``; graph mode fixes its buffers."""
        ...


class FlashInferKernels(Protocol):
    """What the executor calls on the ``flashinfer`` module."""

    @property
    def BatchPrefillWithPagedKVCacheWrapper(self) -> PrefillWrapperFactory:  # noqa: N802 -- FlashInfer's name
        """The prefill (and mixed-batch) wrapper class."""
        ...

    @property
    def BatchDecodeWithPagedKVCacheWrapper(self) -> DecodeWrapperFactory:  # noqa: N802 -- FlashInfer's name
        """The decode wrapper class."""
        ...

    def apply_rope_pos_ids_inplace(
        self, q: torch.Tensor, k: torch.Tensor, pos_ids: torch.Tensor, *, rope_theta: float
    ) -> None:
        """Rotate ``q`` ``[T, Hq, D]`` and ``k`` ``[T, Hkv, D]`` at ``pos_ids`` (rotate-half form)."""
        ...

    def apply_llama31_rope_pos_ids_inplace(  # noqa: PLR0913 -- FlashInfer's signature
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        pos_ids: torch.Tensor,
        *,
        rope_scale: float,
        rope_theta: float,
        low_freq_factor: float,
        high_freq_factor: float,
        old_context_len: int,
    ) -> None:
        """Rotate with Llama 3.1's frequency scaling."""
        ...

    def append_paged_kv_cache(  # noqa: PLR0913, PLR0917 -- FlashInfer's signature
        self,
        append_key: torch.Tensor,
        append_value: torch.Tensor,
        batch_indices: torch.Tensor,
        positions: torch.Tensor,
        paged_kv_cache: torch.Tensor,
        kv_indices: torch.Tensor,
        kv_indptr: torch.Tensor,
        kv_last_page_len: torch.Tensor,
        kv_layout: str,
    ) -> None:
        """Write each row's key and value at its slice's ``positions`` (device int32 metadata)."""
        ...


def load_flashinfer() -> FlashInferKernels:
    """Import ``flashinfer`` (only now), or say plainly why it cannot be used.

    A kernel module that is neither prebuilt nor compilable surfaces later, at the first
    ``plan()`` or kernel call, as FlashInfer's own ``MissingJITCacheError`` naming the module
    (with ``FLASHINFER_DISABLE_JIT=1``, as the offline GPU check runs).

    Raises:
        FlashInferUnavailableError: ``flashinfer`` is not installed or fails to import.

    """
    try:
        module = importlib.import_module("flashinfer")
    except Exception as error:
        hint = "pip install 'phasesched-flashinfer[gpu]' on a CUDA machine, or the offline bundle (gpu_check/)"
        msg = f"flashinfer cannot be imported ({type(error).__name__}: {error}); {hint}"
        raise FlashInferUnavailableError(msg) from error
    return cast("FlashInferKernels", module)
