"""The prefix-cache experiment: the same policy with the cache on and off."""

from __future__ import annotations

import json

import pytest

from phasesched.experiments.context import ExperimentContext
from phasesched.experiments.prefix_cache import PrefixCacheResult
from phasesched.experiments.suite import EXPERIMENTS, SuiteOptions, run_experiment, shipped_trace

SYNTHETIC = "shared-prefix"


def test_cache_on_saves_prefill_and_off_saves_none() -> None:
    """With the cache on the shared system prompts hit and TTFT drops; off, nothing hits."""
    assert "prefix-cache" in EXPERIMENTS
    result = run_experiment("prefix-cache", ExperimentContext(), SuiteOptions(quick=True))
    on = [r for r in result.rows if r["cache"] == "on"]
    off = [r for r in result.rows if r["cache"] == "off"]
    assert on
    assert off
    assert all(r["hit_rate"] > 0 and r["prefill_saved_tokens"] > 0 for r in on)
    assert all(r["hit_rate"] > 0.3 for r in on if r["workload"].startswith(SYNTHETIC))
    assert all(r["hit_rate"] == 0 and r["prefill_saved_tokens"] == 0 for r in off)
    assert min(r["median_ttft_ms"] for r in on) < min(r["median_ttft_ms"] for r in off)
    data = result.to_dict()
    json.dumps(data)
    assert set(data["best_chunk"]) == {f"{r['workload']}/vllm/{r['cache']}" for r in result.rows}


def test_every_row_shows_its_best_chunk() -> None:
    """Each row carries the chunk size with the lowest p99 TTFT for its workload and cache, and the table shows it."""
    result = run_experiment("prefix-cache", ExperimentContext(), SuiteOptions(quick=True, default_trace=False))
    assert isinstance(result, PrefixCacheResult)
    assert "best_chunk" in [c.key for c in result.columns]
    for row in result.rows:
        group = [r for r in result.rows if (r["workload"], r["cache"]) == (row["workload"], row["cache"])]
        assert row["best_chunk"] == min(group, key=lambda r: r["p99_ttft_ms"])["chunk"]
        assert row["best_chunk"] == result.best_chunk[f"{row['workload']}/vllm/{row['cache']}"]


@pytest.mark.skipif(shipped_trace() is None, reason="data/traces is absent")
def test_the_shipped_mooncake_trace_is_served_by_default() -> None:
    """Given no trace it serves the chats and the shipped Mooncake trace; with that off, the chats alone."""
    default = run_experiment("prefix-cache", ExperimentContext(), SuiteOptions(quick=True, limit=8))
    alone = run_experiment("prefix-cache", ExperimentContext(), SuiteOptions(quick=True, default_trace=False))
    workloads = {r["workload"] for r in default.rows}
    assert "mooncake-conversation" in workloads
    assert any(w.startswith(SYNTHETIC) for w in workloads)
    assert {r["completed"] for r in default.rows if r["workload"] == "mooncake-conversation"} == {8}
    assert {r["workload"] for r in alone.rows} == workloads - {"mooncake-conversation"}
