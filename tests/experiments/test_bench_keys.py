"""Experiment rows carry `vllm bench serve`'s result keys, so a consumer of its JSON can read them."""

from __future__ import annotations

from phasesched.experiments import (
    ExperimentContext,
    GridConfig,
    PhaseSplitConfig,
    ReplayConfig,
    run_grid,
    run_phase_split,
    run_replay,
)
from phasesched.experiments.bench_keys import VLLM_BENCH_KEYS
from phasesched.sim import fixed

# What a dashboard built on `vllm bench serve --save-result --metric-percentiles 90,95,99` reads.
CONSUMER_KEYS = {
    "duration",
    "completed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    *(f"{stat}_{name}_ms" for name in ("ttft", "tpot", "itl", "e2el") for stat in ("mean", "median", "std", "p99")),
}
CONTEXT = ExperimentContext(policies=("vllm",))


class TestVllmBenchKeys:
    def test_the_key_set_covers_the_consumer(self) -> None:
        """VLLM_BENCH_KEYS holds every key the consumer reads, with p90 and p95 besides."""
        assert set(VLLM_BENCH_KEYS) >= CONSUMER_KEYS
        assert {"p90_itl_ms", "p95_e2el_ms"} <= set(VLLM_BENCH_KEYS)

    def test_grid_rows(self) -> None:
        """Grid rows (closed loop, no SLO) carry the keys and no goodput."""
        for row in run_grid(CONTEXT, GridConfig.quick()).rows:
            assert row.keys() >= CONSUMER_KEYS
            assert "request_goodput" not in row

    def test_phase_split_rows(self) -> None:
        """Phase split rows carry the keys and goodput (it is judged against its SLO)."""
        for row in run_phase_split(CONTEXT, PhaseSplitConfig.quick()).rows:
            assert CONSUMER_KEYS | {"request_goodput"} <= row.keys()

    def test_replay_rows_goodput_only_with_an_slo(self) -> None:
        """Replay rows carry the keys; request_goodput only when the replay has an SLO."""
        trace = fixed(12, 256, 16, rate=4.0)
        (plain,) = run_replay(CONTEXT, ReplayConfig(trace)).rows
        (judged,) = run_replay(CONTEXT, ReplayConfig(trace, ttft_slo_s=0.5)).rows
        assert plain.keys() >= CONSUMER_KEYS
        assert "request_goodput" not in plain
        assert "request_goodput" in judged
