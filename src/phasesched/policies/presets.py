"""Named presets that reproduce the scheduling of known systems.

Each preset is a factory ``(PolicyOptions) -> SchedulingPolicy`` registered under the
``phasesched.policies`` entry-point group, exactly as a third-party policy would be. Their
docstrings say what they reproduce and where they differ from the original.
"""

from __future__ import annotations

import attrs

from phasesched.costmodel.protocol import CostModel
from phasesched.errors import InvalidArgumentError
from phasesched.policies.budget import TokenBudget
from phasesched.policies.chunking import FixedChunk, LongPrefillThreshold, NoChunking, SLOAdaptiveChunk
from phasesched.policies.policy import SchedulingPolicy
from phasesched.policies.preemption import LowestPriority, PreemptionPolicy
from phasesched.policies.priority import DecodeFirst, EqualProgress, PrefillFirst
from phasesched.policies.queue_order import PriorityOrder
from phasesched.validators import INT32_MAX, number, optional, whole

__all__ = [
    "PolicyOptions",
    "no_chunk",
    "orca",
    "sarathi",
    "sarathi_slo",
    "sglang",
    "trtllm_equal_progress",
    "vllm",
    "vllm_priority",
]


@attrs.frozen
class PolicyOptions:
    """What a preset may need to know about the deployment; ``None`` keeps its own default.

    Attributes:
        max_model_len: Longest sequence the model accepts (whole-prompt presets size their
            token budget by it).
        max_num_seqs: Override of the sequence cap.
        max_num_batched_tokens: Override of the token budget.
        chunk_size: Override of the prefill chunk size, for presets that have one.
        cost_model: Step-time predictor, required by SLO-adaptive presets.
        tbt_target_s: Time-between-tokens target for SLO-adaptive presets.
        enable_prefix_caching: Override of the preset's prefix caching (on for the engines
            that default to it: vLLM V1, SGLang and TensorRT-LLM; off for the others).

    """

    max_model_len: int = attrs.field(default=32768, validator=whole(gt=0, le=INT32_MAX))
    max_num_seqs: int | None = attrs.field(default=None, validator=optional(whole(gt=0)))
    max_num_batched_tokens: int | None = attrs.field(default=None, validator=optional(whole(gt=0)))
    chunk_size: int | None = attrs.field(default=None, validator=optional(whole(gt=0)))
    cost_model: CostModel | None = None
    tbt_target_s: float | None = attrs.field(default=None, validator=optional(number(gt=0.0)))
    enable_prefix_caching: bool | None = attrs.field(
        default=None, validator=optional(attrs.validators.instance_of(bool))
    )

    def budget(self, tokens: int, seqs: int = 256) -> TokenBudget:
        """A budget with the preset's defaults, overridden where the options say so."""
        return TokenBudget(
            max_num_batched_tokens=self.max_num_batched_tokens or tokens,
            max_num_seqs=self.max_num_seqs or seqs,
        )

    def prefix_caching(self, *, default: bool) -> bool:
        """Whether the preset caches prefixes: its own ``default`` unless the options say otherwise."""
        return default if self.enable_prefix_caching is None else self.enable_prefix_caching


def vllm(options: PolicyOptions) -> SchedulingPolicy:
    """The default of vLLM V1: one shared token budget, decode-first, FCFS, recompute preemption.

    Running requests (decodes and ongoing chunks) are served before waiting ones, and a prompt
    is chunked by whatever budget is left (8192 tokens, 256 sequences). Differs from vLLM:
    at most one prefill is part-way at a time (vLLM's ``max_num_partial_prefills=1`` default,
    which its V1 scheduler declares but does not enforce).

    Prefix caching is on, as vLLM V1's ``enable_prefix_caching`` default is: a request claims
    the cached full pages of its prompt at admission and computes (and is budgeted for) the
    rest, at least its last token, as vLLM does. Pass
    ``PolicyOptions(enable_prefix_caching=False)`` for ``--no-enable-prefix-caching``.
    """
    chunker = LongPrefillThreshold(long_prefill_token_threshold=options.chunk_size or 0)
    return SchedulingPolicy(
        name="vllm",
        budget=options.budget(8192),
        chunker=chunker,
        priority=DecodeFirst(),
        enable_prefix_caching=options.prefix_caching(default=True),
    )


def vllm_priority(options: PolicyOptions) -> SchedulingPolicy:
    """The vLLM preset with ``--scheduling-policy priority``: lower ``priority`` values first.

    Waiting requests are ordered by priority then arrival; the least important running request
    is the preemption victim, and a waiting request may evict running ones it outranks when the
    sequence cap or KV memory keeps it out (as vLLM V0's priority preemption did).
    """
    preemption = PreemptionPolicy(victims=LowestPriority(), preempt_for_waiting=True)
    return attrs.evolve(vllm(options), name="vllm-priority", queue_order=PriorityOrder(), preemption=preemption)


