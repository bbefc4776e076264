"""Step timing for the offline GPU check, and what the times mean against the hardware's peaks.

Nothing here imports FlashInfer. :func:`time_step` times one step of an executor: the whole
``execute`` (what the executor reports), the host's preparation (metadata, upload, ``plan()``),
and with device events the forward, the attention kernels and RoPE + KV append of every layer.
:func:`decode_plan` and :func:`prefill_plan` build the synthetic steps; :func:`step_accounting`
turns a timing into the figures the check reports: the executor's own time outside kernels as a
share of the step, the HBM bandwidth a decode achieves and the TFLOP/s a prefill achieves,
each against the GPU's peak (:data:`H200_HBM_BYTES_PER_S`, :data:`H200_BF16_FLOPS`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import attrs
import numpy as np
import torch

from phasesched import StepPlan
from phasesched.plan import build_step_plan
from phasesched_flashinfer._attention import FlashInferAttention
from phasesched_flashinfer._executor import FlashInferExecutor
from phasesched_torch import LlamaModel, TorchExecutor

__all__ = [
    "H200_BF16_FLOPS",
    "H200_HBM_BYTES_PER_S",
    "StepTiming",
    "decode_plan",
    "device_time",
    "prefill_plan",
    "step_accounting",
    "time_decode",
    "time_decode_step",
    "time_step",
]

H200_HBM_BYTES_PER_S = 4.8e12
"""The H200's HBM3e bandwidth (NVIDIA's figure, bytes per second)."""
H200_BF16_FLOPS = 989e12
"""The H200's dense bf16 tensor-core peak (NVIDIA's figure, FLOP per second)."""


def decode_plan(batch_size: int, context: int, *, page_size: int, vocab_size: int, step_id: int = 0) -> StepPlan:
    """A decode-only plan: ``batch_size`` slices whose caches hold ``context`` tokens after the step.

    Slice ``i`` owns pages ``i * n .. (i + 1) * n - 1`` (``n = ceil(context / page_size)``);
    the earlier tokens were never written, which changes no timing.
    """
    pages = -(-context // page_size)
    start = np.full(batch_size, context - 1, dtype=np.int32)
    return build_step_plan(
        step_id=step_id,
        request_ids=tuple(f"decode-{i}" for i in range(batch_size)),
        slots=np.arange(batch_size, dtype=np.int32),
        start=start,
        num_new=np.ones(batch_size, dtype=np.int32),
        prompt_len=start.copy(),
        samples=np.ones(batch_size, dtype=bool),
        kv_indptr=(np.arange(batch_size + 1) * pages).astype(np.int32),
        kv_indices=np.arange(batch_size * pages, dtype=np.int32),
        page_size=page_size,
        input_ids=(np.arange(batch_size) % vocab_size).astype(np.int32),
    )


def prefill_plan(tokens: int, prefix: int, *, page_size: int, vocab_size: int, step_id: int = 0) -> StepPlan:
    """One prefill slice: ``tokens`` new tokens after ``prefix`` cached ones (never written); it samples."""
    kv_len = prefix + tokens
    pages = -(-kv_len // page_size)
    return build_step_plan(
        step_id=step_id,
        request_ids=("prefill-0",),
        slots=np.zeros(1, dtype=np.int32),
        start=np.array([prefix], dtype=np.int32),
        num_new=np.array([tokens], dtype=np.int32),
        prompt_len=np.array([kv_len], dtype=np.int32),
        samples=np.ones(1, dtype=bool),
        kv_indptr=np.array([0, pages], dtype=np.int32),
        kv_indices=np.arange(pages, dtype=np.int32),
        page_size=page_size,
        input_ids=(np.arange(tokens) % vocab_size).astype(np.int32),
    )


def device_time(fn: Callable[[], object], device: torch.device, *, repeats: int, warmup: int) -> float:
    """Median seconds of ``fn`` on ``device``: CUDA events on a GPU, wall time elsewhere."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            begin = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # untyped in torch
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            begin.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(float(begin.elapsed_time(end)) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


@attrs.frozen
class StepTiming:
    """One step's time and where it goes (seconds, medians of separate runs: parts need not add up).

    Attributes:
        batch_size: Slices.
        context: KV tokens per slice after the step.
        num_tokens: Query rows (``batch_size`` for a decode step).
        step_s: ``execute`` as it reports itself (host metadata and plan, forward, sampling).
        prepare_s: Host time of metadata, the upload and FlashInfer's ``plan()``.
        forward_s: Device time of the model's forward over the prepared step.
        attention_s: Device time of the attention kernel, all layers.
        rope_append_s: Device time of RoPE and KV append, all layers.
        graph_step_s: ``execute`` with CUDA graphs, or ``None`` when not measured.

    """

    batch_size: int
    context: int
    num_tokens: int
    step_s: float
    prepare_s: float
    forward_s: float
    attention_s: float
    rope_append_s: float
    graph_step_s: float | None = None

    @property
    def attention_fraction(self) -> float:
        """Share of the whole step spent in the attention kernel."""
        return self.attention_s / self.step_s


def _median_execute(executor: TorchExecutor, plan: StepPlan, repeats: int, warmup: int) -> float:
    times = []
    for i in range(warmup + repeats):
        duration = executor.execute(plan).duration_s
        assert duration is not None
        if i >= warmup:
            times.append(duration)
    return statistics.median(times)


def time_decode_step(
    executor: TorchExecutor, *, batch_size: int, context: int, repeats: int = 10, warmup: int = 3
) -> float:
    """Median seconds ``execute`` reports for :func:`decode_plan` ``(batch_size, context)``."""
    vocab_size = executor.model.config.vocab_size
    plan = decode_plan(batch_size, context, page_size=executor.page_size, vocab_size=vocab_size)
    return _median_execute(executor, plan, repeats, warmup)


def time_step(executor: FlashInferExecutor, plan: StepPlan, *, repeats: int = 10, warmup: int = 3) -> StepTiming:
    """Time ``plan`` on ``executor`` (see :class:`StepTiming`); ``graph_step_s`` is left ``None``."""
    config, device = executor.model.config, executor.model.device
    step_s = _median_execute(executor, plan, repeats, warmup)
    rows = plan.num_tokens
    with torch.inference_mode():

        def prepare() -> None:
            executor.prepare(plan)
            if device.type == "cuda":  # the next prepare rewrites the pinned buffer this one copies from
                torch.cuda.synchronize(device)

        prepare_s = device_time(prepare, torch.device("cpu"), repeats=repeats, warmup=warmup)
        batch = executor.prepare(plan)
        attention = batch.attention
        assert isinstance(attention, FlashInferAttention)
        forward_s = device_time(
            lambda: executor.model.forward(batch, executor.kv_cache), device, repeats=repeats, warmup=warmup
        )
        q = torch.randn(rows, config.num_heads, config.head_dim, device=device).to(executor.model.dtype)
        kv = torch.randn(rows, 2, config.num_kv_heads, config.head_dim, device=device).to(executor.model.dtype)
        k, v = kv[:, 0], kv[:, 1]

        def attend() -> None:
            for cache in executor.kv_cache:
                attention.wrapper.run(q, cache)

        def rope_append() -> None:
            m = attention.meta
            for cache in executor.kv_cache:
                attention.rope.apply(attention.kernels, q, k, m.positions)
                attention.kernels.append_paged_kv_cache(
                    k, v, m.batch_indices, m.positions, cache, m.kv_indices, m.kv_indptr, m.kv_last_page_len, "NHD"
                )

        attention_s = device_time(attend, device, repeats=repeats, warmup=warmup)
        rope_append_s = device_time(rope_append, device, repeats=repeats, warmup=warmup)
    context = int(plan.kv_len.max())
    return StepTiming(plan.batch_size, context, rows, step_s, prepare_s, forward_s, attention_s, rope_append_s)


def time_decode(  # noqa: PLR0913 -- keyword-only knobs of one measurement
    executor: FlashInferExecutor,
    *,
    batch_size: int,
    context: int,
    repeats: int = 10,
    warmup: int = 3,
    graph_executor: FlashInferExecutor | None = None,
) -> StepTiming:
    """Time one decode step of ``batch_size`` slices at ``context`` tokens (see :class:`StepTiming`)."""
    plan = decode_plan(batch_size, context, page_size=executor.page_size, vocab_size=executor.model.config.vocab_size)
    timing = time_step(executor, plan, repeats=repeats, warmup=warmup)
    if graph_executor is None:
        return timing
    graph_s = time_decode_step(graph_executor, batch_size=batch_size, context=context, repeats=repeats, warmup=warmup)
    return attrs.evolve(timing, graph_step_s=graph_s)


def _linear_weights(model: LlamaModel) -> tuple[int, int]:
    """Elements of the layers' linear weights, and of the LM head."""
    w = model.weights
    per_layer = sum(t.numel() for layer in w.layers for t in (layer.qkv, layer.o_proj, layer.gate_up, layer.down))
    return per_layer, w.lm_head.numel()


def step_accounting(
    model: LlamaModel,
    timing: StepTiming,
    *,
    hbm_bytes_per_s: float = H200_HBM_BYTES_PER_S,
    peak_flops: float = H200_BF16_FLOPS,
) -> dict[str, float]:
    """What ``timing`` (of one step of ``model``, equal slices) achieves against the hardware's peaks.

    * ``outside_kernels_s``: ``step_s - forward_s``, the step's wall time the forward's device
      time does not cover (host metadata, ``plan()``, launches not hidden, sampling, the copy
      back); ``outside_kernels_share`` is its share of ``step_s``.
    * ``hbm_bytes``: the bytes a step must read at least once (every linear weight, the LM head
      and each slice's KV cache); ``hbm_tb_per_s`` is that over ``forward_s`` and
      ``hbm_utilization`` against ``hbm_bytes_per_s``; ``attention_hbm_tb_per_s`` counts only
      the KV reads over ``attention_s``.
    * ``flops``: 2 per weight per row through the layers, the LM head for each sampled slice,
      and 4 * heads * head_dim per (query, visible key) pair per layer (causal);
      ``tflops`` over ``forward_s``, ``flops_utilization`` against ``peak_flops``, and
      ``attention_tflops`` the attention part over ``attention_s``.
    """
    c = model.config
    per_layer, lm_head = _linear_weights(model)
    element = model.weights.lm_head.element_size()
    b, t, n = timing.batch_size, timing.num_tokens, timing.context
    new = t // b  # rows per slice (equal slices)
    kv_bytes = b * n * 2 * c.num_layers * c.num_kv_heads * c.head_dim * element
    hbm_bytes = (per_layer + lm_head) * element + kv_bytes
    pairs = b * (new * (n - new) + new * (new + 1) // 2)  # (query, visible key) pairs per layer
    attention_flops = 4 * c.num_heads * c.head_dim * pairs * c.num_layers
    flops = 2 * per_layer * t + 2 * lm_head * b + attention_flops
    outside = max(0.0, timing.step_s - timing.forward_s)
    return {
        "outside_kernels_s": outside,
        "outside_kernels_share": outside / timing.step_s,
        "hbm_bytes": float(hbm_bytes),
        "hbm_tb_per_s": hbm_bytes / timing.forward_s / 1e12,
        "hbm_utilization": hbm_bytes / timing.forward_s / hbm_bytes_per_s,
        "attention_hbm_tb_per_s": kv_bytes / timing.attention_s / 1e12,
        "flops": float(flops),
        "tflops": flops / timing.forward_s / 1e12,
        "flops_utilization": flops / timing.forward_s / peak_flops,
        "attention_tflops": attention_flops / timing.attention_s / 1e12,
    }
