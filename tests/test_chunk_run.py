"""Chunk runs take exactly the steps the policy would take one by one, and leave the same state."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from phasesched import PolicyOptions, Request, RequestRejectedError, Scheduler, SchedulerConfig, load_policy
from phasesched.chunk_run import ChunkStep, plan_chunk_steps, plan_steps_after
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


def add(schedulers: tuple[Scheduler, Scheduler], index: int, shape: Shape, *, eos_every: int = 0) -> None:
    """The same length-only request to both (rejected by both or neither).

    Every ``eos_every``-th stops at its first token (an EOS): its tokens matter.
    """
    prompt, output, _ = shape
    stops = eos_every and index % eos_every == 0  # its tokens matter: no run may take its steps
    request = Request(f"r{index}", prompt_len=prompt, max_new_tokens=output, ignore_eos=not stops, eos_token_id=0)
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
    @settings(deadline=None, max_examples=200, suppress_health_check=[HealthCheck.too_slow])
    def test_steps_and_state_match_stepping(
        self, shapes: list[Shape], name: str, chunk: int, pages: int, caching: bool, data: st.DataObject
    ) -> None:
        """Each step of a chunk run is the plan ``schedule()`` makes; ``advance_chunks`` leaves ``update``'s state.

        Budgets above the chunk size let a preempted request's recompute reach its last token
        beside others' chunks (it decodes then, among the decodes); some requests stop at an EOS.
        """
        options = PolicyOptions(
            max_model_len=512,
            chunk_size=chunk,
            enable_prefix_caching=caching,
            max_num_batched_tokens=data.draw(st.sampled_from([None, 3 * chunk, 5 * chunk + 3])),
            max_num_seqs=data.draw(st.sampled_from([None, 3, 6])),
        )
        policy = load_policy(name, options)
        eos_every = data.draw(st.sampled_from([0, 0, 3]))
        config = SchedulerConfig(num_pages=pages, page_size=4, max_model_len=512)
        stepped, ran = Scheduler(config, policy), Scheduler(config, policy)
        pending = sorted(enumerate(shapes), key=lambda item: item[1][2])
        for tick in range(800):
            while pending and pending[0][1][2] <= tick:
                add((stepped, ran), *pending.pop(0), eos_every=eos_every)
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


class TestRecomputes:
    """A preempted request recomputing past its prompt decodes its last token among the decodes: a run ends first."""

    def test_a_run_ends_where_a_recompute_is_one_token_short(self) -> None:
        """Prompt 4, 5 tokens known, chunks of 4: after the first step it decodes, so the run is that step."""
        one = np.array([0], np.int32)
        steps, _ = plan_chunk_steps(
            np.array([1], np.int32),
            np.array([8], np.int32),
            one * 0,
            one * 0,
            one + 5,
            one + 4,
            tokens_left=10,
            chunk_limit=4,
            page_size=4,
            free_pages=10,
            max_steps=5,
        )
        assert [step.num_new.tolist() for step in steps] == [[1, 4]]

    def test_a_run_after_an_admission_ends_where_a_recompute_is_one_token_short(self) -> None:
        """The same, when the admitting step leaves the recompute one token short."""
        first = ChunkStep(
            slots=np.array([1, 0, 2], np.int32),
            num_new=np.array([1, 4, 4], np.int32),
            kv_len=np.array([9, 4, 4], np.int32),
            samples=np.array([True, False, False]),
        )
        known, prompt_len = np.array([9, 5, 30], np.int32), np.array([8, 4, 30], np.int32)
        limits = {"tokens_left": 9, "chunk_limit": 4, "page_size": 4, "free_pages": 10, "max_steps": 5}
        steps, growth = plan_steps_after(first, 3, known, prompt_len, num_decodes=1, spend_budget=False, **limits)
        assert (steps, growth) == ([first], [3])
        steps, _ = plan_steps_after(first, 3, known, prompt_len + 1, num_decodes=1, spend_budget=False, **limits)
        assert len(steps) > 1  # a prompt of 5: the last prompt token is still a prefill's
