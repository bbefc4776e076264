"""The discrete-event simulator: conservation of latency, interference, disaggregation, fast-forward."""

from __future__ import annotations

import itertools
import math
from unittest import mock

import attrs
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from phasesched import PolicyOptions, load_policy
from phasesched.costmodel import RooflineCostModel
from phasesched.metrics import RequestRecord, Role
from phasesched.policies.chunking import LongPrefillThreshold
from phasesched.policies.queue_order import ShortestRemainingPrefill
from phasesched.sim import (
    BlockHashes,
    ClosedLoop,
    Deployment,
    Disaggregation,
    Gamma,
    KVLink,
    Poisson,
    SharedPrefixes,
    SimResult,
    Simulator,
    Uniform,
    Workload,
    fixed,
    mixed_load,
    shared_prefix,
    simulate,
    synthetic,
)
from phasesched.sim import simulator as simulator_module

ROOFLINE = RooflineCostModel.from_names("H200", "llama-3-8b")


def mixed(**kwargs: object) -> SimResult:
    """32 short requests decoding when a 16K prompt arrives at 0.5 s."""
    workload = mixed_load(num_short=32, short_prompt=512, short_output=300, long_prompt=16384, long_arrival_s=0.5)
    return simulate(workload, keep_requests=True, keep_gaps=True, **kwargs)  # type: ignore[arg-type]


def long_record(result: SimResult) -> RequestRecord:
    assert result.metrics.requests is not None
    return next(r for r in result.metrics.requests if r.prompt_len == 16384)


class TestLatencyBudget:
    @pytest.mark.parametrize(
        "options",
        [
            {"policy": load_policy("vllm")},
            {"policy": load_policy("sarathi")},
            {"policy": load_policy("sglang")},
            {"policy": load_policy("vllm"), "disaggregation": Disaggregation(1, 2)},
            {"policy": load_policy("sarathi"), "deployment": Deployment(num_pages=1200)},
        ],
        ids=["vllm", "sarathi", "sglang", "disaggregated", "preempting"],
    )
    def test_budget_sums_to_latency_for_every_request(self, options: dict[str, object]) -> None:
        """Queue + prefill + interference + transfer + first decode + decode equals each request's latency."""
        workload = synthetic(60, Gamma(rate=20.0, cv=3.0), Uniform(16, 6000), Uniform(1, 300), seed=4)
        result = simulate(workload, keep_requests=True, **options)  # type: ignore[arg-type]
        assert result.metrics.requests is not None
        assert len(result.metrics.requests) == 60
        for record in result.metrics.requests:
            assert record.budget.total_s == pytest.approx(record.e2el_s, rel=1e-9, abs=1e-12)
            ttft_parts = record.budget.total_s - record.budget.decode_s
            assert ttft_parts == pytest.approx(record.ttft_s, rel=1e-9, abs=1e-12)
            assert min(record.budget.as_dict().values()) >= -1e-12
        if "deployment" in options:
            assert result.metrics["num_preemptions"] > 0

    def test_mean_budget_keys(self) -> None:
        """The run reports the mean budget per phase, and it adds up to the mean latency."""
        result = simulate(fixed(16, 700, 40, rate=30.0), load_policy("sarathi"))
        phases = ("queue", "prefill", "interference", "transfer", "first_decode", "decode")
        total = sum(result.metrics[f"mean_{p}_ms"] for p in phases)
        assert total == pytest.approx(result.metrics["mean_e2el_ms"], rel=1e-9)


class TestInterference:
    def test_no_chunking_stalls_decodes_for_the_whole_prefill(self) -> None:
        """Without chunking, decodes beside a 16K prompt wait at least its prefill time."""
        result = mixed(policy=load_policy("no-chunk"))
        prefill_alone = ROOFLINE.step_time(np.array([16384]), np.array([16384]))
        assert result.metrics.gaps is not None
        assert result.metrics.gaps.gap_s.max() >= prefill_alone

    def test_small_chunks_keep_gaps_near_the_decode_step(self) -> None:
        """With 512-token chunks, p99 token gaps during the long prefill stay within a small factor of a decode step."""
        result = mixed(policy=load_policy("sarathi", PolicyOptions(chunk_size=512)))
        record = long_record(result)
        assert result.metrics.gaps is not None
        window = result.metrics.gaps.overlapping(0.5, 0.5 + record.ttft_s)
        decode_step = ROOFLINE.step_time(np.ones(32, np.int64), np.full(32, 700))
        assert np.percentile(window, 99) < 5 * decode_step
        assert record.ttft_s > ROOFLINE.step_time(np.array([16384]), np.array([16384]))  # chunking costs prefill time

    def test_prefill_first_stalls_decode_first_does_not(self) -> None:
        """SGLang-style prefill-first pauses decodes for its prefill steps; Sarathi's decode-first does not."""
        stall = mixed(policy=load_policy("sglang")).metrics["max_itl_ms"]
        smooth = mixed(policy=load_policy("sarathi")).metrics["max_itl_ms"]
        assert stall > 10 * smooth


