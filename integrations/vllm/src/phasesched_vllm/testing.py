"""Drive vLLM's V1 scheduler standalone on a CPU, step by step, with fake model outputs.

The recipe follows ``shared/peers/vllm_sched/bench.py`` (itself vLLM's
``tests/v1/core/utils.py::create_scheduler``): a temporary folder holding only a tiny Llama
``config.json``, the tokenizer skipped, a single full-attention KV cache group of ``num_blocks``
blocks, and a fake ``ModelRunnerOutput`` that samples one token for every request that finished
its prompt (none for a partial prefill), as vLLM's GPU model runner does.

The differential tests, the harness run with ``--scheduler-cls`` and the overhead benchmark all
use this module. It imports vLLM (and torch).
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
from collections.abc import Iterable, Sequence
from functools import cache
from typing import Any, Literal

import attrs

__all__ = ["Recorder", "RequestSpec", "StepRecord", "build_scheduler", "fake_model_output", "make_request", "run"]

VOCAB = 32000
MAX_MODEL_LEN = 32 * 1024


def _offline_env() -> None:
    for key, value in {
        "VLLM_TARGET_DEVICE": "cpu",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_LOGGING_LEVEL": "WARNING",
    }.items():
        os.environ.setdefault(key, value)


_offline_env()  # before anything imports vLLM: it picks its platform on import


@cache
def _model_config(max_model_len: int) -> Any:
    _offline_env()
    from vllm.config import ModelConfig  # noqa: PLC0415 -- vLLM is imported only when a scheduler is built

    folder = tempfile.mkdtemp(prefix="phasesched-vllm-tinyllama-")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "num_hidden_layers": 2,
        "vocab_size": VOCAB,
        "max_position_embeddings": max_model_len,
        "rms_norm_eps": 1e-5,
        "torch_dtype": "float16",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
    }
    with open(os.path.join(folder, "config.json"), "w") as f:  # noqa: PTH118, PTH123 -- as the harness writes it
        json.dump(config, f)
    return ModelConfig(
        model=folder,
        tokenizer=folder,
        dtype="float16",
        seed=42,
        skip_tokenizer_init=True,
        max_model_len=max_model_len,
        generation_config="vllm",
    )


def build_scheduler(  # noqa: PLR0913 -- the deployment, by keyword
    *,
    num_blocks: int,
    block_size: int = 16,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 8192,
    policy: Literal["fcfs", "priority"] = "fcfs",
    prefix_caching: bool = False,
    scheduler_cls: str | None = None,
    additional_config: dict[str, Any] | None = None,
    max_model_len: int = MAX_MODEL_LEN,
    log_stats: bool = False,
) -> Any:
    """A vLLM scheduler of the class ``SchedulerConfig.get_scheduler_cls()`` resolves, as vLLM's engine builds it.

    ``scheduler_cls`` is the dotted path ``--scheduler-cls`` takes (``None``: vLLM's own).
    """
    _offline_env()
    import torch  # noqa: PLC0415
    from vllm.config import CacheConfig, SchedulerConfig, VllmConfig  # noqa: PLC0415
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: PLC0415
    from vllm.v1.structured_output import StructuredOutputManager  # noqa: PLC0415

    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=True,
        long_prefill_token_threshold=0,
        async_scheduling=False,
        is_encoder_decoder=False,
        policy=policy,
        scheduler_cls=scheduler_cls,
    )
    cache_config = CacheConfig(
        block_size=block_size, gpu_memory_utilization=0.9, cache_dtype="auto", enable_prefix_caching=prefix_caching
    )
    vllm_config = VllmConfig(
        scheduler_config=scheduler_config,
        model_config=copy.deepcopy(_model_config(max_model_len)),
        cache_config=cache_config,
        additional_config=additional_config or {},
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"], FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float16)
            )
        ],
    )
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    cls = vllm_config.scheduler_config.get_scheduler_cls()
    return cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
        hash_block_size=block_size,
        log_stats=log_stats,
    )


@attrs.frozen
class RequestSpec:
    """One request of a workload.

    Attributes:
        arrival_step: The step before which it is added.
        prompt_len: Prompt tokens.
        max_tokens: Tokens to generate (EOS ignored).
        priority: vLLM priority (lower first), used by priority scheduling.
        prefix: Leading prompt tokens shared with every other request of the same ``prefix``
            group (0: a unique prompt); only prefix caching notices.

    """

    arrival_step: int
    prompt_len: int
    max_tokens: int
    priority: int = 0
    prefix: int = 0


def make_request(index: int, spec: RequestSpec, block_hasher: Any = None) -> Any:
    """The vLLM request of workload entry ``index`` (deterministic tokens and arrival time)."""
    from vllm.sampling_params import SamplingParams  # noqa: PLC0415
    from vllm.v1.request import Request  # noqa: PLC0415

    shared = [10 + (spec.prefix * 7919 + i) % (VOCAB - 10) for i in range(spec.prefix * 32)][: spec.prompt_len - 1]
    own = [10 + (index * 104729 + i * 31) % (VOCAB - 10) for i in range(spec.prompt_len - len(shared))]
    return Request(
        request_id=f"r{index}",
        prompt_token_ids=shared + own,
        sampling_params=SamplingParams(max_tokens=spec.max_tokens, ignore_eos=True),
        pooling_params=None,
        arrival_time=1000.0 + spec.arrival_step + index * 1e-4,
        priority=spec.priority,
        block_hasher=block_hasher,
    )


def block_hasher_for(scheduler: Any) -> Any:
    """The engine's block hasher when the scheduler caches prefixes, else ``None``."""
    cache_config = scheduler.vllm_config.cache_config
    if not cache_config.enable_prefix_caching:
        return None
    from vllm.utils.hashing import get_hash_fn_by_name  # noqa: PLC0415
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: PLC0415

    hash_fn = get_hash_fn_by_name(cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    return get_request_block_hasher(scheduler.block_size, hash_fn)


def fake_model_output(scheduler: Any, output: Any, step: int) -> Any:
    """What the GPU model runner returns for a plain step: a token for each request past its prompt."""
    from vllm.v1.outputs import ModelRunnerOutput  # noqa: PLC0415

    req_ids = list(output.num_scheduled_tokens)
    token = 100 + step % 1000
    sampled = [[] if scheduler.requests[r].is_prefill_chunk else [token] for r in req_ids]
    return ModelRunnerOutput(
        req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)}, sampled_token_ids=sampled
    )


