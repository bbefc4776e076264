"""The prefix-cache experiment: the same policy with the cache on and off."""

from __future__ import annotations

import json

from phasesched.experiments.context import ExperimentContext
from phasesched.experiments.suite import EXPERIMENTS, SuiteOptions, run_experiment


def test_cache_on_saves_prefill_and_off_saves_none() -> None:
    """With the cache on the shared system prompts hit and TTFT drops; off, nothing hits."""
    assert "prefix-cache" in EXPERIMENTS
    result = run_experiment("prefix-cache", ExperimentContext(), SuiteOptions(quick=True))
    on = [r for r in result.rows if r["cache"] == "on"]
    off = [r for r in result.rows if r["cache"] == "off"]
    assert on
    assert off
    assert all(r["hit_rate"] > 0.3 and r["prefill_saved_tokens"] > 0 for r in on)
    assert all(r["hit_rate"] == 0 and r["prefill_saved_tokens"] == 0 for r in off)
    assert min(r["median_ttft_ms"] for r in on) < min(r["median_ttft_ms"] for r in off)
    data = result.to_dict()
    json.dumps(data)
    assert set(data["best_chunk"]) == {f"{r['workload']}/vllm/{r['cache']}" for r in result.rows}