class TestDisaggregation:
    def run(self, prompt: int, bandwidth_gbs: float) -> object:
        workload = fixed(1, prompt, 8)
        result = simulate(
            workload, load_policy("vllm"), disaggregation=Disaggregation(1, 1, bandwidth_gbs), keep_requests=True
        )
        assert result.metrics.requests is not None
        return result.metrics.requests[0]

    def test_transfer_time_grows_with_prompt_over_bandwidth(self) -> None:
        """The KV transfer in TTFT is prompt bytes over link bandwidth, plus latency."""
        kv_bytes = Deployment().kv_bytes_per_token()
        for prompt, bandwidth in ((1024, 50.0), (8192, 50.0), (8192, 10.0)):
            record = self.run(prompt, bandwidth)
            expected = prompt * kv_bytes / (bandwidth * 1e9) + 20e-6
            assert record.budget.transfer_s == pytest.approx(expected, rel=1e-6)  # type: ignore[attr-defined]
        small, large, slow = self.run(1024, 50.0), self.run(8192, 50.0), self.run(8192, 10.0)
        assert small.ttft_s < large.ttft_s < slow.ttft_s  # type: ignore[attr-defined]

    def test_shared_link_slows_concurrent_transfers(self) -> None:
        """Two transfers started together share the link and both take twice as long."""
        link = KVLink(bandwidth_bytes_per_s=1e9, latency_s=0.0)
        link.start("a", 1e9, now=0.0)
        link.start("b", 1e9, now=0.0)
        assert link.next_done() == pytest.approx(2.0)
        link2 = KVLink(bandwidth_bytes_per_s=1e9)
        link2.start("a", 1e9, now=0.0)
        link2.start("b", 1e9, now=0.5)  # a has 0.5 GB left, b 1 GB: a finishes at 1.5
        assert link2.next_done() == pytest.approx(1.5)
        assert [t for t, _ in link2.pop_done(1.5)] == ["a"]
        assert link2.next_done() == pytest.approx(2.0)

    def test_decode_worker_admits_only_what_fits(self) -> None:
        """A decode worker with little KV queues transferred requests until pages free up."""
        deployment = Deployment(num_pages=300)
        result = simulate(
            fixed(6, 2000, 50), load_policy("vllm"), deployment, disaggregation=Disaggregation(2, 1), keep_requests=True
        )
        assert result.metrics["completed"] == 6
        assert result.metrics.requests is not None
        assert max(r.budget.first_decode_s for r in result.metrics.requests) > 0.05


class TestFailedRequests:
    """Requests the scheduler rejects are counted as failed, like ``vllm bench serve``'s, and the run goes on."""

    def test_unservable_request_fails_and_the_run_goes_on(self) -> None:
        """A prompt over max_model_len fails; the others complete and their totals leave it out."""
        workload = Workload("w", arrival_s=[0.0, 0.1, 0.2], prompt_len=[500, 5000, 700], output_len=[10, 10, 10])
        calls: list[tuple[int, int]] = []
        result = simulate(
            workload,
            load_policy("vllm"),
            Deployment(max_model_len=2048),
            progress=lambda done, total: calls.append((done, total)),
        )
        assert (result.metrics["completed"], result.metrics["failed"]) == (2, 1)
        assert result.metrics["total_input_tokens"] == 1200
        assert len(result.metrics.errors) == 1
        assert "'r1'" in result.metrics.errors[0]
        assert "max_model_len" in result.metrics.errors[0]
        assert result.to_dict()["failed"] == 1
        assert result.to_dict()["errors"] == list(result.metrics.errors)
        assert calls[-1] == (3, 3)

    def test_no_failures(self) -> None:
        """A run whose requests all fit reports zero failed and no errors."""
        result = simulate(fixed(4, 256, 8), load_policy("vllm"))
        assert result.metrics["failed"] == 0
        assert result.metrics.errors == ()

    def test_errors_kept_are_bounded(self) -> None:
        """Every failure is counted; only the first messages are kept, so memory stays flat."""
        workload = fixed(40, 4096, 4)
        result = simulate(workload, load_policy("vllm"), Deployment(max_model_len=2048))
        assert (result.metrics["completed"], result.metrics["failed"]) == (0, 40)
        assert len(result.metrics.errors) == 10
        assert result.metrics["duration"] == 0.0

    def test_closed_loop_sends_the_next_request_after_a_rejection(self) -> None:
        """In a closed loop a rejected request counts as done, so its client goes on to the next."""
        loop = ClosedLoop(2, 30, prompt=Uniform(100, 4000), output=8, seed=3)
        result = simulate(loop, load_policy("vllm"), Deployment(max_model_len=2048))
        failed = result.metrics["failed"]
        assert 0 < failed < 30
        assert result.metrics["completed"] + failed == 30

    def test_rejection_by_the_decode_pool(self) -> None:
        """A prompt that prefills but whose output cannot fit a decode worker fails at delivery."""
        deployment = Deployment(num_pages=128)  # 2048 tokens of KV per worker
        workload = Workload("w", arrival_s=[0.0, 0.0], prompt_len=[1500, 300], output_len=[1000, 20])
        simulator = Simulator(workload, load_policy("vllm"), deployment, disaggregation=Disaggregation(1, 1))
        result = simulator.run()
        assert (result.metrics["completed"], result.metrics["failed"]) == (1, 1)
        assert "'r0'" in result.metrics.errors[0]
        assert all(w.scheduler.kv.num_used_pages == 0 for w in simulator.workers)


class TestDisaggregatedKVHold:
    """The prefill worker keeps a request's KV until a decode worker admits it."""

    def test_prefill_worker_holds_kv_while_it_crosses_the_link(self) -> None:
        """When a transfer's last byte has moved, the prefill worker still holds the prompt's pages."""
        deployment = Deployment(num_pages=2000)
        simulator = Simulator(fixed(1, 4000, 4), load_policy("vllm"), deployment, disaggregation=Disaggregation(1, 1))
        prefill = simulator.workers[0]
        held: list[int] = []

        class WatchedLink(KVLink):
            def pop_done(self, now: float) -> list[tuple[str, float]]:
                held.append(prefill.scheduler.kv.num_used_pages)
                return super().pop_done(now)

        simulator.link = WatchedLink(50e9, 20e-6)
        simulator.run()
        assert held
        assert held == [prefill.scheduler.kv.pages_for(4000)] * len(held)
        assert prefill.scheduler.kv.num_used_pages == 0  # let go once the decode worker admitted it

    def test_a_run_that_admits_on_a_decode_worker_lets_go(self) -> None:
        """A one-token prompt arrives with nothing computed; the run admitting it lets go of its prefill copy."""
        workload = Workload("w", arrival_s=[0.0, 0.0], prompt_len=[1, 300], output_len=[20, 20])
        simulator = Simulator(workload, load_policy("vllm"), disaggregation=Disaggregation(1, 1))
        simulator.run()
        assert simulator.workers[0].scheduler.held_request_ids == ()
        assert all(w.scheduler.kv.num_used_pages == 0 for w in simulator.workers)

    def queue_of_second(self, bandwidth_gbs: float) -> tuple[float, float]:
        """Two 1500-token prompts at once on a prefill worker with room for one: (its queue, the first's transfer)."""
        deployment = Deployment(num_pages=150)  # 94 pages each: one at a time
        result = simulate(
            fixed(2, 1500, 8),
            load_policy("vllm"),
            deployment,
            disaggregation=Disaggregation(1, 1, bandwidth_gbs),
            keep_requests=True,
        )
        assert result.metrics["completed"] == 2
        assert result.metrics.requests is not None
        first, second = sorted(result.metrics.requests, key=lambda r: r.request_id)
        return second.budget.queue_s, first.budget.transfer_s

    def test_slow_link_throttles_prefill_admission(self) -> None:
        """The second prompt waits for the first's pages, which a slow link keeps on the prefill worker."""
        fast_queue, _ = self.queue_of_second(450.0)
        slow_queue, slow_transfer = self.queue_of_second(0.2)
        assert slow_transfer > 0.5
        assert slow_queue > slow_transfer
        assert fast_queue < 0.5 * slow_transfer


