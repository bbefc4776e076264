"""Measurements that hold an executor against the torch reference, for the offline GPU check.

Nothing here imports FlashInfer; each function takes executors (or the kernels module) and
runs wherever they run, so the CPU tests exercise these harnesses with the torch executor and
a FlashInfer stand-in, and ``gpu_check/check.py`` runs them with the real kernels:

* :func:`lockstep_compare` drives two executors with the *same* plans, feeding the scheduler
  the reference's tokens (teacher forcing), and compares every sampled row's logits and
  greedy token. Logits must agree within a tolerance relative to the row's largest logit; a
  token may differ only where the reference's top-two margin is at most twice the row's
  measured logit deviation (the most two logits that each move by that much can close).
* :func:`rounding_floor` measures that tolerance's unit instead of guessing it: how far the
  torch executor in bf16 (or fp16) lands from the same weights run in float32, on the same
  plans. :func:`calibrated_lockstep` sets the tolerance to a multiple of it
  (:data:`FLOOR_FACTOR`): a kernel-call bug moves logits by ten to a hundred floors on the
  check's short contexts, rounding by about one.
* :func:`attention_kernel_check` compares the kernels alone with the reference paged
  attention on a random mixed batch and a decode batch.

Step timing and its roofline accounting live in :mod:`phasesched_flashinfer._timing`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import attrs
import numpy as np
import torch

from phasesched import (
    PolicyOptions,
    Request,
    Scheduler,
    SchedulerConfig,
    SchedulingPolicy,
    StepPlan,
    StepResult,
    load_policy,
)
from phasesched_flashinfer._kernels import FlashInferKernels
from phasesched_torch import LlamaConfig, LlamaModel, StepLogits, TorchExecutor, paged_attention

__all__ = [
    "CHECK_MODEL",
    "FLOOR_FACTOR",
    "LockstepReport",
    "Workload",
    "attention_kernel_check",
    "calibrated_lockstep",
    "cast_model",
    "check_workloads",
    "free_running_outputs",
    "lockstep_compare",
    "rounding_floor",
]

CHECK_MODEL = LlamaConfig(
    vocab_size=2048,
    hidden_size=1024,
    intermediate_size=2048,
    num_layers=2,
    num_heads=8,
    num_kv_heads=2,
    head_dim=128,
    rope_theta=500000.0,
)
"""A tiny model FlashInfer can run: head_dim 128 (the bundle's), four query heads per kv head."""


@attrs.define
class LockstepReport:
    """What :func:`lockstep_compare` saw (mutable while it runs, then read).

    Attributes:
        rel_tol: Allowed logit difference, relative to the largest reference logit of its row.
        floor: The measured rounding floor ``rel_tol`` was derived from (:func:`rounding_floor`),
            or ``None`` when ``rel_tol`` was given.
        steps: Plans run.
        mixed_steps: Plans with decodes and prefill tokens together.
        decode_only_steps: Plans of one-row slices only.
        first_decode_only_step: Index (from 0) of the first decode-only plan, or ``None``.
        min_decode_context: Shortest cache (tokens, after the step) a decode-only plan attended to.
        sampled_tokens: Rows compared.
        token_mismatches: Rows whose greedy tokens differ.
        near_ties: Rows whose reference top-two margin is at most twice the row's largest logit
            deviation (the only rows whose greedy token may differ).
        near_tie_mismatches: Mismatches at near ties (allowed).
        unexplained_mismatches: Mismatches that are not near ties (``token_mismatches -
            near_tie_mismatches``); any makes the comparison fail.
        max_abs_logit_diff: Largest ``|candidate - reference|`` logit.
        max_rel_logit_diff: Largest row-wise ``max |candidate - reference| / max |reference|``.

    """

    rel_tol: float
    floor: float | None = None
    steps: int = 0
    mixed_steps: int = 0
    decode_only_steps: int = 0
    first_decode_only_step: int | None = None
    min_decode_context: int | None = None
    sampled_tokens: int = 0
    token_mismatches: int = 0
    near_ties: int = 0
    near_tie_mismatches: int = 0
    unexplained_mismatches: int = 0
    max_abs_logit_diff: float = 0.0
    max_rel_logit_diff: float = 0.0

    @property
    def passed(self) -> bool:
        """Rows were compared, logits agree within ``rel_tol``, and every token agrees but at near ties."""
        return self.sampled_tokens > 0 and self.unexplained_mismatches == 0 and self.max_rel_logit_diff <= self.rel_tol

    @property
    def near_tie_share(self) -> float:
        """Share of compared rows that are near ties (the rows a token check cannot judge)."""
        return self.near_ties / self.sampled_tokens if self.sampled_tokens else 0.0

    def summary(self) -> dict[str, float | int | bool | None]:
        """The report as plain JSON values, ``passed`` and ``near_tie_share`` included."""
        return attrs.asdict(self) | {"passed": self.passed, "near_tie_share": round(self.near_tie_share, 4)}

    def _count_step(self, plan: StepPlan) -> None:
        self.mixed_steps += int(plan.num_decodes > 0 and plan.num_prefill_tokens > 0)
        if plan.num_tokens == plan.batch_size:
            self.decode_only_steps += 1
            if self.first_decode_only_step is None:
                self.first_decode_only_step = self.steps
            shortest = int(plan.kv_len.min())
            self.min_decode_context = min(shortest, self.min_decode_context or shortest)
        self.steps += 1

    def add(self, plan: StepPlan, ref: StepLogits, cand: StepLogits, results: tuple[StepResult, StepResult]) -> None:
        """Fold in one step's sampled rows."""
        self._count_step(plan)
        if ref.request_ids != cand.request_ids:
            msg = f"step {plan.step_id}: sampled rows differ: {ref.request_ids} vs {cand.request_ids}"
            raise AssertionError(msg)
        if not ref.request_ids:
            return
        a, b = ref.logits.float(), cand.logits.float().to(ref.logits.device)
        diff = (b - a).abs().amax(dim=-1)
        scale = a.abs().amax(dim=-1).clamp_min(1e-6)
        top2 = a.topk(2, dim=-1).values
        margin = top2[:, 0] - top2[:, 1]
        ref_tokens, cand_tokens = (r.token_ids[plan.samples] for r in results)
        mismatch = torch.from_numpy(ref_tokens != cand_tokens).to(diff.device)
        # NOTE: two logits that each move by at most `diff` can close a gap of 2 * diff, no more.
        near_tie = margin <= 2 * diff
        self.sampled_tokens += len(ref.request_ids)
        self.token_mismatches += int(mismatch.sum())
        self.near_ties += int(near_tie.sum())
        self.near_tie_mismatches += int((mismatch & near_tie).sum())
        self.unexplained_mismatches += int((mismatch & ~near_tie).sum())
        self.max_abs_logit_diff = max(self.max_abs_logit_diff, float(diff.max()))
        self.max_rel_logit_diff = max(self.max_rel_logit_diff, float((diff / scale).max()))


def lockstep_compare(  # noqa: PLR0913 -- keyword-only knobs of one comparison
    reference: TorchExecutor,
    candidate: TorchExecutor,
    requests: Iterable[Request],
    policy: SchedulingPolicy,
    *,
    num_pages: int,
    page_size: int,
    rel_tol: float,
    max_steps: int = 10_000,
    report: LockstepReport | None = None,
) -> LockstepReport:
    """Run both executors on every plan of one scheduler; the reference's tokens drive it.

    Both executors need caches of at least ``num_pages`` pages of ``page_size`` (a cache used
    before will do: every page a plan reads is written first); ``rel_tol`` is
    :attr:`LockstepReport.rel_tol`. ``report`` continues an earlier comparison (of other
    request ids) instead of starting a new one.

    Raises:
        AssertionError: The two sample different rows, or the run does not finish.

    """
    scheduler = Scheduler(SchedulerConfig(num_pages=num_pages, page_size=page_size), policy)
    for request in requests:
        scheduler.add_request(request)
    report = LockstepReport(rel_tol) if report is None else report
    for _ in range(max_steps):
        if not scheduler.num_unfinished:
            return report
        plan = scheduler.schedule()
        ref, cand = reference.execute(plan), candidate.execute(plan)
        cand.check_against(plan)
        ref_logits, cand_logits = reference.last_logits, candidate.last_logits
        if not plan.is_empty and ref_logits is not None and cand_logits is not None:
            report.add(plan, ref_logits, cand_logits, (ref, cand))
        scheduler.update(plan, ref)
    msg = f"still {scheduler.num_unfinished} requests after {max_steps} steps"
    raise AssertionError(msg)


FLOOR_FACTOR = 4.0
"""Logit tolerance of :func:`calibrated_lockstep`, in rounding floors. Measured on the CPU
stand-in (2026-12-01, :func:`check_workloads`, bf16): the stand-in's float32 attention lands 0.5
floors from the torch executor, and 1.1 floors with FlashInfer's fa2 rounding emulated (bf16
probabilities into the PV product); each planted bug (:mod:`phasesched_flashinfer._planted`) 69
to 190 floors away. 4 leaves room on both sides."""


def cast_model(model: LlamaModel, dtype: torch.dtype) -> LlamaModel:
    """The same weights in ``dtype`` (float32 for a reference: each weight is exactly representable)."""

    def cast(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(dtype)

    w = model.weights
    layers = tuple(
        attrs.evolve(layer, **{f.name: cast(getattr(layer, f.name)) for f in attrs.fields(type(layer))})  # type: ignore[arg-type]  # None stays None
        for layer in w.layers
    )
    weights = attrs.evolve(
        w, embed=w.embed.to(dtype), layers=layers, norm=w.norm.to(dtype), lm_head=w.lm_head.to(dtype)
    )
    return LlamaModel(model.config, weights, model.inv_freq)


Workload = tuple[Sequence[Request], SchedulingPolicy]
"""Requests (all arriving at once) and the policy that schedules them."""


def check_workloads(
    vocab_size: int, *, chunked_prompts: Sequence[int], chunk_size: int, max_new_tokens: int = 8, seed: int = 0
) -> list[Workload]:
    """The lockstep's two workloads: decode-only steps at once on short contexts, then chunked prefills.

    * ``short``: prompts of 1 to 17 tokens, all prefilled in the first step, so every later
      step is decode-only over caches of 2 to 25 tokens, where one token more or less, or a
      wrong last page, moves the output most (a long context dilutes such a bug).
    * ``chunked``: ``chunked_prompts`` split into ``chunk_size`` chunks beside the decodes of
      the earlier requests: mixed steps, chunks continuing after a cached prefix.

    Every request generates ``max_new_tokens`` tokens.
    """
    rng = np.random.default_rng(seed)

    def requests(prefix: str, lengths: Sequence[int]) -> list[Request]:
        return [
            Request(
                f"{prefix}{i}", prompt_token_ids=rng.integers(0, vocab_size, n).tolist(), max_new_tokens=max_new_tokens
            )
            for i, n in enumerate(lengths)
        ]

    short = (1, 2, 3, 5, 8, 13, 17)
    return [
        (requests("short-", short), load_policy("sarathi", PolicyOptions(chunk_size=sum(short)))),
        (requests("chunked-", chunked_prompts), load_policy("sarathi", PolicyOptions(chunk_size=chunk_size))),
    ]


def rounding_floor(model: LlamaModel, workloads: Sequence[Workload], *, num_pages: int, page_size: int) -> float:
    """How far the torch executor in ``model``'s dtype lands from float32, in the lockstep's unit.

    The largest row-wise ``max |logit difference| / max |logit|`` of the torch executor on
    ``model`` against the torch executor on the same weights in float32, over the plans of
    ``workloads`` (float32 tokens drive): the rounding the low-precision dtype alone costs,
    measured on the device and the plans the comparison will use.
    """
    truth = TorchExecutor(cast_model(model, torch.float32), num_pages=num_pages, page_size=page_size)
    low = TorchExecutor(model, num_pages=num_pages, page_size=page_size)
    report = None
    for requests, policy in workloads:
        report = lockstep_compare(
            truth, low, requests, policy, num_pages=num_pages, page_size=page_size, rel_tol=math.inf, report=report
        )
    return 0.0 if report is None else report.max_rel_logit_diff


def calibrated_lockstep(  # noqa: PLR0913 -- keyword-only knobs of one comparison
    model: LlamaModel,
    candidate: TorchExecutor,
    workloads: Sequence[Workload],
    *,
    num_pages: int,
    page_size: int,
    factor: float = FLOOR_FACTOR,
    floor: float | None = None,
) -> LockstepReport:
    """Lockstep of ``candidate`` against the torch executor on ``model``, tolerance from the rounding floor.

    :func:`lockstep_compare` over each workload with ``rel_tol = factor *``
    :func:`rounding_floor`, measured on the same workloads and device (or ``floor``, measured
    so before for the same model and workloads); the report keeps the floor.
    """
    if floor is None:
        floor = rounding_floor(model, workloads, num_pages=num_pages, page_size=page_size)
    reference = TorchExecutor(model, num_pages=num_pages, page_size=page_size)
    report = LockstepReport(factor * floor, floor)
    for requests, policy in workloads:
        lockstep_compare(
            reference,
            candidate,
            requests,
            policy,
            num_pages=num_pages,
            page_size=page_size,
            rel_tol=report.rel_tol,
            report=report,
        )
    return report


def free_running_outputs(  # noqa: PLR0913 -- keyword-only knobs of one run
    executor: TorchExecutor,
    requests: Iterable[Request],
    policy: SchedulingPolicy,
    *,
    num_pages: int,
    page_size: int,
    max_steps: int = 10_000,
) -> dict[str, tuple[int, ...]]:
    """Each request's generated tokens when ``executor`` alone drives the loop."""
    scheduler = Scheduler(SchedulerConfig(num_pages=num_pages, page_size=page_size), policy)
    for request in requests:
        scheduler.add_request(request)
    outputs: dict[str, tuple[int, ...]] = {}
    for _ in range(max_steps):
        if not scheduler.num_unfinished:
            return outputs
        plan = scheduler.schedule()
        outcome = scheduler.update(plan, executor.execute(plan))
        outputs |= {f.request_id: tuple(f.output_token_ids or ()) for f in outcome.finished}
    msg = f"still {scheduler.num_unfinished} requests after {max_steps} steps"
    raise AssertionError(msg)


def _random_paged_batch(
    q_lens: Sequence[int], kv_lens: Sequence[int], *, page_size: int, seed: int
) -> tuple[torch.Tensor, ...]:
    """Host int32 ``(qo_indptr, kv_indptr, kv_indices, kv_last_page_len)`` over shuffled pages."""
    rng = np.random.default_rng(seed)
    pages = [-(-n // page_size) for n in kv_lens]
    kv_indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    kv_indices = rng.permutation(int(kv_indptr[-1])).astype(np.int32)
    last = ((np.asarray(kv_lens) - 1) % page_size + 1).astype(np.int32)
    qo_indptr = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return tuple(torch.from_numpy(a) for a in (qo_indptr, kv_indptr, kv_indices, last))


def attention_kernel_check(  # noqa: PLR0913 -- keyword-only shapes of the random batch
    kernels: FlashInferKernels,
    *,
    device: torch.device,
    dtype: torch.dtype,
    num_heads: int = 32,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    page_size: int = 16,
    seed: int = 0,
) -> dict[str, float]:
    """Max abs difference of FlashInfer's prefill and decode wrappers from the reference.

    The mixed batch is the FlashInfer notes' (q_lens 37/1/1/12 over kv_lens 37/200/513/80);
    the decode batch has one row over kv_lens 1/16/17/200/513. Random q and cache in ``dtype``.
    """
    generator = torch.Generator(device="cpu").manual_seed(seed)
    workspace = torch.zeros(128 << 20, dtype=torch.uint8, device=device)
    out = {}
    for name, q_lens, kv_lens in (
        ("prefill", [37, 1, 1, 12], [37, 200, 513, 80]),
        ("decode", [1, 1, 1, 1, 1], [1, 16, 17, 200, 513]),
    ):
        qo, kvp, idx, last = _random_paged_batch(q_lens, kv_lens, page_size=page_size, seed=seed)
        cache = torch.randn(int(kvp[-1]), 2, page_size, num_kv_heads, head_dim, generator=generator)
        q = torch.randn(int(qo[-1]), num_heads, head_dim, generator=generator)
        cache, q = cache.to(device, dtype), q.to(device, dtype)
        dev_idx = idx.to(device)
        heads = (num_heads, num_kv_heads, head_dim, page_size)
        if name == "prefill":
            prefill = kernels.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa2")
            prefill.plan(
                qo,
                kvp,
                dev_idx,
                last,
                *heads,
                causal=True,
                pos_encoding_mode="NONE",
                q_data_type=dtype,
                kv_data_type=dtype,
            )
            got = prefill.run(q, cache)
        else:
            decode = kernels.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True, backend="fa2")
            decode.plan(kvp, dev_idx, last, *heads, pos_encoding_mode="NONE", q_data_type=dtype, kv_data_type=dtype)
            got = decode.run(q, cache)
        want, _ = paged_attention(q, cache, qo, kvp, idx, last)
        out[f"{name}_max_abs_diff"] = float((got.float() - want.float()).abs().max())
    return out