@attrs.frozen
class StepRecord:
    """What one step did, in the terms the differential test compares.

    Attributes:
        scheduled: Tokens scheduled per request.
        new: Requests scheduled for the first time.
        resumed: Preempted requests scheduled again.
        preempted: Requests preempted in this step.
        finished: Requests that finished in this step's update.

    """

    scheduled: tuple[tuple[str, int], ...]
    new: frozenset[str]
    resumed: frozenset[str]
    preempted: frozenset[str]
    finished: frozenset[str]


class Recorder:
    """Steps one scheduler through a workload, recording a :class:`StepRecord` per step."""

    def __init__(self, scheduler: Any, workload: Sequence[RequestSpec]) -> None:
        self.scheduler = scheduler
        self.workload = workload
        self.records: list[StepRecord] = []
        self._hasher = block_hasher_for(scheduler)
        self._by_step: dict[int, list[int]] = {}
        for index, spec in enumerate(workload):
            self._by_step.setdefault(spec.arrival_step, []).append(index)
        self._last_arrival = max(self._by_step, default=-1)

    @property
    def done(self) -> bool:
        """Every request arrived and none is left."""
        return len(self.records) > self._last_arrival and not self.scheduler.has_requests()

    def step(self) -> StepRecord:
        """Add this step's arrivals, schedule, fake the model, update; return what happened."""
        step = len(self.records)
        for index in self._by_step.get(step, ()):
            self.scheduler.add_request(make_request(index, self.workload[index], self._hasher))
        output = self.scheduler.schedule()
        cached = output.scheduled_cached_reqs
        outputs = self.scheduler.update_from_output(output, fake_model_output(self.scheduler, output, step))
        finished = frozenset(o.request_id for eco in outputs.values() for o in eco.outputs if o.finished)
        record = StepRecord(
            scheduled=tuple(sorted(output.num_scheduled_tokens.items())),
            new=frozenset(r.req_id for r in output.scheduled_new_reqs),
            resumed=frozenset(cached.resumed_req_ids),
            preempted=frozenset(output.preempted_req_ids or ()),
            finished=finished,
        )
        self.records.append(record)
        return record


def run(scheduler: Any, workload: Sequence[RequestSpec], max_steps: int = 5000) -> list[StepRecord]:
    """Every step of ``workload`` through ``scheduler``.

    Raises:
        RuntimeError: It did not finish within ``max_steps`` (a livelock).

    """
    recorder = Recorder(scheduler, workload)
    while not recorder.done:
        if len(recorder.records) >= max_steps:
            msg = f"not finished after {max_steps} steps"
            raise RuntimeError(msg)
        recorder.step()
    return recorder.records


def first_difference(
    left: Iterable[StepRecord], right: Iterable[StepRecord]
) -> tuple[int, StepRecord | None, StepRecord | None] | None:
    """The first step where two runs differ, with both records (``None`` past a run's end)."""
    left, right = list(left), list(right)
    for step in range(max(len(left), len(right))):
        a = left[step] if step < len(left) else None
        b = right[step] if step < len(right) else None
        if a != b:
            return step, a, b
    return None
