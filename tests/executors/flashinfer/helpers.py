"""Shared helpers: a CPU model FlashInfer could run (head_dim 128), executors, random plans."""

from __future__ import annotations

from typing import cast

import pytest

pytest.importorskip("torch")
import torch

pytest.importorskip(
    "phasesched_flashinfer", reason="install executors/flashinfer (pip install -e executors/flashinfer)"
)

import numpy as np
from hypothesis import strategies as st

from phasesched import PolicyOptions, Request, SchedulingPolicy, StepPlan, load_policy
from phasesched.plan import build_step_plan
from phasesched_flashinfer import FlashInferExecutor, FlashInferKernels
from phasesched_torch import Llama3RopeScaling, LlamaConfig, LlamaModel, TorchExecutor
from tests.executors.flashinfer import fake_flashinfer

CPU_MODEL = LlamaConfig(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=512,
    num_layers=2,
    num_heads=4,
    num_kv_heads=1,
    head_dim=128,
    rope_theta=500000.0,
)
"""Small enough for the CPU, shaped like what FlashInfer runs: head_dim 128, 4 query heads per kv head."""
CPU_MODEL_LLAMA31 = LlamaConfig(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=512,
    num_layers=2,
    num_heads=4,
    num_kv_heads=1,
    head_dim=128,
    rope_theta=500000.0,
    rope_scaling=Llama3RopeScaling(factor=8.0, original_max_position_embeddings=256),
)
FAKE = cast("FlashInferKernels", fake_flashinfer)


def fake_executor(model: LlamaModel, *, num_pages: int, page_size: int, **kwargs: object) -> FlashInferExecutor:
    """A FlashInfer executor on the CPU stand-in for flashinfer."""
    return FlashInferExecutor(model, num_pages=num_pages, page_size=page_size, kernels=FAKE, **kwargs)  # type: ignore[arg-type]


def executor_pair(
    config: LlamaConfig, dtype: torch.dtype, *, num_pages: int, page_size: int
) -> tuple[TorchExecutor, FlashInferExecutor]:
    """The torch reference and a fake-kernel FlashInfer executor sharing one model's weights."""
    model = LlamaModel.random(config, seed=3, dtype=dtype, std=0.05)
    return TorchExecutor(model, num_pages=num_pages, page_size=page_size), fake_executor(
        model, num_pages=num_pages, page_size=page_size
    )


def mixed_requests(lengths: tuple[int, ...], vocab_size: int, max_new_tokens: int, seed: int = 0) -> list[Request]:
    rng = np.random.default_rng(seed)
    return [
        Request(f"r{i}", prompt_token_ids=rng.integers(0, vocab_size, n).tolist(), max_new_tokens=max_new_tokens)
        for i, n in enumerate(lengths)
    ]


def chunked_policy(chunk_size: int = 16) -> SchedulingPolicy:
    """Sarathi's fixed chunks: prompts split across steps, decodes beside them (mixed batches)."""
    return load_policy("sarathi", PolicyOptions(chunk_size=chunk_size))


@st.composite
def step_plans(draw: st.DrawFn, *, decode_only: bool = False, max_slices: int = 6, vocab_size: int = 512) -> StepPlan:
    """Random valid plans: slices anywhere in their sequences, pages drawn from a shuffled pool."""
    page_size = draw(st.sampled_from([1, 2, 4, 16]))
    b = draw(st.integers(1, max_slices))
    start = np.array(draw(st.lists(st.integers(0, 70), min_size=b, max_size=b)), dtype=np.int32)
    if decode_only:
        num_new = np.ones(b, dtype=np.int32)
    else:
        num_new = np.array(draw(st.lists(st.integers(1, 40), min_size=b, max_size=b)), dtype=np.int32)
    pages = -(-(start + num_new) // page_size)
    spare = draw(st.integers(0, 8))
    pool = np.array(draw(st.permutations(list(range(int(pages.sum()) + spare)))), dtype=np.int32)
    seed = draw(st.integers(0, 2**16))
    samples = np.array(draw(st.lists(st.booleans(), min_size=b, max_size=b)), dtype=bool)
    rng = np.random.default_rng(seed)
    return build_step_plan(
        step_id=draw(st.integers(0, 100)),
        request_ids=tuple(f"s{i}" for i in range(b)),
        slots=np.arange(b, dtype=np.int32),
        start=start,
        num_new=num_new,
        prompt_len=np.where(num_new == 1, start, start + num_new).astype(np.int32),
        samples=samples,
        kv_indptr=np.concatenate([[0], np.cumsum(pages)]).astype(np.int32),
        kv_indices=pool[: int(pages.sum())],
        page_size=page_size,
        input_ids=rng.integers(0, vocab_size, int(num_new.sum())).astype(np.int32),
    )
