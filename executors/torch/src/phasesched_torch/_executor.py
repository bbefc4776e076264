"""The executor: phasesched's ``execute(plan) -> StepResult`` over the reference Llama model.

Per step it checks the plan against the cache (a bad page id would otherwise be a CUDA
device-side assert that kills the process), derives the step's tensors once
(:meth:`TorchExecutor.prepare`), runs one forward over the whole ragged batch, and samples one
token per slice whose ``plan.samples`` is set. Everything it knows about requests comes from the
plan: sampling parameters from ``plan.new_requests``, dropped on ``plan.released``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from os import PathLike
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch

from phasesched import StepPlan, StepResult
from phasesched.costmodel.batching import DecodeBatching
from phasesched.errors import UnknownNameError
from phasesched_torch._attention import DECODE_BATCHING, plan_paged_attention
from phasesched_torch._config import PRESETS, LlamaConfig
from phasesched_torch._errors import CheckpointError, DeviceUnavailableError, PlanNotExecutableError
from phasesched_torch._kv_cache import kv_write_slots
from phasesched_torch._model import ForwardBatch, LlamaModel, TorchAttention
from phasesched_torch._rope import rope_angles
from phasesched_torch._sampling import RequestSampler

__all__ = ["StepLogits", "TorchExecutor", "create_executor", "load_model"]

_DTYPES: Mapping[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


@attrs.frozen(eq=False)
class StepLogits:
    """The logits behind one step's sampled tokens, for tests and debugging.

    Attributes:
        step_id: The plan's step id.
        request_ids: ``S`` request ids: the sampling slices, in batch order.
        logits: float32 ``[S, vocab_size]``: the last query row's logits of each.

    """

    step_id: int
    request_ids: tuple[str, ...]
    logits: torch.Tensor

    def of(self, request_id: str) -> torch.Tensor:
        """float32 ``[vocab_size]``: the logits that chose ``request_id``'s token.

        Raises:
            KeyError: The request did not sample in this step.

        """
        if request_id not in self.request_ids:
            msg = f"request {request_id!r} did not sample in step {self.step_id}"
            raise KeyError(msg)
        return self.logits[self.request_ids.index(request_id)]


class TorchExecutor:
    """Runs step plans on a :class:`LlamaModel` with a paged KV cache it owns.

    Args:
        model: The model (its device and dtype are the cache's).
        num_pages: Pages in the cache; must be at least the scheduler's ``num_pages``.
        page_size: Tokens per page; must equal the scheduler's.
        seed: Seeds draws for unseeded, non-greedy requests.

    Attributes:
        model: The model.
        kv_cache: Per layer, float ``[num_pages, 2, page_size, num_kv_heads, head_dim]`` (NHD).
        sampler: Per-request sampling state.

    >>> from phasesched import Request, Scheduler, SchedulerConfig
    >>> executor = create_executor(model="tiny", num_pages=16, page_size=4)
    >>> scheduler = Scheduler(SchedulerConfig(num_pages=16, page_size=4))
    >>> scheduler.add_request(Request("r", prompt_token_ids=[5, 6, 7], max_new_tokens=2))
    >>> plan = scheduler.schedule()
    >>> result = executor.execute(plan)
    >>> result.token_ids.shape, result.duration_s > 0
    ((1,), True)

    """

    def __init__(self, model: LlamaModel, *, num_pages: int, page_size: int = 16, seed: int = 0) -> None:
        if num_pages <= 0 or page_size <= 0:
            msg = f"num_pages and page_size must be positive, got {num_pages} and {page_size}"
            raise ValueError(msg)
        self.model = model
        self.num_pages = num_pages
        self.page_size = page_size
        self.kv_cache = model.new_kv_cache(num_pages, page_size)
        self.sampler = RequestSampler(seed)
        self._last_logits: StepLogits | None = None

    @property
    def decode_batching(self) -> DecodeBatching:
        """How this executor batches decodes, for the profiled cost model (``DeclaresDecodeBatching``).

        The reference attention sorts a step's decodes by context and pads each bucket of
        contexts within a quarter of its longest to that longest, so a step costs like a uniform
        one at the mean *padded* context. (With a sliding window it buckets the windowed spans;
        the declaration reads the full contexts, so profile such a model below its window.)
        """
        return DECODE_BATCHING

    @property
    def device_name(self) -> str:
        """The device the model runs on, as it names itself (``NVIDIA H200``), or ``cpu`` (``DeclaresDevice``).

        ``phasesched profile`` records it as the profile's hardware.
        """
        device = self.model.device
        return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type

    @property
    def last_logits(self) -> StepLogits | None:
        """The logits of the most recent non-empty step (no rows if none of its slices sampled), or ``None``."""
        return self._last_logits

    def execute(self, plan: StepPlan) -> StepResult:
        """Run ``plan``: write its tokens' KV, attend, sample.

        ``duration_s`` is measured wall time from the step's first tensor transfer to its
        sampled tokens on the host (after ``torch.cuda.synchronize`` on CUDA).

        Returns:
            The step's result, whose int32 ``token_ids`` ``[B]`` hold -1 for slices that do not
            sample.

        Raises:
            PlanNotExecutableError: The plan cannot run on this executor; nothing ran.

        """
        self.check_plan(plan)
        self.sampler.track(plan)
        if plan.is_empty:
            return StepResult(step_id=plan.step_id, token_ids=np.empty(0, np.int32), duration_s=0.0)
        start = time.perf_counter()
        with torch.inference_mode():
            logits = self.logits(plan)
            sampling = np.flatnonzero(plan.samples)
            request_ids = tuple(plan.request_ids[i] for i in sampling.tolist())
            tokens = self.sampler.sample(logits, request_ids, plan.kv_len[sampling].tolist())
            token_ids = np.full(plan.batch_size, -1, dtype=np.int32)
            token_ids[sampling] = tokens.cpu().numpy()
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)
        duration = time.perf_counter() - start
        self._last_logits = StepLogits(plan.step_id, request_ids, logits)
        return StepResult(step_id=plan.step_id, token_ids=token_ids, duration_s=duration)

    def check_plan(self, plan: StepPlan) -> None:
        """Raise :class:`PlanNotExecutableError` unless this executor can run ``plan``.

        Checks the page geometry, that every page id lies in the cache and every token id in
        the vocabulary, and the plan's own consistency (:meth:`phasesched.StepPlan.check_layout`).
        Context pages need not have been written: a profiler's synthetic decode runs.
        """
        if plan.page_size != self.page_size:
            msg = f"plan {plan.step_id} uses {plan.page_size}-token pages, the cache {self.page_size}-token pages"
            raise PlanNotExecutableError(msg)
        if plan.is_empty:
            return
        if plan.input_ids is None:
            msg = (
                f"plan {plan.step_id} carries no input_ids: a model needs token ids "
                "(requests given only a prompt_len cannot run on the torch executor)"
            )
            raise PlanNotExecutableError(msg)
        self._check_ranges(plan, plan.input_ids)
        try:
            plan.check_layout()
        except ValueError as error:
            msg = f"plan {plan.step_id} is inconsistent: {error}"
            raise PlanNotExecutableError(msg) from error

    def _check_ranges(self, plan: StepPlan, input_ids: np.ndarray[Any, np.dtype[np.int32]]) -> None:
        pages = plan.kv_indices
        bad = np.flatnonzero((pages < 0) | (pages >= self.num_pages))
        if len(bad):
            j = int(bad[0])
            s = int(np.searchsorted(plan.kv_indptr, j, side="right")) - 1
            page = int(pages[j])
            msg = (
                f"plan {plan.step_id}: slice {s} (request {plan.request_ids[s]!r}) references KV page {page} "
                f"(kv_indices[{j}]={page}), outside the cache's {self.num_pages} pages (ids 0..{self.num_pages - 1})"
            )
            raise PlanNotExecutableError(msg)
        vocab = self.model.config.vocab_size
        if input_ids.shape != (plan.num_tokens,):
            msg = f"plan {plan.step_id}: input_ids has shape {input_ids.shape}, expected ({plan.num_tokens},)"
            raise PlanNotExecutableError(msg)
        bad = np.flatnonzero((input_ids < 0) | (input_ids >= vocab))
        if len(bad):
            row = int(bad[0])
            msg = f"plan {plan.step_id}: token id {int(input_ids[row])} (row {row}) is not in the vocabulary of {vocab}"
            raise PlanNotExecutableError(msg)

    def logits(self, plan: StepPlan) -> torch.Tensor:
        """Run the model over a checked, non-empty plan (writing its KV) and return its logits.

        Subclasses that run the step another way (a captured CUDA graph) override this.

        Returns:
            float32 ``[S, vocab_size]``: the last query row of each sampling slice, in batch order.

        """
        return self.model.forward(self.prepare(plan), self.kv_cache)

    def prepare(self, plan: StepPlan) -> ForwardBatch:
        """Derive the step's device tensors from a checked, non-empty plan (once per step).

        Returns:
            The inputs every layer reads (token ids, the step's :class:`TorchAttention` with
            RoPE angles, KV write slots and the attention plan, and the rows to sample).

        """
        assert plan.input_ids is not None
        device = self.model.device
        positions = torch.tensor(plan.positions, dtype=torch.int64)
        batch_indices = torch.repeat_interleave(torch.arange(plan.batch_size), torch.tensor(plan.num_new))
        pages, offsets = kv_write_slots(
            batch_indices, positions, torch.tensor(plan.kv_indices), torch.tensor(plan.kv_indptr), self.page_size
        )
        cos, sin = rope_angles(positions.to(device), self.model.inv_freq)
        attention = plan_paged_attention(
            plan.qo_indptr,
            plan.kv_indptr,
            plan.kv_indices,
            plan.kv_last_page_len,
            self.page_size,
            window_left=self.model.config.window_left,
            device=device,
        )
        sample_rows = (plan.qo_indptr[1:].astype(np.int64) - 1)[plan.samples]
        return ForwardBatch(
            input_ids=torch.tensor(plan.input_ids, dtype=torch.int64).to(device),
            attention=TorchAttention(cos, sin, (pages.to(device), offsets.to(device)), attention),
            sample_rows=torch.from_numpy(sample_rows).to(device),
        )


ModelSource = str | PathLike[str] | LlamaConfig | Mapping[str, Any]
"""A preset name, a model folder, a :class:`LlamaConfig` or a Hugging Face ``config.json`` dict."""
WeightsSource = Mapping[str, torch.Tensor] | str | PathLike[str] | None
"""A state dict, a safetensors file or a directory of shards; ``None``: see :func:`load_model`."""


def _resolve_model(model: ModelSource, state_dict: WeightsSource) -> tuple[LlamaConfig, WeightsSource]:
    """The config ``model`` names, and the weights to load (a model folder's own by default)."""
    if isinstance(model, LlamaConfig):
        return model, state_dict
    if isinstance(model, Mapping):
        return LlamaConfig.from_hf(model), state_dict
    if isinstance(model, str) and model in PRESETS:
        return PRESETS[model], state_dict
    root = Path(model)
    if not root.exists():
        known = ", ".join(sorted(PRESETS))
        msg = f"no model preset named {str(model)!r} and no model folder there; known presets: {known}"
        raise UnknownNameError(msg)
    return LlamaConfig.from_hf(_read_config_json(root)), root if state_dict is None else state_dict


def _read_config_json(root: Path) -> Mapping[str, Any]:
    """A model folder's ``config.json`` as a dict.

    Raises:
        CheckpointError: ``root`` is not a folder, has no ``config.json``, or it is not a JSON object.

    """
    if not root.is_dir():
        raise CheckpointError(root, "not a model folder (a directory holding config.json and *.safetensors)")
    path = root / "config.json"
    if not path.is_file():
        raise CheckpointError(root, "model folder has no config.json")
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(path, f"not a readable JSON config ({error})") from error
    if not isinstance(values, dict):
        raise CheckpointError(path, f"holds a JSON {type(values).__name__}, not an object")
    return values


def _resolve_device(device: str | torch.device) -> torch.device:
    """``device`` as a torch device that exists here.

    Raises:
        DeviceUnavailableError: Not a device name, CUDA on a torch without CUDA (or no GPU
            visible), or a GPU index past the last.

    """
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as error:
        msg = f"{device!r} is not a torch device ({error})"
        raise DeviceUnavailableError(msg) from error
    if resolved.type != "cuda":
        return resolved
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        msg = f"device {str(resolved)!r} asked for, but torch {torch.__version__} ({build}) sees no CUDA device"
        raise DeviceUnavailableError(msg)
    if resolved.index is not None and resolved.index >= torch.cuda.device_count():
        msg = f"device {str(resolved)!r} asked for, but only {torch.cuda.device_count()} CUDA device(s) are visible"
        raise DeviceUnavailableError(msg)
    return resolved


def _resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            msg = f"dtype {dtype} is not supported; use float32, bfloat16 or float16"
            raise UnknownNameError(msg)
        return dtype
    resolved = _DTYPES.get(dtype)
    if resolved is None:
        msg = f"no dtype named {dtype!r}; known: {', '.join(sorted(_DTYPES))}"
        raise UnknownNameError(msg)
    return resolved


def load_model(  # noqa: PLR0913 -- the model's keyword-only knobs, each with a default
    *,
    model: ModelSource = "tiny",
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = "float32",
    seed: int = 0,
    state_dict: WeightsSource = None,
    num_layers: int | None = None,
) -> LlamaModel:
    """Build a :class:`LlamaModel` from the knobs :func:`create_executor` takes (see there).

    Executors built on this model (``phasesched_flashinfer``) share the resolution of presets,
    model folders, config dicts, devices, dtype names and checkpoints. Everything but the
    weights is checked before a checkpoint is read.

    Raises:
        UnknownNameError: An unknown preset or dtype name.
        DeviceUnavailableError: ``device`` does not exist here (CUDA on a CPU-only torch).
        UnsupportedConfigError: The config names an architecture or feature not implemented.
        CheckpointError: A model folder or checkpoint file cannot be read.
        StateDictError: The weights do not fit the config (the error names the tensor).

    """
    torch_device = _resolve_device(device)
    torch_dtype = _resolve_dtype(dtype)
    config, state_dict = _resolve_model(model, state_dict)
    if num_layers is not None:
        config = attrs.evolve(config, num_layers=num_layers)
    if state_dict is None:
        return LlamaModel.random(config, seed=seed, device=torch_device, dtype=torch_dtype)
    if isinstance(state_dict, Mapping):
        return LlamaModel.from_state_dict(config, state_dict, device=torch_device, dtype=torch_dtype)
    return LlamaModel.from_safetensors(config, state_dict, device=torch_device, dtype=torch_dtype)


def create_executor(  # noqa: PLR0913 -- the entry point's keyword-only knobs, each with a default
    *,
    model: ModelSource = "tiny",
    num_pages: int = 1024,
    page_size: int = 16,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = "float32",
    seed: int = 0,
    state_dict: WeightsSource = None,
    num_layers: int | None = None,
) -> TorchExecutor:
    """Build a :class:`TorchExecutor` (the ``torch`` entry point of ``phasesched.executors``).

    Args:
        model: A preset name (:data:`PRESETS`), a model folder (a directory holding a Hugging
            Face ``config.json`` and ``*.safetensors``), a :class:`LlamaConfig`, or a
            ``config.json`` dict. Architectures: :data:`ARCHITECTURES`.
        num_pages: KV pages to allocate (at least the scheduler's ``num_pages``).
        page_size: Tokens per page (the scheduler's ``page_size``).
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ...
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"`` (or a ``torch.dtype``).
        seed: Seeds random weights and unseeded sampling.
        state_dict: Weights in ``LlamaForCausalLM`` naming: a mapping of tensors, or the path of
            a safetensors file or of a directory of shards. ``None``: a model folder's own
            weights, else seeded random weights.
        num_layers: Override the config's layer count (to fit a large preset on one device).

    Raises:
        UnknownNameError: An unknown preset or dtype name.
        DeviceUnavailableError: ``device`` does not exist here (CUDA on a CPU-only torch).
        UnsupportedConfigError: The config names an architecture or feature not implemented.
        CheckpointError: A model folder or checkpoint file cannot be read.
        StateDictError: The weights do not fit the config (the error names the tensor).

    """
    llama = load_model(model=model, device=device, dtype=dtype, seed=seed, state_dict=state_dict, num_layers=num_layers)
    return TorchExecutor(llama, num_pages=num_pages, page_size=page_size, seed=seed)
