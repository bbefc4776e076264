"""The prefill and decode curves, checked against the cost model that prices their steps."""

from __future__ import annotations

import numpy as np
import pytest

from phasesched import UnknownNameError
from phasesched.experiments import (
    DecodeCurveConfig,
    ExperimentContext,
    PrefillCurveConfig,
    run_decode_curve,
    run_prefill_curve,
)
from phasesched.experiments.context import distinct_policies
from phasesched.sim import Deployment


def decode_step_ms(context: ExperimentContext, active: int, kv_len: int) -> float:
    cost = context.cost_model()
    return cost.step_time(np.ones(active, dtype=np.int64), np.full(active, kv_len, dtype=np.int64)) * 1e3


class TestPrefillCurve:
    def test_one_prompt_takes_one_prefill_step(self) -> None:
        """A lone prompt's TTFT is the cost model's time for its single prefill step."""
        context = ExperimentContext(policies=("no-chunk",))
        result = run_prefill_curve(context, PrefillCurveConfig((512, 4096), batch_size=1))
        for row in result.rows:
            n = row["prompt_len"]
            expected = context.cost_model().step_time(np.array([n]), np.array([n])) * 1e3
            assert row["mean_ttft_ms"] == pytest.approx(expected)
            assert row["first_ttft_ms"] == pytest.approx(expected)

    def test_rows_are_ordered_and_consistent(self) -> None:
        """One row per (policy, length); first <= mean <= last TTFT; throughput = batch tokens / last TTFT."""
        config = PrefillCurveConfig.quick()
        result = run_prefill_curve(ExperimentContext(policies=("vllm", "sarathi")), config)
        assert [(r["policy"], r["prompt_len"]) for r in result.rows] == [
            (p, n) for p in ("vllm", "sarathi") for n in config.prompt_lens
        ]
        for row in result.rows:
            assert row["first_ttft_ms"] <= row["mean_ttft_ms"] <= row["max_ttft_ms"]
            tokens = row["prompt_len"] * config.batch_size
            assert row["prefill_tok_s"] == pytest.approx(tokens / (row["max_ttft_ms"] / 1e3))
        by_len = [r["max_ttft_ms"] for r in result.rows if r["policy"] == "vllm"]
        assert by_len == sorted(by_len)

    def test_default_policy_and_to_dict(self) -> None:
        """Without policies it runs every registered one, less aliases; to_dict carries the config and the rows."""
        result = run_prefill_curve(ExperimentContext(), PrefillCurveConfig.quick())
        assert result.policies == distinct_policies()
        assert {"vllm", "sarathi", "sglang", "no-chunk"} <= set(result.policies)
        assert "orca" not in result.policies  # no-chunk's alias
        data = result.to_dict()
        assert data["experiment"] == "prefill_curve"
        assert data["config"]["batch_size"] == 2
        assert len(data["rows"]) == len(result.rows)

    def test_prompt_longer_than_the_context_is_refused(self) -> None:
        """A prompt past max_model_len is refused before anything runs."""
        context = ExperimentContext(Deployment(max_model_len=1024))
        with pytest.raises(ValueError, match="max_model_len"):
            run_prefill_curve(context, PrefillCurveConfig((512, 2048)))

    def test_unknown_policy(self) -> None:
        """An unknown policy name raises the registry's error, listing the known names."""
        with pytest.raises(UnknownNameError, match="vllm"):
            run_prefill_curve(ExperimentContext(policies=("nope",)), PrefillCurveConfig.quick())

    def test_progress_is_reported(self) -> None:
        """The hook hears every point, ending at total."""
        seen: list[tuple[str, int, int]] = []
        context = ExperimentContext(
            policies=("vllm",), progress=lambda task, done, total: seen.append((task, done, total))
        )
        run_prefill_curve(context, PrefillCurveConfig.quick())
        assert seen == [("prefill curve", 1, 2), ("prefill curve", 2, 2)]


class TestDecodeCurve:
    def test_itl_is_the_decode_step_of_n_sequences(self) -> None:
        """The steady ITL lies between the step times of n decodes at the first and last context."""
        context = ExperimentContext()
        config = DecodeCurveConfig(active=(1, 8, 64), prompt_len=512, output_len=32)
        result = run_decode_curve(context, config)
        for row in result.rows:
            n = row["active"]
            low = decode_step_ms(context, n, config.prompt_len + 1)
            high = decode_step_ms(context, n, config.prompt_len + config.output_len)
            assert low - 1e-9 <= row["mean_itl_ms"] <= high + 1e-9
            assert row["p99_itl_ms"] <= high + 1e-9
            assert row["steps"] > 0
            assert row["decode_tok_s"] == pytest.approx(n / (row["mean_itl_ms"] / 1e3))
        itls = [r["mean_itl_ms"] for r in result.rows]
        assert itls == sorted(itls)

    def test_sequence_cap_is_raised_to_n(self) -> None:
        """300 sequences really decode together although vllm caps sequences at 256 by default."""
        config = DecodeCurveConfig(active=(300,), prompt_len=64, output_len=16)
        (row,) = run_decode_curve(ExperimentContext(), config).rows
        assert row["steps"] > 0

    def test_prefill_is_excluded(self) -> None:
        """The p99 gap stays near the decode step although the batch's own prefill stalled early tokens."""
        context = ExperimentContext()
        config = DecodeCurveConfig(active=(64,), prompt_len=2048, output_len=64)
        (row,) = run_decode_curve(context, config).rows
        assert row["last_ttft_ms"] > 10 * row["p99_itl_ms"]  # prefill took many steps ...
        assert row["p99_itl_ms"] <= decode_step_ms(context, 64, 2048 + 64) + 1e-9  # ... none of them counted
