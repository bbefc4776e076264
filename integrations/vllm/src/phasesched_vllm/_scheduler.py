"""vLLM's V1 scheduler with its decisions taken by a phasesched policy.

``PhaseschedScheduler`` subclasses vLLM's ``Scheduler`` and replaces only ``schedule()``. vLLM's
request objects, waiting queue, running list and KV cache manager stay the source of truth:
each step the adapter describes them to the policy as a :class:`phasesched.hosting.PolicyView`,
asks :func:`phasesched.hosting.propose` which running requests compute how many tokens, which
waiting ones are admitted and which running ones are preempted, applies that with vLLM's own
``allocate_slots`` and ``_preempt_request``, and returns vLLM's own ``SchedulerOutput``.
``update_from_output`` and everything else is vLLM's, unchanged.

Supported: decoder-only models with one full-attention KV cache group, prefix caching, both
vLLM queue policies (``fcfs``, ``priority``: vLLM's queue only holds the requests; the order is
the phasesched policy's). Refused at construction, because the adapter does not (yet) carry
their bookkeeping: speculative decoding, LoRA, multimodal/encoder inputs, KV and EC
connectors, hybrid or Mamba KV groups, pipeline parallelism, async scheduling.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray
from vllm.v1.core.sched.interface import PauseState
from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreEventType
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.request import Request, RequestStatus

import phasesched
from phasesched.hosting import ArrayView, propose
from phasesched.policies import ChunkContext, PrefillCandidate
from phasesched.policies.builder import checked_chunk
from phasesched.selection import Selection
from phasesched.waiting import WaitingCandidate
from phasesched_vllm._config import AdapterConfig, policy_from_vllm

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks

    from phasesched import SchedulingPolicy

__all__ = ["PhaseschedScheduler"]

Int32Array = NDArray[np.int32]
_ADMISSIBLE = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


class AdapterError(RuntimeError):
    """vLLM's KV cache manager refused what the policy's view said would fit (an adapter bug)."""


class PhaseschedScheduler(Scheduler):
    """vLLM's V1 ``Scheduler`` driven by a phasesched policy. See the module docstring.

    Load it with ``--scheduler-cls phasesched_vllm.PhaseschedScheduler`` and choose the policy
    with ``--additional-config '{"phasesched": {"policy": "sarathi"}}'``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # vLLM calls scheduler classes with its own (positional or keyword) signature.
        super().__init__(*args, **kwargs)
        self._refuse_unsupported()
        self.adapter_config = AdapterConfig.from_additional_config(self.vllm_config.additional_config)
        self.phasesched_policy: SchedulingPolicy = policy_from_vllm(
            self.adapter_config,
            max_model_len=self.max_model_len,
            max_num_batched_tokens=self.max_num_scheduled_tokens,
            max_num_seqs=min(self.max_num_running_reqs, self.max_num_active_reqs),
        )
        self._refuse_unservable()
        self._ps_requests: dict[str, phasesched.Request] = {}
        manager = self.kv_cache_manager.coordinator.single_type_managers[0]
        self._req_to_blocks: dict[str, list[Any]] = manager.req_to_blocks
        self._block_pool = self.kv_cache_manager.block_pool

    def _refuse_unsupported(self) -> None:
        config = self.vllm_config
        checks = {
            "speculative decoding": self.num_spec_tokens > 0 or self.num_lookahead_tokens > 0,
            "LoRA": self.lora_config is not None,
            "encoder-decoder models": self.is_encoder_decoder,
            "KV or EC connectors": self.connector is not None or self.ec_connector is not None,
            "pipeline parallelism": self.use_pp,
            "async scheduling (pass --no-async-scheduling)": bool(config.scheduler_config.async_scheduling),
            "a KV cache other than one full-attention group": len(self.kv_cache_config.kv_cache_groups) != 1
            or not isinstance(self.kv_cache_config.kv_cache_groups[0].kv_cache_spec, FullAttentionSpec),
            "prefix replay or prefill lookahead": self.prefix_replay_tokens > 0 or self.num_prefill_lookahead > 0,
            "auxiliary output connectors": self.aux_output_connector is not None,
        }
        refused = [name for name, present in checks.items() if present]
        if refused:
            msg = f"PhaseschedScheduler does not support {', '.join(refused)} (vLLM's own Scheduler does)"
            raise NotImplementedError(msg)

    def add_request(self, request: Request) -> None:
        """vLLM's, refusing what the adapter does not schedule (multimodal inputs, LoRA, streaming input)."""
        if request.has_encoder_inputs or request.lora_request is not None or request.resumable:
            msg = f"PhaseschedScheduler does not schedule request {request.request_id!r}: multimodal, LoRA or streaming"
            raise NotImplementedError(msg)
        super().add_request(request)

    def _refuse_unservable(self) -> None:
        """A policy that could never start a prompt of ``max_model_len`` tokens would leave it waiting forever."""
        policy = self.phasesched_policy
        longest = phasesched.Request("max-model-len", prompt_len=self.max_model_len)
        empty = ChunkContext(policy.budget.max_num_batched_tokens, (), np.empty(0, np.int64), np.empty(0, np.int64))
        if checked_chunk(policy.chunker, PrefillCandidate(longest, 0, self.max_model_len, ongoing=False), empty) == 0:
            msg = (
                f"policy {policy.name!r} cannot start a {self.max_model_len}-token prompt under a budget of "
                f"{policy.budget.max_num_batched_tokens} tokens: raise --max-num-batched-tokens to --max-model-len"
            )
            raise ValueError(msg)

    # ------------------------------------------------------------------ the view
    def _ps_request(self, request: Request) -> phasesched.Request:
        ps = self._ps_requests.get(request.request_id)
        if ps is None:
            ps = phasesched.Request(
                request.request_id,
                prompt_len=request.num_prompt_tokens,
                max_new_tokens=max(1, request.max_tokens),
                arrival_time=max(0.0, request.arrival_time),
                priority=request.priority,
            )
            self._ps_requests[request.request_id] = ps
        return ps

    def _waiting_order(self) -> list[Request]:
        """Admissible waiting requests in the policy's queue order (ties: vLLM's queue order)."""
        order = self.phasesched_policy.queue_order
        # vLLM's own check promotes a request whose structured-output grammar is ready.
        requests = [r for r in self.waiting if self._handle_blocked_waiting_request(r) and r.status in _ADMISSIBLE]
        if len(requests) > 1:
            keyed = [(order.key(self._ps_request(r)), i) for i, r in enumerate(requests)]
            keyed.sort()
            requests = [requests[i] for _, i in keyed]
        return requests

    def _build_view(self) -> tuple[ArrayView, dict[str, tuple[KVCacheBlocks, int]]]:
        running = self.running
        n = len(running)
        blocks = self._req_to_blocks
        hits: dict[str, tuple[KVCacheBlocks, int]] = {}
        waiting = self._waiting_order() if self._pause_state == PauseState.UNPAUSED else []

        def candidates() -> Iterator[WaitingCandidate]:
            for request in waiting:
                computed, held = request.num_computed_tokens, 0
                if computed == 0:
                    hit = hits.get(request.request_id)
                    if hit is None:
                        cached, num_hit, _ = self.kv_cache_manager.get_computed_blocks(request)
                        hit = hits[request.request_id] = (cached, num_hit)
                    computed = hit[1]
                    held = self._held_tokens(hit[0])
                # Cached blocks that running requests hold cost the admission no free block (vLLM
                # shares them); the candidate is shown without them, which leaves its remaining
                # tokens as they are and makes the policy's page counts vLLM's.
                yield WaitingCandidate(
                    self._ps_request(request), request.num_tokens - held, request.num_preemptions, computed - held
                )

        view = ArrayView(
            budget=self.phasesched_policy.budget,
            page_size=self.block_size,
            free_pages=self._block_pool.get_num_free_blocks(),
            num_computed=np.fromiter((r.num_computed_tokens for r in running), np.int32, n),
            num_tokens=np.fromiter((r.num_tokens for r in running), np.int32, n),
            prompt_len=np.fromiter((r.num_prompt_tokens for r in running), np.int32, n),
            page_count=np.fromiter((len(blocks.get(r.request_id, ())) for r in running), np.int32, n),
            arrival_time=np.fromiter((r.arrival_time for r in running), np.float64, n),
            priority=np.fromiter((r.priority for r in running), np.int64, n),
            requests=[self._ps_request(r) for r in running],
            waiting=candidates,
            num_waiting=len(waiting),
            now=time.time(),  # the clock of vLLM's arrival times
            # vLLM applies its admission watermark once anything runs.
            watermark_pages=self.kv_cache_manager.watermark_blocks if running else 0,
            max_model_len=self.max_model_len,
            freed_by_preempting=self._freed_by_preempting,
        )
        return view, hits

    def _held_tokens(self, cached: KVCacheBlocks) -> int:
        """Tokens of a prefix hit whose blocks running requests hold (not in the free pool)."""
        held = sum(1 for block in cached.blocks[0] if block.ref_cnt > 0 and not block.is_null)
        return held * self.block_size

    def _freed_by_preempting(self, slots: Int32Array) -> int:
        """Blocks that freeing these running requests returns to the pool (shared prefix blocks count once)."""
        held = Counter(
            block.block_id
            for slot in np.unique(slots).tolist()
            for block in self._req_to_blocks.get(self.running[slot].request_id, ())
            if not block.is_null
        )
        pool = self._block_pool.blocks
        return sum(1 for block_id, count in held.items() if pool[block_id].ref_cnt == count)

    # ------------------------------------------------------------------ the step
    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:  # noqa: ARG002 -- vLLM's signature
        """Ask the phasesched policy for this step and apply it to vLLM's state."""
        self.current_step += 1
        self.kv_cache_manager.new_step_starts()
        timestamp = time.monotonic()
        view, hits = self._build_view()
        # vLLM's pause states: PAUSED_ALL schedules nothing; PAUSED_NEW admits nobody (the view
        # then shows no waiting request).
        paused = self._pause_state == PauseState.PAUSED_ALL
        selection = Selection.empty() if paused else propose(self.phasesched_policy, view)
        running = list(self.running)
        self._apply_preemptions(selection, running, timestamp)
        req_to_new_blocks: dict[str, KVCacheBlocks] = {}
        num_scheduled_tokens: dict[str, int] = {}
        scheduled_running = self._apply_running(selection, running, req_to_new_blocks, num_scheduled_tokens)
        new_reqs, resumed_reqs = self._apply_admissions(
            selection, hits, req_to_new_blocks, num_scheduled_tokens, timestamp
        )
        return self._output(scheduled_running, new_reqs, resumed_reqs, num_scheduled_tokens, req_to_new_blocks)

    def _apply_preemptions(self, selection: Selection, running: list[Request], timestamp: float) -> None:
        for slot in selection.preempted:  # in the policy's order, which fixes their order in vLLM's waiting queue
            request = running[slot]
            self.running.remove(request)
            self._preempt_request(request, timestamp)

    def _apply_running(
        self,
        selection: Selection,
        running: list[Request],
        req_to_new_blocks: dict[str, KVCacheBlocks],
        num_scheduled_tokens: dict[str, int],
    ) -> list[Request]:
        slots, tokens = selection.running_slots, selection.running_tokens
        order = np.argsort(slots, kind="stable")  # vLLM's running order
        scheduled = []
        for slot, num_new in zip(slots[order].tolist(), tokens[order].tolist(), strict=True):
            request = running[slot]
            new_blocks = self.kv_cache_manager.allocate_slots(
                request, num_new, num_lookahead_tokens=self.num_lookahead_tokens
            )
            if new_blocks is None:
                msg = f"vLLM's KV cache manager refused {num_new} tokens for running request {request.request_id!r}"
                raise AdapterError(msg)
            scheduled.append(request)
            req_to_new_blocks[request.request_id] = new_blocks
            num_scheduled_tokens[request.request_id] = num_new
        return scheduled

    def _apply_admissions(
        self,
        selection: Selection,
        hits: dict[str, tuple[KVCacheBlocks, int]],
        req_to_new_blocks: dict[str, KVCacheBlocks],
        num_scheduled_tokens: dict[str, int],
        timestamp: float,
    ) -> tuple[list[Request], list[Request]]:
        new_reqs: list[Request] = []
        resumed_reqs: list[Request] = []
        tokens_left = self.phasesched_policy.budget.max_num_batched_tokens - selection.num_tokens
        for request_id, planned in zip(selection.admitted, selection.admitted_tokens, strict=True):
            request, num_new = self.requests[request_id], planned
            cached, num_hit = hits.get(request_id, (None, 0))
            if request_id in hits:
                # Look again: this step's allocations may have evicted cached blocks of the hit,
                # whose tokens are then computed too (up to the end the policy planned, as the
                # budget allows: they take the free blocks the plan counted for the hit), or
                # cached more of its prefix, which leaves less to compute.
                planned_hit = num_hit
                cached, num_hit, _ = self.kv_cache_manager.get_computed_blocks(request)
                lost = max(0, planned_hit - num_hit)
                num_new = min(request.num_tokens - num_hit, planned + min(lost, tokens_left))
                tokens_left -= max(0, num_new - planned)
            new_blocks = self.kv_cache_manager.allocate_slots(
                request,
                num_new,
                num_new_computed_tokens=num_hit,
                new_computed_blocks=cached,
                num_lookahead_tokens=self.num_lookahead_tokens,
                has_scheduled_reqs=bool(self.running),
            )
            if new_blocks is None:
                msg = f"vLLM's KV cache manager refused {num_new} tokens for admitted request {request_id!r}"
                raise AdapterError(msg)
            if request_id in hits:
                self.kv_cache_manager.record_prefix_cache_stats(request, num_hit)
            self.waiting.remove_request(request)
            self.deferred_waiting.discard(request)
            self.running.append(request)
            if self.log_stats:
                request.record_event(EngineCoreEventType.SCHEDULED, timestamp)
            (new_reqs if request.status == RequestStatus.WAITING else resumed_reqs).append(request)
            req_to_new_blocks[request_id] = self.kv_cache_manager.get_blocks(request_id)
            num_scheduled_tokens[request_id] = num_new
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = request.num_computed_tokens or num_hit
            if request.num_computed_tokens + num_new < request.num_tokens:
                self._inflight_prefills.add(request)
        return new_reqs, resumed_reqs

    def _output(
        self,
        scheduled_running: list[Request],
        new_reqs: list[Request],
        resumed_reqs: list[Request],
        num_scheduled_tokens: dict[str, int],
        req_to_new_blocks: dict[str, KVCacheBlocks],
    ) -> SchedulerOutput:
        """The step as vLLM's ``SchedulerOutput``, built as the tail of vLLM's own ``schedule()`` builds it."""
        if self.use_v2_model_runner:
            new_reqs = new_reqs + resumed_reqs
            resumed_reqs = []
            new_reqs_data = [
                NewRequestData.from_request(
                    req,
                    req_to_new_blocks[req.request_id].get_block_ids(),
                    req._all_token_ids,  # noqa: SLF001 -- as vLLM's own scheduler passes it
                    uses_mrope=self.model_uses_mrope,
                )
                for req in new_reqs
            ]
        else:
            new_reqs_data = [
                NewRequestData.from_request(
                    req, req_to_new_blocks[req.request_id].get_block_ids(), uses_mrope=self.model_uses_mrope
                )
                for req in new_reqs
            ]
        cached_reqs_data = self._make_cached_request_data(
            scheduled_running, resumed_reqs, num_scheduled_tokens, {}, req_to_new_blocks
        )
        if not self.use_v2_model_runner:
            self.prev_step_scheduled_req_ids.clear()
            self.prev_step_scheduled_req_ids.update(num_scheduled_tokens.keys())
        self.kv_cache_manager.take_boundary_state_offloads()
        copies, cow_retained = self.kv_cache_manager.take_kv_cache_block_copies()
        if copies:
            self._free_cow_retained_blocks(cow_retained, self.sched_step_seq + 1)
        total = sum(num_scheduled_tokens.values())
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs_data,
            scheduled_cached_reqs=cached_reqs_data,
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=total,
            scheduled_spec_decode_tokens={},
            scheduled_encoder_inputs={},
            scheduled_encoder_input_stats=None,
            preempted_req_ids=self.reset_preempted_req_ids,
            finished_req_ids=self.finished_req_ids,
            free_encoder_mm_hashes=self.encoder_cache_manager.get_freed_mm_hashes(),
            new_block_ids_to_zero=self._get_new_block_ids_to_zero(),
            has_sync_kv_loads=False,
            kv_cache_block_copies=copies or None,
            kv_connector_block_state=None,
            num_spec_tokens_to_schedule=self.num_spec_tokens,
            ec_manager_metadata=self.encoder_cache_manager.get_manager_metadata(),
        )
        if self.defer_block_free and total > 0:
            self.sched_step_seq += 1
        self._update_after_schedule(output)
        return output

    def _free_request(self, request: Request, delay_free_blocks: bool = False) -> Any:
        """vLLM's, and forget the request's phasesched twin."""
        self._ps_requests.pop(request.request_id, None)
        return super()._free_request(request, delay_free_blocks)