class TestRouting:
    def test_decode_router_prefers_a_worker_with_room(self) -> None:
        """With loads tied, a transferred request goes to the decode worker that has KV room for it."""
        deployment = Deployment(num_pages=300)  # 4800 tokens per worker
        workload = Workload(
            "w", arrival_s=[0.0, 0.2, 0.4], prompt_len=[4000, 100, 1000], output_len=[400, 400, 20]
        )  # r0 nearly fills decode worker 0; r1 goes to idle worker 1; r2 fits only beside r1
        result = simulate(
            workload, load_policy("vllm"), deployment, disaggregation=Disaggregation(1, 2), keep_requests=True
        )
        assert result.metrics.requests is not None
        third = next(r for r in result.metrics.requests if r.request_id == "r2")
        assert third.budget.first_decode_s < 0.05  # not queued behind r0's 400 decode steps

    def test_aggregated_router_prefers_a_replica_with_room(self) -> None:
        """Replicas tied on requests: the one with KV room for the prompt takes it."""
        deployment = Deployment(num_pages=300)
        workload = Workload("w", arrival_s=[0.0, 0.0, 0.3], prompt_len=[4000, 100, 1000], output_len=[400, 400, 20])
        result = simulate(workload, load_policy("vllm"), deployment, replicas=2, keep_requests=True)
        assert result.metrics.requests is not None
        third = next(r for r in result.metrics.requests if r.request_id == "r2")
        assert third.budget.queue_s < 0.05

    def test_the_router_sees_the_pages_a_run_has_taken_by_the_arrival(self) -> None:
        """A replica mid-run has room only for what its steps so far left free, not what it had when the run began.

        r0's run on replica 0 starts with room for r2 (87 pages free, r2 needs 60), but when r2
        arrives, ~670 decode steps later, r0's growth has taken 42 of them.
        """
        deployment = Deployment(num_pages=200, max_model_len=8192)
        workload = Workload("w", arrival_s=[0.0, 0.001, 3.0], prompt_len=[1800, 16, 960], output_len=[1000, 1000, 4])
        fast, _ = assert_times_of_stepping(
            {"workload": workload, "policy": load_policy("vllm"), "deployment": deployment, "replicas": 2}
        )
        assert fast.metrics.requests is not None
        third = next(r for r in fast.metrics.requests if r.request_id == "r2")
        assert third.ttft_s < 0.05  # on replica 1, at once: not queued behind r0 on replica 0
        assert fast.workers[0].runs == 2  # r0's admitting step, then one decode run past r2's arrival

    def test_the_decode_router_sees_the_pages_a_run_has_taken_by_the_delivery(self) -> None:
        """As above, for KV delivered to one of two decode workers: r0 decodes on the first, r1 on the second."""
        deployment = Deployment(num_pages=200, max_model_len=8192)
        workload = Workload("w", arrival_s=[0.0, 0.2, 3.0], prompt_len=[1800, 16, 960], output_len=[1000, 1000, 4])
        fast, _ = assert_times_of_stepping(
            {
                "workload": workload,
                "policy": load_policy("vllm"),
                "deployment": deployment,
                "disaggregation": Disaggregation(1, 2),
            }
        )
        assert fast.metrics.requests is not None
        third = next(r for r in fast.metrics.requests if r.request_id == "r2")
        assert third.ttft_s < 0.05  # on the second decode worker, at once: not queued behind r0


class TestSimulator:
    def test_deterministic(self) -> None:
        """The same inputs give exactly the same results."""
        workload = synthetic(200, Poisson(30.0), Uniform(10, 3000), Uniform(1, 200), seed=9)
        a = simulate(workload, load_policy("vllm")).metrics.to_dict()
        b = simulate(workload, load_policy("vllm")).metrics.to_dict()
        assert a == b

    def test_closed_loop_keeps_concurrency(self) -> None:
        """A closed loop of one client sends requests one after another: each waits for nothing."""
        result = simulate(ClosedLoop(1, 5, prompt=1000, output=20), load_policy("vllm"), keep_requests=True)
        assert result.metrics["completed"] == 5
        assert result.metrics.requests is not None
        assert all(r.budget.queue_s == 0.0 for r in result.metrics.requests)
        ends = sorted(r.arrival_s + r.e2el_s for r in result.metrics.requests)
        arrivals = sorted(r.arrival_s for r in result.metrics.requests)
        assert arrivals[1:] == pytest.approx(ends[:-1])

    def test_replicas_share_the_load(self) -> None:
        """Two replicas serve a saturating load with lower latency than one."""
        workload = fixed(64, 2000, 100, rate=50.0)
        one = simulate(workload, load_policy("vllm")).metrics["mean_e2el_ms"]
        two = simulate(workload, load_policy("vllm"), replicas=2).metrics["mean_e2el_ms"]
        assert two < one

    def test_goodput_counts_requests_within_slo(self) -> None:
        """Goodput counts only requests that meet both the TTFT and TPOT targets."""
        workload = fixed(20, 4000, 50, rate=40.0)
        loose = simulate(workload, load_policy("vllm"), ttft_slo_s=100.0, tpot_slo_s=100.0).metrics
        tight = simulate(workload, load_policy("vllm"), ttft_slo_s=0.15, tpot_slo_s=100.0).metrics
        assert loose["request_goodput"] == pytest.approx(loose["request_throughput"])
        assert 0 < tight["request_goodput"] < loose["request_goodput"]

    def test_finished_requests_are_not_kept(self) -> None:
        """After a run no request timeline is held and the token-gap distribution is bounded."""
        simulator = Simulator(
            synthetic(3000, Poisson(200.0), Uniform(4, 64), Uniform(20, 60), seed=1), load_policy("vllm")
        )
        result = simulator.run()
        assert result.metrics["completed"] == 3000
        assert simulator.recorder.num_live == 0
        assert not result.metrics.distributions["itl"].is_exact


