"""Simulations far from t = 0: they finish with the latencies they have near 0, or refuse with a typed error."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phasesched import load_policy
from phasesched.sim import Disaggregation, KVLink, SimResult, SimulationError, Simulator, Workload, fixed, simulate
from phasesched.sim.guards import MAX_CLOCK_S, STALL_EVENTS, Watchdog, check_clock


def shifted(workload: Workload, offset_s: float) -> Workload:
    """``workload`` with every arrival ``offset_s`` later."""
    return Workload(workload.name, workload.arrival_s + offset_s, workload.prompt_len, workload.output_len)


def disaggregated(workload: Workload) -> SimResult:
    """``workload`` on one prefill and one decode worker joined by the default link."""
    return simulate(workload, load_policy("vllm"), disaggregation=Disaggregation(1, 1), keep_requests=True)


class TestKVLinkFarFromZero:
    """The link's next event always moves time on, and at that time the transfer it names is done."""

    def test_a_sub_resolution_remainder_still_finishes(self) -> None:
        """At t = 40,000 s a tenth of a byte left takes less than the clock resolves: it lands, not loops."""
        link = KVLink(bandwidth_bytes_per_s=50e9)
        link.start("a", 0.1, now=40_000.0)  # 2 ps of bytes; the clock's step there is 7.3 ps
        done = link.next_done()
        assert done > 40_000.0
        assert link.pop_done(done) == [("a", done)]
        assert link.active == 0

    @given(
        start=st.floats(0.0, MAX_CLOCK_S),
        sizes=st.lists(st.floats(0.0, 1e10), min_size=1, max_size=6),
        bandwidth=st.floats(1e3, 1e12),
    )
    @settings(max_examples=300)
    def test_transfers_drain_in_strictly_later_events(self, start: float, sizes: list[float], bandwidth: float) -> None:
        """Driven as the event loop drives it, the link empties in few events, each later than the last."""
        link = KVLink(bandwidth_bytes_per_s=bandwidth)
        for i, size in enumerate(sizes):
            link.start(str(i), size, now=start)
        now, events = start, 0
        while link.active:
            later = link.next_done()
            assert later > now
            now = later
            link.pop_done(now)
            events += 1
            assert events <= 3 * len(sizes)


class TestFarFromZero:
    """A run's latencies do not depend on when it starts, up to the clock's limit; past it, a typed error."""

    def test_tiny_rate_disaggregated_run_finishes(self) -> None:
        """`bench phase-split --rate 0.002`'s livelock: 20 requests 500 s apart all finish, each with the lone TTFT."""
        alone = disaggregated(fixed(1, 2048, 64)).metrics["mean_ttft_ms"]
        result = disaggregated(fixed(20, 2048, 64, rate=0.002))
        assert result.metrics["completed"] == 20
        assert result.metrics.requests is not None
        ttfts = [r.ttft_s * 1e3 for r in result.metrics.requests]
        assert ttfts == pytest.approx([alone] * 20, rel=1e-6)

    @pytest.mark.parametrize("offset_s", [4e4, 1e6, 1e9])
    @pytest.mark.parametrize("split", [False, True])
    def test_latencies_do_not_depend_on_the_start(self, offset_s: float, split: bool) -> None:
        """The same workload started 11 hours, 12 days or 32 years in gives the same latencies to a microsecond."""
        workload = fixed(6, 1500, 40, rate=3.0)
        options = {"disaggregation": Disaggregation(1, 1)} if split else {}
        near = simulate(workload, load_policy("vllm"), **options).metrics  # type: ignore[arg-type]
        far = simulate(shifted(workload, offset_s), load_policy("vllm"), **options).metrics  # type: ignore[arg-type]
        assert far["completed"] == near["completed"] == 6
        for key in ("mean_ttft_ms", "p99_ttft_ms", "mean_itl_ms", "mean_e2el_ms"):
            assert far[key] == pytest.approx(near[key], abs=1e-3)
            assert far[key] > 0

    @pytest.mark.parametrize("split", [False, True])
    def test_huge_times_are_refused(self, split: bool) -> None:
        """Arrivals at 1e20 s, where a step rounds away and TTFT would read 0, raise SimulationError."""
        workload = shifted(fixed(3, 512, 8), 1e20)
        options = {"disaggregation": Disaggregation(1, 1)} if split else {}
        with pytest.raises(SimulationError, match="no longer resolve 1 µs"):
            simulate(workload, load_policy("vllm"), **options)  # type: ignore[arg-type]

    def test_the_limit_itself_is_accepted(self) -> None:
        """A request arriving at the last allowed instant is simulated; one just past it is not."""
        check_clock(MAX_CLOCK_S)
        with pytest.raises(SimulationError):
            check_clock(math.nextafter(MAX_CLOCK_S, math.inf))
        result = simulate(Workload("edge", np.array([MAX_CLOCK_S - 10.0]), [256], [4]), load_policy("vllm"))
        assert result.metrics["completed"] == 1


class TestWatchdog:
    """A simulation ends or raises: events that change nothing are caught, not looped on."""

    def test_a_stuck_link_raises_instead_of_spinning(self) -> None:
        """A link whose next event never moves time nor lands anything stops the run with SimulationError."""

        class StuckLink(KVLink):
            def next_done(self) -> float:
                return self._clock if self.active else math.inf

        simulator = Simulator(fixed(2, 512, 4), load_policy("vllm"), disaggregation=Disaggregation(1, 1))
        simulator.link = StuckLink(50e9)
        with pytest.raises(SimulationError, match=f"no progress in {STALL_EVENTS} events"):
            simulator.run()

    def test_events_that_change_something_are_not_counted(self) -> None:
        """Many events at one instant are fine while each changes the state (zero-duration steps, bursts)."""
        dog = Watchdog(limit=3)
        for progress in range(100):
            dog.event(5.0, progress)
        for now in range(100):
            dog.event(float(now), 7)
        dog.event(99.0, 7)
        dog.event(99.0, 7)
        with pytest.raises(SimulationError):
            dog.event(99.0, 7)
