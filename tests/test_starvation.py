"""Nothing starves: under FCFS and a bounded load, every request is served within a bounded wait.

The state machine drains its queue once arrivals stop; this test keeps arrivals coming, as a
server sees them, and bounds how long any request waits for its first token computation.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from phasesched import DeterministicExecutor, PolicyOptions, Request, Scheduler, SchedulerConfig, load_policy

STEPS = 400
MAX_WAIT_STEPS = 60
"""Bound on the steps between arrival and first scheduling; a starved request waits for the whole run."""


def waits(policy_name: str, num_pages: int, seed: int) -> tuple[dict[str, int], list[str], int]:
    """Steps each request waited, the order requests were first scheduled, and the steps to drain."""
    rng = np.random.default_rng(seed)
    scheduler = Scheduler(
        SchedulerConfig(num_pages=num_pages, page_size=16, max_model_len=4096),
        load_policy(policy_name, PolicyOptions(max_model_len=4096, max_num_batched_tokens=512, chunk_size=128)),
    )
    executor = DeterministicExecutor()
    arrived: dict[str, int] = {}
    waited: dict[str, int] = {}
    order: list[str] = []
    step = 0
    while step < STEPS or scheduler.num_unfinished:
        if step < STEPS and rng.random() < 0.25:  # about 30 tokens a step against a 512-token budget
            request_id = f"r{len(arrived)}"
            prompt, output = int(rng.integers(1, 200)), int(rng.integers(1, 24))
            scheduler.add_request(Request(request_id, prompt_len=prompt, max_new_tokens=output, arrival_time=step))
            arrived[request_id] = step
        plan = scheduler.schedule(float(step))
        for request_id in plan.request_ids:
            if request_id not in waited:
                waited[request_id] = step - arrived[request_id]
                order.append(request_id)
        scheduler.update(plan, executor.execute(plan))
        step += 1
        assert step < 20 * STEPS, "the queue never drained"
    return waited, order, step


@settings(max_examples=12, deadline=None)
@given(
    policy_name=st.sampled_from(["vllm", "sarathi", "sglang", "orca", "trtllm-equal-progress"]),
    num_pages=st.sampled_from([40, 4096]),  # tight KV preempts; ample KV never does
    seed=st.integers(0, 10_000),
)
def test_fcfs_serves_everyone_within_a_bounded_wait(policy_name: str, num_pages: int, seed: int) -> None:
    """With FCFS order and load well under capacity, no request waits more than a bounded number of steps."""
    waited, _, _ = waits(policy_name, num_pages, seed)
    assert waited, "the workload issued no request"
    worst = max(waited, key=waited.__getitem__)
    assert waited[worst] <= MAX_WAIT_STEPS, f"{worst} waited {waited[worst]} steps"


@settings(max_examples=8, deadline=None)
@given(policy_name=st.sampled_from(["sarathi", "orca"]), seed=st.integers(0, 10_000))
def test_fcfs_starts_requests_in_arrival_order(policy_name: str, seed: int) -> None:
    """With chunk sizers that never decline a prompt, FCFS starts requests strictly in arrival order."""
    _, order, _ = waits(policy_name, 4096, seed)
    assert order == sorted(order, key=lambda request_id: int(request_id[1:]))