@st.composite
def scenarios(draw: st.DrawFn) -> dict[str, object]:
    n = draw(st.integers(1, 25))
    prompts, outputs = Uniform(1, draw(st.sampled_from([64, 2000, 9000]))), Uniform(1, draw(st.sampled_from([3, 80])))
    seed = draw(st.integers(0, 1000))
    workload: Workload | ClosedLoop
    if draw(st.integers(0, 3)) == 0:  # shared system prompts: the prefix cache claims and evicts pages
        sharing = SharedPrefixes(
            system_prompt=draw(st.sampled_from([64, 1024])),
            num_system_prompts=draw(st.integers(1, 3)),
            turns=draw(st.integers(1, 3)),
            think_s=draw(st.sampled_from([0.0, 0.5])),
        )
        rate = draw(st.sampled_from([2.0, 20.0, 200.0]))
        workload = shared_prefix(n, Poisson(rate), prompts, outputs, sharing, seed=seed)
    elif draw(st.booleans()):
        think = draw(st.sampled_from([0.0, 0.01]))
        workload = ClosedLoop(draw(st.integers(1, 5)), n, prompt=prompts, output=outputs, seed=seed, think_time_s=think)
    else:
        arrivals = Gamma(rate=draw(st.sampled_from([2.0, 20.0, 200.0])), cv=2.0)
        workload = synthetic(n, arrivals, prompts, outputs, seed=seed)
    policy = load_policy(
        draw(st.sampled_from(["vllm", "sarathi", "sglang", "orca", "trtllm-equal-progress"])),
        PolicyOptions(max_model_len=32768),
    )
    options: dict[str, object] = {
        "workload": workload,
        "policy": policy,
        # A 4096-token context rejects some prompts: failed requests must not change the equivalence.
        "deployment": Deployment(
            num_pages=draw(st.sampled_from([130, 700, 5000])), max_model_len=draw(st.sampled_from([32768, 4096]))
        ),
    }
    if draw(st.booleans()):
        options["disaggregation"] = Disaggregation(draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    elif draw(st.booleans()):
        options["replicas"] = draw(st.integers(2, 3))
    return options


@given(scenarios())
@settings(deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow])
def test_fast_forward_gives_the_metrics_of_stepping(options: dict[str, object]) -> None:
    """Advancing runs of decode steps at once gives the same results as stepping one by one."""
    fast = simulate(fast_forward=True, keep_requests=True, keep_gaps=True, **options).metrics  # type: ignore[arg-type]
    slow = simulate(fast_forward=False, keep_requests=True, keep_gaps=True, **options).metrics  # type: ignore[arg-type]
    # Every token's time: the gaps with their end times, recorded in bulk or step by step.
    assert fast.gaps is not None
    assert slow.gaps is not None
    fast_gaps = sorted(zip(fast.gaps.end_s.tolist(), fast.gaps.gap_s.tolist(), strict=True))
    slow_gaps = sorted(zip(slow.gaps.end_s.tolist(), slow.gaps.gap_s.tolist(), strict=True))
    assert fast_gaps == slow_gaps
    for key, value in slow.values.items():
        other = fast.values[key]
        if isinstance(value, float) and math.isnan(value):
            assert math.isnan(other), key
        elif key.startswith(("mean_", "std_")) or key.endswith("throughput"):
            assert other == pytest.approx(value, rel=1e-9, abs=1e-12), key
        else:
            assert other == value, key
    assert fast.requests is not None
    assert slow.requests is not None
    by_id = {r.request_id: r for r in slow.requests}
    for record in fast.requests:
        twin = by_id[record.request_id]
        assert (record.ttft_s, record.e2el_s, record.output_len) == (twin.ttft_s, twin.e2el_s, twin.output_len)
        for phase, seconds in record.budget.as_dict().items():
            assert seconds == pytest.approx(twin.budget.as_dict()[phase], rel=1e-9, abs=1e-12), phase


@given(scenarios(), st.integers(0, 6), st.sampled_from([0.01, 0.3, 3.0]))
@settings(deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow])
def test_stop_after_missed_stops_exactly_when_the_whole_run_misses_more(
    options: dict[str, object], limit: int, ttft_s: float
) -> None:
    """A run stops early exactly when the whole run ends with more misses than allowed; else it is the whole run."""
    slo = {"ttft_slo_s": ttft_s, "tpot_slo_s": 0.03}
    whole = Simulator(**options, **slo, keep_requests=True)  # type: ignore[arg-type]
    whole_result = whole.run()
    assert whole_result.metrics.requests is not None
    late = [r for r in whole_result.metrics.requests if not (r.ttft_s <= ttft_s and not r.tpot_s > 0.03)]
    assert whole.recorder.missed == len(late) + whole_result.metrics["failed"]
    part = Simulator(**options, **slo, keep_requests=True, stop_after_missed=limit)  # type: ignore[arg-type]
    part_result = part.run()
    assert part_result.stopped_early == (whole.recorder.missed > limit)
    if part_result.stopped_early:
        assert limit < part.recorder.missed <= whole.recorder.missed
        assert part.recorder.completed <= whole.recorder.completed
    else:  # the same run, but for sums taken in another order (a lone worker's runs stop at finishes under a limit)
        assert _same_up_to_rounding(part_result.metrics.values, whole_result.metrics.values)


