"""Policies hosted outside phasesched's scheduler: the view protocol, ``propose`` and its checks."""

from __future__ import annotations

from collections.abc import Callable

import attrs
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from phasesched import InvalidPlanError, PolicyOptions, Request, Scheduler, SchedulerConfig, load_policy
from phasesched.hosting import ArrayView, PolicyView, check_proposal, propose
from phasesched.policies import LongestPrefixMatch, SchedulingPolicy, TokenBudget
from phasesched.selection import Selection
from phasesched.view import SchedulerView
from phasesched.waiting import WaitingCandidate
from tests.fakes import Driver

POLICIES = ["vllm", "vllm-priority", "sarathi", "sglang", "sglang-lpm", "orca", "trtllm-equal-progress"]


def policy_named(name: str, options: PolicyOptions) -> SchedulingPolicy:
    """A preset, or ``sglang-lpm``: SGLang's preset with its cache-aware longest-prefix-match order."""
    if name == "sglang-lpm":
        return attrs.evolve(load_policy("sglang", options), queue_order=LongestPrefixMatch())
    return load_policy(name, options)


NONE = np.empty(0, np.int32)  # no running request in the selection


def scheduler_view(scheduler: Scheduler) -> SchedulerView:
    """The view the scheduler itself would give its policy now."""
    return SchedulerView(
        now=0.0,
        budget=scheduler.policy.budget,
        kv=scheduler._kv,
        arrays=scheduler._arrays,
        running=scheduler._running,
        waiting=scheduler._waiting,
        max_model_len=scheduler.config.max_model_len,
    )


def array_view(scheduler: Scheduler) -> tuple[ArrayView, list[str]]:
    """The scheduler's state as a foreign host would describe it: plain arrays, slot i = i-th running request.

    Like the vLLM adapter, the host lists waiting requests in its queue's fixed order, each with
    the tokens its prefix cache holds for it, and counts shared pages itself for preemptions.
    """
    arrays, running, kv = scheduler._arrays, scheduler._running.copy(), scheduler.kv

    def waiting() -> object:
        for seq in scheduler._waiting.ordered():
            cached = 0 if seq.precomputed else kv.cached_prefix(seq.claimable_hashes(kv.page_size), seq.num_tokens)
            computed = seq.precomputed or cached * kv.page_size
            yield WaitingCandidate(seq.request, seq.num_tokens, seq.num_preemptions, computed)

    view = ArrayView(
        budget=scheduler.policy.budget,
        page_size=scheduler.kv.page_size,
        free_pages=scheduler.kv.num_free_pages,
        num_computed=arrays.computed[running],
        num_tokens=arrays.known[running],
        prompt_len=arrays.prompt_len[running],
        page_count=scheduler.kv.page_counts[running],
        arrival_time=arrays.arrival[running],
        priority=arrays.priority[running],
        requests=[arrays.seqs[s].request for s in running.tolist()],
        waiting=waiting,  # type: ignore[arg-type]
        num_waiting=scheduler.num_waiting,
        watermark_pages=scheduler.kv.watermark_pages,
        max_model_len=scheduler.config.max_model_len,
        freed_by_preempting=lambda slots: kv.freed_by_freeing(running[slots]),
    )
    return view, scheduler.running_request_ids()


def by_id(selection: Selection, request_id: Callable[[int], str]) -> tuple[dict[str, int], set[str]]:
    """A selection as (tokens per request id, preempted ids), whatever the host's slot numbering."""
    slots, tokens = selection.running_slots.tolist(), selection.running_tokens.tolist()
    by_request = {request_id(s): n for s, n in zip(slots, tokens, strict=True)}
    by_request.update(zip(selection.admitted, selection.admitted_tokens, strict=True))
    return by_request, {request_id(s) for s in selection.preempted}


class TestPolicyView:
    def test_both_views_implement_the_protocol(self) -> None:
        """phasesched's SchedulerView and the foreign-host ArrayView both satisfy PolicyView."""
        scheduler = Scheduler(SchedulerConfig(num_pages=16), load_policy("vllm"))
        scheduler.add_request(Request("a", prompt_len=5))
        native: PolicyView = scheduler_view(scheduler)
        foreign: PolicyView = array_view(scheduler)[0]
        assert isinstance(native, PolicyView)
        assert isinstance(foreign, PolicyView)

    def test_array_view_refuses_arrays_of_the_wrong_length(self) -> None:
        """Per-slot arrays must have one entry per running request."""
        with pytest.raises(InvalidPlanError, match="entries"):
            ArrayView(
                budget=TokenBudget(),
                page_size=16,
                free_pages=4,
                num_computed=[1, 2],
                num_tokens=[2],
                prompt_len=[1],
                requests=[Request("a", prompt_len=1)],
            )


