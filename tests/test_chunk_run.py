"""Chunk runs take exactly the steps the policy would take one by one, and leave the same state."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from phasesched import PolicyOptions, Request, RequestRejectedError, Scheduler, SchedulerConfig, load_policy
from phasesched.errors import InvalidPlanError
from phasesched.executor import StepResult
from phasesched.plan import StepPlan
from tests.strategies import Shape, workloads


def result_of(plan: StepPlan) -> StepResult:
    """Token 0 for every slice that samples (the simulator's tokens)."""
    return StepResult(plan.step_id, np.where(plan.samples, 0, -1))


def state_of(scheduler: Scheduler) -> tuple[object, ...]:
    """What a step leaves behind: who runs and waits, each request's progress, the pages."""
    running = scheduler.running_request_ids()
    waiting = list(scheduler.waiting_request_ids())
    return (
        running,
        waiting,
        [scheduler.progress(r) for r in running + waiting],
        scheduler.kv.num_free_pages,
        scheduler.kv.num_cached_pages,
        scheduler.kv.cache_stats,
    )


def add(schedulers: tuple[Scheduler, Scheduler], index: int, shape: Shape) -> None:
    """The same length-only request to both (rejected by both or neither)."""
    prompt, output, _ = shape
    request = Request(f"r{index}", prompt_len=prompt, max_new_tokens=output, ignore_eos=True)
    outcomes = [accepts(scheduler, request) for scheduler in schedulers]
    assert outcomes[0] == outcomes[1]


def accepts(scheduler: Scheduler, request: Request) -> bool:
    """Queue ``request``; whether the scheduler took it."""
    try:
        scheduler.add_request(request)
    except RequestRejectedError:
        return False
    return True


class TestChunkRun:
    @given(
        workloads(max_size=10, max_prompt=200, max_output=60, max_arrival=30),
        st.sampled_from(["sarathi", "vllm"]),
        st.sampled_from([4, 16, 64]),
        st.integers(16, 120),
        st.booleans(),
        st.data(),
    )
    @settings(deadline=None, max_examples=150, suppress_health_check=[HealthCheck.too_slow])
    def test_steps_and_state_match_stepping(
        self, shapes: list[Shape], name: str, chunk: int, pages: int, caching: bool, data: st.DataObject
    ) -> None:
        """Each step of a chunk run is the plan ``schedule()`` makes; ``advance_chunks`` leaves ``update``'s state."""
        policy = load_policy(name, PolicyOptions(max_model_len=512, chunk_size=chunk, enable_prefix_caching=caching))
        config = SchedulerConfig(num_pages=pages, page_size=4, max_model_len=512)
        stepped, ran = Scheduler(config, policy), Scheduler(config, policy)
        pending = sorted(enumerate(shapes), key=lambda item: item[1][2])
        for tick in range(800):
            while pending and pending[0][1][2] <= tick:
                add((stepped, ran), *pending.pop(0))
            if not pending and not ran.num_unfinished:
                break
            run = ran.chunk_run(data.draw(st.integers(1, 40)))
            if run is None:
                for scheduler in (stepped, ran):
                    plan = scheduler.schedule(float(tick))
                    scheduler.update(plan, result_of(plan))
            else:
                count = data.draw(st.integers(1, run.max_steps))
                finished = [f.request_id for f in ran.advance_chunks(run, count)]
                expected: list[str] = []
                for j, step in enumerate(run.steps[:count]):
                    plan = stepped.schedule(float(tick))
                    assert plan.slots.tolist() == step.slots.tolist()
                    assert plan.num_new.tolist() == step.num_new.tolist()
                    assert plan.kv_len.tolist() == step.kv_len.tolist()
                    assert plan.samples.tolist() == step.samples.tolist()
                    assert [r.request_id for r in plan.new_requests] == list(run.admitted if j == 0 else ())
                    assert not plan.preempted
                    expected += [f.request_id for f in stepped.update(plan, result_of(plan)).finished]
                assert finished == expected
            assert state_of(ran) == state_of(stepped)
            ran.check_invariants()
        assert not ran.num_unfinished

    def test_a_stale_run_is_refused(self) -> None:
        """A run made before the scheduler changed cannot be taken."""
        scheduler = Scheduler(SchedulerConfig(num_pages=512, page_size=16), load_policy("sarathi"))
        scheduler.add_request(Request("long", prompt_len=4096, max_new_tokens=4, ignore_eos=True))
        plan = scheduler.schedule()
        scheduler.update(plan, result_of(plan))
        run = scheduler.chunk_run(100)
        assert run is not None
        assert [step.num_new.tolist() for step in run.steps] == [[512]] * 7  # up to the prompt's last chunk
        scheduler.add_request(Request("other", prompt_len=8, max_new_tokens=4, ignore_eos=True))
        with pytest.raises(InvalidPlanError):
            scheduler.advance_chunks(run, 1)
