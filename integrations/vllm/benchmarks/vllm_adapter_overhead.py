#!/usr/bin/env python3
"""Host cost per step of vLLM's V1 scheduler with a phasesched policy (the adapter) against vLLM's own.

Both run in one process on the same vLLM 0.32 build, case by case and round by round in
alternating order, so both see the same machine load. The cases and the timing follow
``shared/peers/vllm_sched/bench.py`` (the vLLM scheduler harness, whose approach this copies):
``schedule()`` and ``update_from_output()`` are timed separately with thread CPU time, the fake
model output is built between the timed regions, the GC heap is frozen after construction as
EngineCore does, prefix caching and stats are on, and KV is sized so nothing is preempted.

Cases
  decode-N    N requests (512-token prompts, 256 new tokens) arrive at once; measured: the steps
              where all N decode one token each.
  mixed       256 requests decoding while a 16K prompt arrives and is chunked under the
              8192-token budget; measured: steps with all 256 decodes plus a chunk. When its
              prefill completes it is aborted (not timed) and a new one arrives.

Run with the vLLM venv (``integrations/vllm/ci.sh`` builds one)::

    python integrations/vllm/benchmarks/vllm_adapter_overhead.py --cases decode-256,decode-1024,mixed --rounds 2

Prints, per case, median CPU microseconds per step of schedule(), update_from_output() and
their sum for each scheduler, and the adapter/vLLM ratio.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Any

from phasesched_vllm.testing import RequestSpec, build_scheduler, fake_model_output, make_request

PROMPT_LEN = 512
MAX_TOKENS = 256
LONG_PROMPT_LEN = 16 * 1024
BUDGET = 8192
ADAPTER = "phasesched_vllm.PhaseschedScheduler"


def blocks_needed(n: int, block_size: int, extra_tokens: int = 0) -> int:
    """bench.py's KV sizing: room for every request and two long prompts, so nothing is preempted."""
    per_request = -(-(PROMPT_LEN + MAX_TOKENS) // block_size) + 1
    return n * per_request + 2 * (-(-extra_tokens // block_size)) + 1024


def scheduler(kind: str, n: int, *, extra_tokens: int = 0, policy: str = "vllm") -> Any:
    """vLLM's scheduler (``kind="vllm"``) or the adapter with ``policy``, sized for ``n`` requests."""
    extra: dict[str, Any] = {}
    if kind == "adapter":
        extra = {"scheduler_cls": ADAPTER, "additional_config": {"phasesched": {"policy": policy}}}
    return build_scheduler(
        num_blocks=blocks_needed(n, 16, extra_tokens),
        block_size=16,
        max_num_seqs=max(256, n + 1),
        max_num_batched_tokens=BUDGET,
        prefix_caching=True,
        log_stats=True,
        **extra,
    )


def timed_step(sched: Any, step: int) -> tuple[Any, int, int]:
    """One EngineCore-style step; returns the output and the CPU ns of schedule() and of update_from_output()."""
    clock = time.thread_time_ns
    c0 = clock()
    output = sched.schedule()
    c1 = clock()
    model_output = fake_model_output(sched, output, step)
    c2 = clock()
    sched.update_from_output(output, model_output)
    c3 = clock()
    return output, c1 - c0, c3 - c2


class Counter:
    """Request ids that do not repeat within a scheduler."""

    def __init__(self) -> None:
        self.next = 0

    def make(self, prompt_len: int, max_tokens: int, hasher: Any) -> Any:
        """A request with a unique prompt (no prefix hits)."""
        self.next += 1
        return make_request(self.next, RequestSpec(0, prompt_len, max_tokens), hasher)


def run_decode(kind: str, n: int, policy: str) -> tuple[list[int], list[int]]:
    """Per-step schedule and update CPU ns of the steps where all ``n`` requests decode."""
    from phasesched_vllm.testing import block_hasher_for  # noqa: PLC0415

    sched = scheduler(kind, n, policy=policy)
    hasher, ids = block_hasher_for(sched), Counter()
    gc.collect()
    gc.freeze()
    schedule_ns, update_ns = [], []
    for _ in range(n):
        sched.add_request(ids.make(PROMPT_LEN, MAX_TOKENS, hasher))
    step = 0
    while sched.has_requests():
        step += 1
        output, s, u = timed_step(sched, step)
        assert not output.preempted_req_ids, "preempted: the KV sizing is wrong"
        if len(output.num_scheduled_tokens) == n and output.total_num_scheduled_tokens == n:
            schedule_ns.append(s)
            update_ns.append(u)
    gc.unfreeze()
    return schedule_ns, update_ns


def run_mixed(kind: str, policy: str, n_bg: int = 256) -> tuple[list[int], list[int]]:
    """Per-step CPU ns of the steps that carry all ``n_bg`` decodes and a chunk of a 16K prompt."""
    from vllm.v1.request import RequestStatus  # noqa: PLC0415

    from phasesched_vllm.testing import block_hasher_for  # noqa: PLC0415

    sched = scheduler(kind, n_bg, extra_tokens=LONG_PROMPT_LEN + MAX_TOKENS, policy=policy)
    hasher, ids = block_hasher_for(sched), Counter()
    gc.collect()
    gc.freeze()
    background = [ids.make(PROMPT_LEN, MAX_TOKENS, hasher) for _ in range(n_bg)]
    for request in background:
        sched.add_request(request)
    schedule_ns, update_ns = [], []
    long_request = None
    step = 0
    while sched.has_requests():
        if long_request is None and all(
            not r.is_finished() and r.num_computed_tokens >= r.num_prompt_tokens for r in background
        ):
            long_request = ids.make(LONG_PROMPT_LEN, MAX_TOKENS, hasher)
            sched.add_request(long_request)
        step += 1
        output, s, u = timed_step(sched, step)
        assert not output.preempted_req_ids, "preempted: the KV sizing is wrong"
        if long_request is not None and long_request.request_id in output.num_scheduled_tokens:
            if len(output.num_scheduled_tokens) == n_bg + 1:
                schedule_ns.append(s)
                update_ns.append(u)
            if long_request.num_computed_tokens >= long_request.num_prompt_tokens:
                sched.finish_requests(long_request.request_id, RequestStatus.FINISHED_ABORTED)
                long_request = None
        if long_request is not None and any(r.is_finished() for r in background):
            sched.finish_requests(long_request.request_id, RequestStatus.FINISHED_ABORTED)
            long_request = None
    gc.unfreeze()
    return schedule_ns, update_ns


def run_case(case: str, kind: str, policy: str) -> tuple[list[int], list[int]]:
    """The named case on one scheduler."""
    if case == "mixed":
        return run_mixed(kind, policy)
    return run_decode(kind, int(case.removeprefix("decode-")), policy)


def median_us(values: list[int]) -> float:
    """Median in microseconds (NaN when empty)."""
    return statistics.median(values) / 1000.0 if values else float("nan")


def main() -> None:
    """Run the cases side by side and print the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="decode-256,decode-1024,mixed")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds per case (more samples)")
    parser.add_argument("--policy", default="vllm", help="the phasesched policy the adapter runs")
    args = parser.parse_args()
    print(f"adapter policy: {args.policy}")
    print("case          scheduler   steps  schedule_us  update_us  total_us   adapter/vLLM (total)")
    for case in args.cases.split(","):
        samples: dict[str, tuple[list[int], list[int]]] = {"vllm": ([], []), "adapter": ([], [])}
        for round_ in range(args.rounds):
            order = ("vllm", "adapter") if round_ % 2 == 0 else ("adapter", "vllm")
            for kind in order:
                s, u = run_case(case, kind, args.policy)
                samples[kind][0].extend(s)
                samples[kind][1].extend(u)
        totals = {k: median_us([a + b for a, b in zip(*v, strict=True)]) for k, v in samples.items()}
        for kind, (s, u) in samples.items():
            ratio = f"{totals['adapter'] / totals['vllm']:.2f}x" if kind == "adapter" else ""
            print(
                f"{case:<13} {kind:<10} {len(s):>6}  {median_us(s):>11.0f}  {median_us(u):>9.0f}"
                f"  {totals[kind]:>8.0f}   {ratio}"
            )


if __name__ == "__main__":
    main()
