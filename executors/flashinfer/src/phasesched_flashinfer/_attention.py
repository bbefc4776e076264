"""The FlashInfer attention backend: plan once per step, run once per layer.

:class:`FlashInferBackend` owns one float workspace shared by its wrappers, a mixed-batch
``BatchPrefillWithPagedKVCacheWrapper`` (causal, ``backend="fa2"``; decode slices are simply
one-row slices) and a decode-only ``BatchDecodeWithPagedKVCacheWrapper`` (``backend="fa2"``,
tensor cores for grouped-query attention). Per step it packs the metadata into one int32
array, copies it to the device once, and plans the right wrapper from the host copy (plan()
reads indptrs on the host, so CPU int32 tensors avoid a device sync). Per layer,
:class:`FlashInferAttention` rotates q and k in place (RoPE outside attention, keys stored
rotated, ``pos_encoding_mode="NONE"``), appends k and v to the paged cache, and runs the
planned wrapper.

``backend="fa2"`` is pinned: on Hopper ``"auto"`` would pick fa3, whose kernels take far longer
to build ahead of time and which the offline bundle does not ship.
"""

from __future__ import annotations

from collections import Counter

import attrs
import torch

from phasesched_flashinfer._kernels import DecodeWrapper, FlashInferKernels, PrefillWrapper
from phasesched_flashinfer._metadata import MetadataTensors, StepMetadata, pack_metadata
from phasesched_torch import Llama3RopeScaling, LlamaConfig

__all__ = ["FlashInferAttention", "FlashInferBackend", "MetadataStaging", "RopeParams"]

KV_LAYOUT = "NHD"
BACKEND = "fa2"