def _same_up_to_rounding(a: dict[str, float], b: dict[str, float]) -> bool:
    """:func:`_same`, but means, deviations and throughputs (sums in some order) only to within 1e-9."""
    inexact = {k for k in a if k.startswith(("mean_", "std_")) or k.endswith("throughput")}
    exact = _same({k: v for k, v in a.items() if k not in inexact}, {k: v for k, v in b.items() if k not in inexact})
    return exact and all(a[k] == pytest.approx(b[k], rel=1e-9, abs=1e-12, nan_ok=True) for k in inexact)


def test_a_late_first_token_counts_as_missed_before_its_request_finishes() -> None:
    """A first token past the TTFT target is a certain miss: the run stops there, not at the finish."""
    simulator = Simulator(fixed(2, 512, 1000), load_policy("vllm"), ttft_slo_s=1e-6, stop_after_missed=0)
    result = simulator.run()
    assert result.stopped_early
    assert result.metrics["completed"] == 0
    assert simulator.recorder.missed == 2  # both prompts prefilled in the first step
    whole = Simulator(fixed(2, 512, 1000), load_policy("vllm"), ttft_slo_s=1e-6)
    whole.run()
    assert whole.recorder.missed == 2
    assert whole.recorder.completed == 2


def _same(a: dict[str, float], b: dict[str, float]) -> bool:
    """Equal results, NaN equal to NaN."""
    return a.keys() == b.keys() and all(a[k] == b[k] or (math.isnan(a[k]) and math.isnan(b[k])) for k in a)


@given(scenarios())
@settings(deadline=None, max_examples=30, suppress_health_check=[HealthCheck.too_slow])
def test_skipping_the_empty_steps_of_idle_workers_changes_no_record(options: dict[str, object]) -> None:
    """A worker with nothing running or waiting is not asked to plan: the results are those of asking it."""
    skipping = simulate(keep_requests=True, keep_gaps=True, **options).metrics  # type: ignore[arg-type]
    with mock.patch.object(simulator_module, "_has_nothing_to_run", return_value=False):
        asking = simulate(keep_requests=True, keep_gaps=True, **options).metrics  # type: ignore[arg-type]
    assert repr(sorted(skipping.values.items())) == repr(sorted(asking.values.items()))
    assert skipping.requests is not None
    assert asking.requests is not None
    by_id = {record.request_id: repr(record) for record in asking.requests}  # repr: a NaN TPOT equals itself
    assert {record.request_id: repr(record) for record in skipping.requests} == by_id
    assert skipping.gaps is not None
    assert asking.gaps is not None
    assert skipping.gaps.end_s.tolist() == asking.gaps.end_s.tolist()
    assert skipping.gaps.gap_s.tolist() == asking.gaps.gap_s.tolist()


@st.composite
def queued_scenarios(draw: st.DrawFn) -> dict[str, object]:
    """One worker whose KV holds a few requests while many wait: blocked queues, arrivals mid-run, preemptions."""
    n = draw(st.sampled_from([12, 40]))
    prompts = Uniform(1, draw(st.sampled_from([300, 1500])))
    outputs = Uniform(1, draw(st.sampled_from([40, 200])))
    workload = synthetic(
        n, Poisson(draw(st.sampled_from([5.0, 50.0]))), prompts, outputs, seed=draw(st.integers(0, 1000))
    )
    name = draw(st.sampled_from(["vllm", "sarathi", "sglang", "orca", "trtllm-equal-progress", "vllm-priority"]))
    policy = load_policy(name, PolicyOptions(max_model_len=4096, chunk_size=draw(st.sampled_from([None, 64]))))
    if draw(st.booleans()):  # newcomers may overtake the queue's head
        policy = attrs.evolve(policy, queue_order=ShortestRemainingPrefill(aging_tokens_per_s=1.0))
    deployment = Deployment(
        num_pages=draw(st.integers(110, 400)), max_model_len=4096, watermark=draw(st.sampled_from([0.0, 0.05]))
    )
    return {"workload": workload, "policy": policy, "deployment": deployment}


def token_gaps(result: SimResult) -> list[tuple[float, float]]:
    """Every token gap of a run kept with ``keep_gaps``, as (end, gap) pairs in time order."""
    gaps = result.metrics.gaps
    assert gaps is not None
    return sorted(zip(gaps.end_s.tolist(), gaps.gap_s.tolist(), strict=True))


@given(queued_scenarios())
@settings(deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow])
def test_fast_forward_through_blocked_queues_gives_every_token_time_of_stepping(options: dict[str, object]) -> None:
    """Decode runs beside a queue that admits nobody (passing arrivals that join it) time tokens as stepping does."""
    assert_times_of_stepping(options)


def assert_times_of_stepping(options: dict[str, object]) -> tuple[SimResult, SimResult]:
    """Simulate with and without fast-forward: the same steps, token times and request timelines.

    Returns:
        The fast-forwarded result and the stepped one, for further checks.
    """
    fast = simulate(fast_forward=True, keep_requests=True, keep_gaps=True, **options)  # type: ignore[arg-type]
    slow = simulate(fast_forward=False, keep_requests=True, keep_gaps=True, **options)  # type: ignore[arg-type]
    assert fast.steps == slow.steps
    assert token_gaps(fast) == token_gaps(slow)
    assert fast.metrics.requests is not None
    assert slow.metrics.requests is not None
    timelines = {r.request_id: (r.ttft_s, r.e2el_s, r.output_len) for r in slow.metrics.requests}
    assert {r.request_id: (r.ttft_s, r.e2el_s, r.output_len) for r in fast.metrics.requests} == timelines
    return fast, slow