class TestPropose:
    @settings(max_examples=40, deadline=None)
    @given(
        policy=st.sampled_from(POLICIES),
        prompts=st.lists(
            st.tuples(st.integers(1, 700), st.integers(1, 12), st.integers(0, 3), st.integers(-1, 2)),
            min_size=1,
            max_size=8,
        ),
        num_pages=st.integers(60, 200),
    )
    # r3 is admitted after r2 into a lower, reused slot; a page short, the victim must be r3 on
    # every host (a tie-break by slot number picked r2 in the scheduler, r3 over plain arrays).
    @example(policy="vllm", prompts=[(1, 1, 0, 0), (1, 1, 0, 0), (287, 3, 0, 1), (656, 2, 0, 0)], num_pages=60)
    def test_propose_answers_as_the_scheduler_commits(
        self, policy: str, prompts: list[tuple[int, int, int, int]], num_pages: int
    ) -> None:
        """Each step, propose() over the scheduler's view and over plain arrays gives the step it runs.

        Prompts of one family (0-2) share their prefixes, so with a preset that caches prefixes
        later admissions claim cached pages; family -1 is a length-only prompt.
        """
        options = PolicyOptions(max_num_batched_tokens=1024, max_num_seqs=4)
        scheduler = Scheduler(SchedulerConfig(num_pages=num_pages, page_size=16), policy_named(policy, options))
        for i, (prompt, new, priority, family) in enumerate(prompts):
            if family < 0:
                request = Request(f"r{i}", prompt_len=prompt, max_new_tokens=new, priority=priority)
            else:
                tokens = [(family * 31 + k) % 997 for k in range(prompt)]
                request = Request(f"r{i}", prompt_token_ids=tokens, max_new_tokens=new, priority=priority)
            scheduler.add_request(request)
        driver = Driver(scheduler)
        for _ in range(300):
            if not scheduler.num_unfinished:
                break
            native = by_id(propose(scheduler.policy, scheduler_view(scheduler)), scheduler._arrays.ids.__getitem__)
            view, ids = array_view(scheduler)
            foreign = by_id(propose(scheduler.policy, view), ids.__getitem__)
            plan = driver.step()
            committed = dict(zip(plan.request_ids, plan.num_new.tolist(), strict=True)), set(plan.preempted)
            assert native == committed
            assert foreign == committed


def _view(**overrides: object) -> ArrayView:
    """Two running requests (one decoding, one mid-prompt) and one waiting, with 3 free pages."""
    args: dict[str, object] = {
        "budget": TokenBudget(max_num_batched_tokens=64, max_num_seqs=3),
        "page_size": 16,
        "free_pages": 3,
        "num_computed": [20, 32],
        "num_tokens": [21, 100],
        "prompt_len": [20, 100],
        "requests": [Request("a", prompt_len=20), Request("b", prompt_len=100)],
        "waiting": lambda: iter([WaitingCandidate(Request("w", prompt_len=40), 40, 0)]),
    }
    args.update(overrides)
    return ArrayView(**args)  # type: ignore[arg-type]


class TestCheckProposal:
    def test_a_valid_proposal_passes(self) -> None:
        """A decode, a chunk and an admission within every limit pass."""
        check_proposal(Selection(np.array([0, 1]), np.array([1, 30]), admitted=("w",), admitted_tokens=(16,)), _view())

    @pytest.mark.parametrize(
        ("selection", "match"),
        [
            (Selection(np.array([0, 0]), np.array([1, 1])), "twice"),
            (Selection(np.array([2]), np.array([1])), "no running request"),
            (Selection(np.array([0]), np.array([2])), "more tokens than it has left"),
            (Selection(np.array([0]), np.array([0])), "at least one token"),
            (Selection(np.array([1]), np.array([68])), "max_num_batched_tokens"),
            (Selection(np.array([1]), np.array([64])), "KV pages"),
            (
                Selection(NONE, NONE, admitted=("x",), admitted_tokens=(1,)),
                "not waiting",
            ),
            (
                Selection(NONE, NONE, admitted=("w",), admitted_tokens=(41,)),
                "given 41 tokens",
            ),
            (Selection(np.array([0]), np.array([1]), preempted=(0,)), "twice"),
        ],
    )
    def test_invalid_proposals_are_refused(self, selection: Selection, match: str) -> None:
        """Duplicates, unknown slots or ids, token counts out of range, budget and page overruns raise."""
        with pytest.raises(InvalidPlanError, match=match):
            check_proposal(selection, _view())

    def test_preemptions_free_pages_for_the_step(self) -> None:
        """Pages the proposed victims hold count as free."""
        check_proposal(Selection(np.array([1]), np.array([64]), preempted=(0,)), _view(page_count=[2, 2]))

    def test_too_many_sequences_are_refused(self) -> None:
        """Running plus admitted requests may not exceed max_num_seqs."""
        view = _view(budget=TokenBudget(max_num_batched_tokens=64, max_num_seqs=2))
        with pytest.raises(InvalidPlanError, match="max_num_seqs"):
            check_proposal(Selection(NONE, NONE, admitted=("w",), admitted_tokens=(1,)), view)