@attrs.frozen
class RopeParams:
    """How FlashInfer's RoPE kernels rotate this model's heads (the rotate-half form, full head dim).

    Attributes:
        theta: The RoPE base.
        scaling: Llama 3.1's frequency scaling, or ``None`` for plain RoPE.

    """

    theta: float
    scaling: Llama3RopeScaling | None

    @classmethod
    def of(cls, config: LlamaConfig) -> RopeParams:
        """The RoPE of ``config``."""
        return cls(config.rope_theta, config.rope_scaling)

    def apply(self, kernels: FlashInferKernels, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> None:
        """Rotate ``q`` ``[T, Hq, D]`` and ``k`` ``[T, Hkv, D]`` in place at ``positions`` (int32 ``[T]``)."""
        s = self.scaling
        if s is None:
            kernels.apply_rope_pos_ids_inplace(q, k, positions, rope_theta=self.theta)
            return
        # FlashInfer's blend s = clamp((L * f / 2pi - low) / (high - low), 0, 1),
        # f' = (1 - s) f / factor + s f, is transformers' "llama3" rope_type.
        kernels.apply_llama31_rope_pos_ids_inplace(
            q,
            k,
            positions,
            rope_scale=s.factor,
            rope_theta=self.theta,
            low_freq_factor=s.low_freq_factor,
            high_freq_factor=s.high_freq_factor,
            old_context_len=s.original_max_position_embeddings,
        )


@attrs.frozen(eq=False)
class FlashInferAttention:
    """One step's planned attention (a :class:`phasesched_torch.StepAttention`).

    Attributes:
        kernels: The ``flashinfer`` module (or a stand-in with its semantics).
        wrapper: The prefill or decode wrapper, planned for this step.
        rope: The model's RoPE.
        meta: The step's metadata on the device (append reads it there).
        dtype: The dtype the wrapper was planned for (FlashInfer checks q against it).

    """

    kernels: FlashInferKernels
    wrapper: PrefillWrapper | DecodeWrapper
    rope: RopeParams
    meta: MetadataTensors
    dtype: torch.dtype

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        """Rotate ``q`` and ``k`` in place, append ``k``/``v`` to ``kv_cache``, attend; ``[T, Hq, D]`` out.

        Raises:
            ValueError: ``q``'s rows or dtype disagree with the plan (FlashInfer would misread it).

        """
        rows = self.meta.positions.shape[0]
        if q.shape[0] != rows or q.dtype != self.dtype or k.dtype != self.dtype:
            msg = f"q {tuple(q.shape)} {q.dtype} does not fit a plan for {rows} rows of {self.dtype}"
            raise ValueError(msg)
        m = self.meta
        self.rope.apply(self.kernels, q, k, m.positions)
        self.kernels.append_paged_kv_cache(
            k, v, m.batch_indices, m.positions, kv_cache, m.kv_indices, m.kv_indptr, m.kv_last_page_len, KV_LAYOUT
        )
        return self.wrapper.run(q, kv_cache)


@attrs.define
class MetadataStaging:
    """A host buffer (pinned on CUDA) and a device buffer that each step's metadata goes through.

    Reused from step to step, so a step costs no allocation and one asynchronous copy. Reuse is
    safe because every step ends with its sampled tokens copied to the host, which waits for
    the step's copies; the views of one step are invalid once the next is uploaded.

    Attributes:
        device: Where the kernels run.

    """

    device: torch.device
    _host: torch.Tensor = attrs.field(init=False)
    _device: torch.Tensor = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._allocate(1 << 14)

    def _allocate(self, size: int) -> None:
        # Normal tensors even when a step grows them under inference_mode: they are written
        # in place again by steps prepared outside it.
        with torch.inference_mode(mode=False):
            self._host = torch.empty(size, dtype=torch.int32, pin_memory=self.device.type == "cuda")
            self._device = torch.empty(size, dtype=torch.int32, device=self.device)

    def upload(self, meta: StepMetadata, target: torch.Tensor | None = None) -> tuple[MetadataTensors, MetadataTensors]:
        """Pack ``meta`` and copy it to the device; return ``(host views, device views)``.

        Args:
            meta: The step's metadata.
            target: A device int32 buffer to copy into instead of the staging one (a CUDA
                graph's static inputs); it must hold the packed array.

        """
        packed = pack_metadata(meta)
        size = len(packed)
        if size > self._host.numel():
            self._allocate(max(size, 2 * self._host.numel()))
        self._host[:size].numpy()[:] = packed
        device = self._device if target is None else target
        device[:size].copy_(self._host[:size], non_blocking=True)
        return MetadataTensors.view(self._host, meta), MetadataTensors.view(device, meta)


class FlashInferBackend:
    """Plans each step's FlashInfer attention for one model, dtype and page size.

    Args:
        kernels: The ``flashinfer`` module (:func:`~phasesched_flashinfer.load_flashinfer`).
        config: The model (heads, head dim, RoPE).
        page_size: Tokens per KV page.
        device: The GPU (or the CPU, with a stand-in for ``kernels``).
        dtype: ``torch.bfloat16`` or ``torch.float16``: queries, keys, values and outputs.
        workspace_bytes: The float workspace, shared by every wrapper (split-KV partials).
        decode_tensor_cores: Run decode-only steps on the tensor-core (fa2 prefill) kernel;
            FlashInfer recommends it from four query heads per kv head.

    Attributes:
        workspace: uint8 ``[workspace_bytes]`` on ``device``.
        path_counts: Steps planned per path: ``"prefill"`` (mixed or prefill) and ``"decode"``.

    """

    def __init__(  # noqa: PLR0913 -- keyword-only knobs of one backend
        self,
        kernels: FlashInferKernels,
        config: LlamaConfig,
        *,
        page_size: int,
        device: torch.device,
        dtype: torch.dtype,
        workspace_bytes: int,
        decode_tensor_cores: bool,
    ) -> None:
        self.kernels = kernels
        self.config = config
        self.page_size = page_size
        self.dtype = dtype
        self.rope = RopeParams.of(config)
        self.decode_tensor_cores = decode_tensor_cores
        # FlashInfer asks for a zeroed workspace on first use.
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=device)
        self.prefill = kernels.BatchPrefillWithPagedKVCacheWrapper(self.workspace, KV_LAYOUT, backend=BACKEND)
        self.decode = kernels.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, KV_LAYOUT, use_tensor_cores=decode_tensor_cores, backend=BACKEND
        )
        self.staging = MetadataStaging(device)
        self.path_counts: Counter[str] = Counter()

    def plan(self, meta: StepMetadata) -> tuple[FlashInferAttention, MetadataTensors]:
        """Upload ``meta`` and plan the step's wrapper: decode-only steps take the decode kernel.

        Returns:
            The step's attention, and the device views of its metadata (token ids, sample rows).

        """
        host, dev = self.staging.upload(meta)
        wrapper: PrefillWrapper | DecodeWrapper
        if meta.is_decode_only:
            self.plan_decode(self.decode, host, dev)
            wrapper = self.decode
        else:
            c = self.config
            self.prefill.plan(
                host.qo_indptr,
                host.kv_indptr,
                dev.kv_indices,
                host.kv_last_page_len,
                c.num_heads,
                c.num_kv_heads,
                c.head_dim,
                self.page_size,
                causal=True,
                pos_encoding_mode="NONE",
                q_data_type=self.dtype,
                kv_data_type=self.dtype,
            )
            wrapper = self.prefill
        self.path_counts["decode" if meta.is_decode_only else "prefill"] += 1
        return FlashInferAttention(self.kernels, wrapper, self.rope, dev, self.dtype), dev

    def plan_decode(self, wrapper: DecodeWrapper, host: MetadataTensors, dev: MetadataTensors) -> None:
        """Plan a decode wrapper (eager, or a CUDA-graph one with fixed buffers) for one step."""
        c = self.config
        wrapper.plan(
            host.kv_indptr,
            dev.kv_indices,
            host.kv_last_page_len,
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
            self.page_size,
            pos_encoding_mode="NONE",
            q_data_type=self.dtype,
            kv_data_type=self.dtype,
        )