@st.composite
def chunked_scenarios(draw: st.DrawFn) -> dict[str, object]:
    """Prompts chunked over many steps beside decodes: tight KV, queues, preemptions, prefix caching on and off."""
    n = draw(st.integers(2, 30))
    prompts = Uniform(1, draw(st.sampled_from([300, 1500, 6000])))
    outputs = Uniform(1, draw(st.sampled_from([5, 60])))
    seed = draw(st.integers(0, 1000))
    rate = draw(st.sampled_from([2.0, 20.0, 200.0]))
    workload: Workload | ClosedLoop
    shape = draw(st.integers(0, 3))
    if shape == 0:  # shared prefixes: prompt pages are named as chunks fill them, and claimed
        sharing = SharedPrefixes(
            system_prompt=draw(st.sampled_from([64, 1024])), num_system_prompts=draw(st.integers(1, 3)), turns=2
        )
        workload = shared_prefix(n, Poisson(rate), prompts, outputs, sharing, seed=seed)
    elif shape == 1:
        workload = ClosedLoop(draw(st.integers(1, 4)), n, prompt=prompts, output=outputs, seed=seed)
    else:
        workload = synthetic(n, Gamma(rate=rate, cv=2.0), prompts, outputs, seed=seed)
    options = PolicyOptions(
        max_model_len=8192,
        chunk_size=draw(st.sampled_from([None, 16, 64, 256])),
        max_num_seqs=draw(st.sampled_from([None, 4])),
        enable_prefix_caching=draw(st.booleans()),
    )
    policy = load_policy(draw(st.sampled_from(["sarathi", "vllm"])), options)
    if draw(st.booleans()):  # several prefills part-way at once
        policy = attrs.evolve(policy, chunker=LongPrefillThreshold(draw(st.sampled_from([32, 200])), 3, 2))
    scenario: dict[str, object] = {
        "workload": workload,
        "policy": policy,
        "deployment": Deployment(
            num_pages=draw(st.sampled_from([600, 1500, 5000])),
            max_model_len=8192,
            watermark=draw(st.sampled_from([0.0, 0.05])),
        ),
    }
    if draw(st.integers(0, 3)) == 0:
        scenario["disaggregation"] = Disaggregation(draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    elif draw(st.booleans()):
        scenario["replicas"] = 2
    return scenario


@given(chunked_scenarios())
@settings(deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow])
def test_fast_forward_through_prefill_chunks_gives_every_token_time_of_stepping(options: dict[str, object]) -> None:
    """Chunk runs (decodes beside ongoing prefill chunks, taken at once) time every token as stepping does."""
    fast = simulate(fast_forward=True, keep_requests=True, keep_gaps=True, **options)  # type: ignore[arg-type]
    slow = simulate(fast_forward=False, keep_requests=True, keep_gaps=True, **options)  # type: ignore[arg-type]
    assert fast.steps == slow.steps
    assert fast.prefix_cache == slow.prefix_cache
    assert token_gaps(fast) == token_gaps(slow)
    assert fast.metrics.requests is not None
    assert slow.metrics.requests is not None
    by_id = {r.request_id: r for r in slow.metrics.requests}
    assert len(by_id) == len(fast.metrics.requests)
    for record in fast.metrics.requests:
        twin = by_id[record.request_id]
        assert (record.ttft_s, record.e2el_s, record.output_len, record.num_preemptions) == (
            twin.ttft_s,
            twin.e2el_s,
            twin.output_len,
            twin.num_preemptions,
        )
        for phase, seconds in record.budget.as_dict().items():
            assert seconds == pytest.approx(twin.budget.as_dict()[phase], rel=1e-9, abs=1e-12), phase
    for key in ("failed", "completed", "total_input_tokens", "total_output_tokens"):
        assert fast.metrics[key] == slow.metrics[key], key


def test_prefill_steps_ending_together_send_their_kv_in_the_same_order_when_fast_forwarded() -> None:
    """Two prefill workers' steps end at one instant: their transfers start in worker order in both modes.

    A cut run's end is pushed again when it is cut, so push order put the other worker first;
    routing then sent r6 to another decode worker (28 steps against 27, e2el 26.2 ms against 21.8).
    """
    requests = [(0.0, 1, 1), (0.0, 2, 1), (0.0001, 2, 1), (0.0001, 190, 1), (0.0001, 133, 1), (0.0001, 1, 8)]
    requests += [(0.0135, 1, 3), (0.0135, 1, 4)]
    workload = Workload(
        "tie",
        arrival_s=[r[0] for r in requests],
        prompt_len=[r[1] for r in requests],
        output_len=[r[2] for r in requests],
    )
    policy = load_policy("sarathi", PolicyOptions(chunk_size=32, max_num_batched_tokens=96, max_num_seqs=3))
    fast, slow = assert_times_of_stepping(
        {
            "workload": workload,
            "policy": policy,
            "deployment": Deployment(page_size=4),
            "disaggregation": Disaggregation(2, 2),
        }
    )
    assert fast.fast_forwarded_steps > 0
    assert [w.steps for w in fast.workers] == [w.steps for w in slow.workers]


def test_decode_workers_take_long_runs_beside_each_other() -> None:
    """A decode worker's runs are cut only by KV delivered to it, not by the other's step ends or any transfer."""
    result = simulate(
        fixed(8, prompt_len=256, output_len=400, rate=100.0), load_policy("vllm"), disaggregation=Disaggregation(1, 2)
    )
    decode = [w for w in result.workers if w.role is Role.DECODE]
    assert [w.steps > 400 for w in decode] == [True, True]
    # Each worker's runs end where one of its own 4 requests lands or leaves (or its pricing ends).
    assert all(w.runs <= 12 for w in decode), [(w.steps, w.runs) for w in decode]