def sarathi(options: PolicyOptions) -> SchedulingPolicy:
    """Sarathi-Serve: stall-free batching with a fixed 512-token chunk and token budget.

    Decodes first, then ongoing chunks, then new prompts, all inside one 512-token budget, so
    a step never carries more than 512 tokens and decodes never wait for a whole prompt.
    ``chunk_size`` sets both the chunk and the budget, as in the paper.
    """
    size = options.chunk_size or 512
    return SchedulingPolicy(
        name="sarathi", budget=options.budget(size), chunker=FixedChunk(size), priority=DecodeFirst()
    )


def sarathi_slo(options: PolicyOptions) -> SchedulingPolicy:
    """Sarathi-Serve's SLO-adaptive rule: the largest chunk whose predicted step meets a TBT target.

    Needs a cost model (the simulator passes its own). The default target is 50 ms. Differs
    from the paper: a minimum 16-token chunk still runs when decodes alone miss the target.
    """
    if options.cost_model is None:
        msg = "the sarathi-slo policy needs a cost model (PolicyOptions.cost_model)"
        raise InvalidArgumentError(msg)
    chunker = SLOAdaptiveChunk(options.cost_model, options.tbt_target_s or 0.05)
    return SchedulingPolicy(name="sarathi-slo", budget=options.budget(8192), chunker=chunker, priority=DecodeFirst())


def sglang(options: PolicyOptions) -> SchedulingPolicy:
    """SGLang's default: prefill-first, one chunked request in flight, 8192-token chunks, FCFS.

    When prompts wait, a step runs them (up to ``chunked_prefill_size`` tokens) and decodes
    pause; only one request may be part-way through its prefill. The waiting queue is FCFS, as
    SGLang's ``--schedule-policy`` defaults to ``fcfs`` (older releases defaulted to ``lpm``,
    which is :class:`~phasesched.policies.LongestPrefixMatch`: set it as the ``queue_order``).
    Its radix cache is on, as in SGLang (prefix caching over full pages;
    ``PolicyOptions(enable_prefix_caching=False)`` is ``--disable-radix-cache``). Differs from
    SGLang: the cache shares whole pages rather than single tokens, and the mixed-chunk option
    is ``PrefillFirst(mix_decodes=True)``.
    """
    size = options.chunk_size or 8192
    chunker = LongPrefillThreshold(long_prefill_token_threshold=size, max_num_partial_prefills=1)
    return SchedulingPolicy(
        name="sglang",
        budget=options.budget(size),
        chunker=chunker,
        priority=PrefillFirst(),
        enable_prefix_caching=options.prefix_caching(default=True),
    )


def orca(options: PolicyOptions) -> SchedulingPolicy:
    """Orca's iteration-level batching: whole prompts beside running decodes, no chunking.

    The token budget is the model's context length, so any prompt fits one step; a long
    prompt therefore stalls every decode in its step for the whole prefill.
    """
    budget = options.budget(max(options.max_model_len, 8192))
    return SchedulingPolicy(name="orca", budget=budget, chunker=NoChunking(), priority=DecodeFirst())


def no_chunk(options: PolicyOptions) -> SchedulingPolicy:
    """Alias of :func:`orca` under the name benchmarks use for the no-chunking baseline."""
    return attrs.evolve(orca(options), name="no-chunk")


def trtllm_equal_progress(options: PolicyOptions) -> SchedulingPolicy:
    """TensorRT-LLM's in-flight batching with the ``EQUAL_PROGRESS`` context-chunking policy.

    Decodes first; the rest of the 8192-token budget is dealt out in 64-token units across up
    to 16 prompts, which advance together. Differs from TensorRT-LLM: its default capacity
    scheduler reserves KV for each request's maximum length at admission
    (``GUARANTEED_NO_EVICT``); here admission is optimistic and memory pressure preempts by
    recompute.

    KV block reuse is on, as TensorRT-LLM's ``KvCacheConfig.enable_block_reuse`` defaults to
    ``True``: a request claims the cached full pages of its prompt at admission. Pass
    ``PolicyOptions(enable_prefix_caching=False)`` for ``enable_block_reuse=False``.
    """
    unit = options.chunk_size or 64
    return SchedulingPolicy(
        name="trtllm-equal-progress",
        budget=options.budget(8192),
        chunker=FixedChunk(unit),
        priority=EqualProgress(unit=unit),
        enable_prefix_caching=options.prefix_caching(default=True),
    )