def test_one_workers_decode_runs_pass_finishes_when_nothing_waits() -> None:
    """Four requests served together take one run from their prefill to the last finish, timed as stepping times it."""
    workload = Workload("staggered", arrival_s=[0.0] * 4, prompt_len=[64] * 4, output_len=[50, 100, 150, 200])
    fast = simulate(workload, load_policy("vllm"), keep_requests=True, keep_gaps=True)
    slow = simulate(workload, load_policy("vllm"), keep_requests=True, keep_gaps=True, fast_forward=False)
    assert [(w.steps, w.runs) for w in fast.workers] == [(200, 2)]  # the admitting prefill step, then one run of 199
    assert fast.metrics.gaps is not None
    assert slow.metrics.gaps is not None
    assert fast.metrics.gaps.end_s.tolist() == slow.metrics.gaps.end_s.tolist()
    assert fast.metrics.requests is not None
    assert slow.metrics.requests is not None
    assert [r.e2el_s for r in fast.metrics.requests] == [r.e2el_s for r in slow.metrics.requests]
    assert fast.metrics["duration"] == slow.metrics["duration"]


def test_a_run_stopped_at_misses_stops_where_stepping_stops() -> None:
    """With a miss limit, a lone worker's runs stop at finishes again: the second miss ends the run at its finish."""
    workload = Workload(
        "staggered", arrival_s=[0.0] * 6 + [5.0], prompt_len=[64] * 7, output_len=[20, 40, 60, 80, 100, 120, 10]
    )
    runs = [
        simulate(
            workload, load_policy("vllm"), fast_forward=fast, tpot_slo_s=1e-6, stop_after_missed=1, keep_requests=True
        )
        for fast in (True, False)
    ]
    assert [(r.stopped_early, r.metrics["completed"], r.metrics["duration"]) for r in runs] == [
        (True, 2, runs[1].metrics["duration"])
    ] * 2
    progress: list[int] = []
    simulate(workload, load_policy("vllm"), progress=lambda done, _: progress.append(done))
    assert progress == sorted(progress)
    assert progress[-1] == 7  # reported at the end of each run, with every finish it passed


def test_replicas_take_long_runs_beside_each_other() -> None:
    """An arrival cuts only the run of the replica it is routed to, not every replica's."""
    result = simulate(fixed(40, prompt_len=256, output_len=400, rate=100.0), load_policy("vllm"), replicas=4)
    assert all(w.steps > 400 for w in result.workers)
    # Each replica's runs end where one of its own 10 requests arrives or finishes, and each of those
    # arrivals is admitted by a run of one step (cut by all 40 arrivals: 56+ runs).
    assert all(w.runs <= 35 for w in result.workers), [(w.steps, w.runs) for w in result.workers]


@st.composite
def several_worker_scenarios(draw: st.DrawFn) -> dict[str, object]:
    """Open loops over replicas or P:D pools whose KV fills: routing turns on pages taken mid-run, queues hold KV."""
    n = draw(st.integers(4, 40))
    workload = synthetic(
        n,
        Gamma(rate=draw(st.sampled_from([5.0, 50.0, 500.0])), cv=2.0),
        Uniform(1, draw(st.sampled_from([300, 1500]))),
        Uniform(1, draw(st.sampled_from([40, 200, 600]))),
        seed=draw(st.integers(0, 1000)),
    )
    options = PolicyOptions(
        max_model_len=4096,
        max_num_seqs=draw(st.sampled_from([None, 2, 4])),
        chunk_size=draw(st.sampled_from([None, 64])),
        enable_prefix_caching=draw(st.booleans()),
    )
    name = draw(st.sampled_from(["vllm", "sarathi", "sglang", "orca", "trtllm-equal-progress", "vllm-priority"]))
    scenario: dict[str, object] = {
        "workload": workload,
        "policy": load_policy(name, options),
        "deployment": Deployment(
            num_pages=draw(st.sampled_from([130, 200, 260, 5000])),
            max_model_len=4096,
            watermark=draw(st.sampled_from([0.0, 0.05])),
        ),
    }
    if draw(st.booleans()):
        scenario["disaggregation"] = Disaggregation(draw(st.integers(1, 2)), draw(st.integers(1, 3)))
    else:
        scenario["replicas"] = draw(st.integers(2, 5))
    return scenario


@given(several_worker_scenarios())
@settings(deadline=None, max_examples=80, suppress_health_check=[HealthCheck.too_slow])
def test_fast_forward_past_what_reaches_other_workers_gives_every_token_time_of_stepping(
    options: dict[str, object],
) -> None:
    """Runs that pass what reaches other workers, and are cut by what reaches theirs, time tokens as stepping does."""
    fast, slow = assert_times_of_stepping(options)
    assert fast.metrics["failed"] == slow.metrics["failed"]


def test_prefill_chunks_beside_decodes_are_fast_forwarded() -> None:
    """A 16K prompt chunked beside 4 decodes under sarathi is taken in runs, not asked of the policy step by step."""
    workload = mixed_load(num_short=4, short_prompt=256, short_output=300, long_prompt=16384, long_arrival_s=0.5)
    result = simulate(workload, load_policy("sarathi"))
    asked = result.steps - result.fast_forwarded_steps
    assert result.steps > 250  # 33 chunks of up to 508 tokens, and the decodes around them
    assert asked == 0  # the admissions begin runs too (one a step: each prompt fills a chunk)


def test_an_arrival_into_a_steady_batch_is_admitted_by_a_run() -> None:
    """Under sarathi, an arrival's admitting step and the chunks after it are one run, timed as stepping times it."""
    workload = Workload("arrivals", arrival_s=[0.0, 0.2, 0.4], prompt_len=[700, 1500, 300], output_len=[400, 300, 20])
    fast, _ = assert_times_of_stepping({"workload": workload, "policy": load_policy("sarathi")})
    assert fast.steps == fast.fast_forwarded_steps


def _stopped_early_both_ways(
    workload: Workload | ClosedLoop,
    policy: str = "orca",
    stop_after_missed: int = 1,
    *,
    caching: bool = False,
    **options: object,
) -> tuple[SimResult, SimResult]:
    """The run with fast-forward and stepping, held to one another where stepping leaves steps when it stops."""
    runs = [
        simulate(
            workload,
            load_policy(policy, PolicyOptions(max_model_len=8192, chunk_size=256, enable_prefix_caching=caching)),
            Deployment(hardware="A100-80GB", model="llama-3-70b", tensor_parallel=2, max_model_len=8192),
            fast_forward=fast,
            ttft_slo_s=0.05,
            tpot_slo_s=0.05,
            stop_after_missed=stop_after_missed,
            keep_requests=True,
            keep_gaps=True,
            **options,
        )
        for fast in (True, False)
    ]
    fast, slow = runs
    assert fast.stopped_early
    assert slow.stopped_early
    assert token_gaps(fast) == token_gaps(slow)  # in time order: workers log theirs by step or by run
    assert [w.steps for w in fast.workers] == [w.steps for w in slow.workers]
    busy = [w.busy_s for w in slow.workers]
    assert [w.busy_s for w in fast.workers] == pytest.approx(busy, rel=1e-12)  # a run adds its span: last bits differ
    assert fast.steps == slow.steps
    assert fast.prefix_cache == slow.prefix_cache
    assert _same_up_to_rounding(fast.metrics.values, slow.metrics.values)
    return fast, slow


def _hashed(arrival_s: list[float], prompt_len: list[int], output_len: list[int]) -> Workload:
    """A workload whose prompts carry page hashes (16-token blocks), none shared."""
    first = np.cumsum([0, *(-(-length // 16) for length in prompt_len)]).tolist()
    blocks = [list(range(start, end)) for start, end in itertools.pairwise(first)]
    return Workload(
        "hashed",
        arrival_s=arrival_s,
        prompt_len=prompt_len,
        output_len=output_len,
        blocks=BlockHashes.from_lists(16, blocks),
    )


class TestStoppedEarly:
    """A run stopped at a miss count records, and counts, the steps stepping would have by then."""

    def test_an_open_run_commits_the_steps_that_ended_before_the_stop(self) -> None:
        """Routed workers leave runs open: the stop commits those that ended, and counts the one in flight."""
        workload = Workload("late", arrival_s=[0.0, 0.1], prompt_len=[1, 1], output_len=[53, 1])
        fast, _ = _stopped_early_both_ways(workload, disaggregation=Disaggregation(1, 2))
        assert fast.metrics.gaps is not None
        assert len(fast.metrics.gaps.end_s) == 2  # the decodes that ended before the second miss
        assert any(w.runs for w in fast.workers)

    def test_a_cut_leaves_the_step_in_flight_to_be_recorded_when_it_ends(self) -> None:
        """Each rejected arrival cuts the decode run; the second is the stop, while a step is in flight.

        Committed at the cut, that step's token would be recorded at once, ahead of the stop.
        """
        workload = Workload("rejected", arrival_s=[0.0, 0.1, 0.2], prompt_len=[1, 9000, 9000], output_len=[148, 1, 1])
        fast, _ = _stopped_early_both_ways(workload)
        assert fast.metrics.gaps is not None
        assert len(fast.metrics.gaps.end_s) == 3
        assert fast.workers[0].runs

    def test_a_cut_chunk_run_records_its_step_in_flight_when_it_ends(self) -> None:
        """As above, in runs of prefill chunks beside a decode, cut two and three steps in.

        The first decode's late first token is a miss, each rejection another: the first cut's
        step in flight is recorded when it ends, the second's never (the stop comes first).
        """
        workload = Workload(
            "chunked", arrival_s=[0.0, 0.0, 0.3, 0.6], prompt_len=[1, 6000, 9000, 9000], output_len=[300, 20, 1, 1]
        )
        fast, _ = _stopped_early_both_ways(workload, "sarathi", stop_after_missed=2)
        assert fast.metrics.gaps is not None
        assert len(fast.metrics.gaps.end_s) == 6
        assert fast.workers[0].runs

    @pytest.mark.parametrize(("arrival", "registered"), [(0.02, 0), (0.3, 768)])
    def test_a_cut_step_in_flight_names_its_pages_only_when_it_ends(self, arrival: float, registered: int) -> None:
        """A rejected arrival cuts a prompt's chunk run and is the stop, while a chunk is in flight.

        Stepping names a chunk's pages when its step is updated, after the stop here: committed
        with the run at the cut, the chunk in flight's pages were counted as registered too (at
        0.3 s, after earlier chunks of the run had ended and named theirs).
        """
        workload = _hashed([0.0, arrival], [4000, 9000], [5, 1])
        fast, _ = _stopped_early_both_ways(workload, "vllm", stop_after_missed=0, caching=True)
        assert fast.prefix_cache.queried > 0
        assert fast.prefix_cache.registered == registered

    def test_the_stop_plans_an_open_runs_step_in_flight(self) -> None:
        """The first prompt's late first token stops the run while the second's first chunk is in flight elsewhere.

        Stepping planned that step, which looked the prompt's pages up and counted its duration
        as busy time; left uncommitted, the lookup went uncounted.
        """
        workload = _hashed([0.0, 0.6], [2000, 1000], [5, 5])
        fast, _ = _stopped_early_both_ways(workload, "vllm", stop_after_missed=0, caching=True, replicas=2)
        assert fast.prefix_cache.queried == (1999 // 16 + 999 // 16) * 16  # full pages before each last token
        assert fast.workers[1].steps == 1

    def test_a_closed_loop_records_nothing_past_the_stop(self) -> None:
        """A closed loop's runs would be committed at their start: under a miss limit they stay open instead."""
        loop = ClosedLoop(3, 12, prompt=Uniform(1, 8), output=Uniform(1, 60), seed=2)
        fast, _ = _stopped_early_both_ways(loop, disaggregation=Disaggregation(1, 2))
        assert fast.metrics.gaps is not None
        assert not len(fast.metrics.gaps.end_s)  # a decode run's first token would have come after the stop
