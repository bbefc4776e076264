"""The prefill curve: time to first token and prefill throughput against prompt length."""

from __future__ import annotations

import operator
import time
from typing import Any

import attrs

from phasesched.errors import InvalidArgumentError
from phasesched.experiments.context import Column, ExperimentContext, Row, json_object, ms
from phasesched.sim.builders import fixed
from phasesched.sim.simulator import simulate
from phasesched.validators import typed

__all__ = ["PrefillCurveConfig", "PrefillCurveResult", "run_prefill_curve"]


def _lengths(values: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(operator.index(v) for v in values)


@attrs.frozen
class PrefillCurveConfig:
    """Sizes of the prefill curve.

    Attributes:
        prompt_lens: Prompt lengths measured, 128 to 32K by default (powers of two).
        batch_size: Same-length prompts arriving together at each point (8: already enough
            tokens per step to make prefill compute-bound on any preset GPU, and 8 x 32K
            tokens of KV fit beside Llama-3-8B on one H200).
    """

    prompt_lens: tuple[int, ...] = attrs.field(
        default=(128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768), converter=_lengths
    )
    batch_size: int = attrs.field(default=8, validator=typed(attrs.validators.gt(0)))

    @classmethod
    def quick(cls) -> PrefillCurveConfig:
        """A tiny curve for tests."""
        return cls(prompt_lens=(128, 2048), batch_size=2)


@attrs.frozen(eq=False)
class PrefillCurveResult:
    """Per policy and prompt length: TTFT (first, mean, last of the batch) and prefill tokens/s.

    Attributes:
        config: The sizes used.
        policies: Policy names, in row order.
        rows: One per ``(policy, prompt_len)``.
        wall_s: Seconds the experiment took.
    """

    config: PrefillCurveConfig
    policies: tuple[str, ...]
    rows: tuple[Row, ...]
    wall_s: float
    name: str = "prefill_curve"
    title: str = "Prefill curve: TTFT vs prompt length (a batch of same-length prompts at t=0, one output token)"

    @property
    def columns(self) -> tuple[Column, ...]:
        """The terminal table's columns."""
        return (
            Column("policy", "policy"),
            Column("prompt_len", "prompt", ",d"),
            Column("batch", "batch", "d"),
            Column("first_ttft_ms", "first TTFT ms"),
            Column("mean_ttft_ms", "mean TTFT ms"),
            Column("max_ttft_ms", "last TTFT ms"),
            Column("prefill_tok_s", "prefill tok/s", ",.0f"),
        )

    def to_dict(self) -> dict[str, Any]:
        """Config and rows, JSON-ready."""
        return json_object({"experiment": self.name, "config": attrs.asdict(self.config), "rows": self.rows})


def run_prefill_curve(context: ExperimentContext, config: PrefillCurveConfig | None = None) -> PrefillCurveResult:
    """Measure TTFT and prefill throughput at each prompt length.

    Holds constant: the deployment, the policy, the batch (``batch_size`` prompts of one length,
    all arriving at t=0) and the output (one token, so a request ends at its first token and no
    decode competes with the prefill). Only the prompt length varies. "First TTFT" is the
    fastest request of the batch (the first step that completes a prompt; under a shared token
    budget that step also carries other prompts' tokens), "last TTFT" the batch's completion, and
    prefill tokens/s the batch's prompt tokens over that time: how prefill cost grows with length
    (attention is quadratic) and where the GPU saturates.

    Args:
        context: Deployment, policies (default: every registered one, less aliases), seed and progress.
        config: Sizes; :class:`PrefillCurveConfig` defaults when omitted.

    Raises:
        InvalidArgumentError: A prompt length exceeds the deployment's ``max_model_len``.

    >>> result = run_prefill_curve(ExperimentContext(), PrefillCurveConfig((1024,), batch_size=1))
    >>> round(result.rows[0]["mean_ttft_ms"])    # one 1K prompt on H200 + Llama-3-8B
    22
    """
    config = config or PrefillCurveConfig()
    too_long = [n for n in config.prompt_lens if n > context.deployment.max_model_len]
    if too_long:
        msg = f"prompt lengths {too_long} exceed max_model_len={context.deployment.max_model_len}"
        raise InvalidArgumentError(msg)
    started = time.perf_counter()
    policies = context.policy_names()
    detached = context.detached()
    tasks = [(detached, name, n, config.batch_size) for name in policies for n in config.prompt_lens]
    rows = context.map("prefill curve", _point, tasks, costs=[n for _, _, n, _ in tasks])
    return PrefillCurveResult(config, policies, tuple(rows), time.perf_counter() - started)


def _point(context: ExperimentContext, name: str, prompt_len: int, batch_size: int) -> Row:
    """One policy at one prompt length (a task for :meth:`ExperimentContext.map`)."""
    metrics = simulate(fixed(batch_size, prompt_len, 1), context.load(name), context.deployment).metrics
    return {
        "policy": name,
        "prompt_len": prompt_len,
        "batch": batch_size,
        "first_ttft_ms": ms(metrics.distributions["ttft"].min),
        "mean_ttft_ms": metrics["mean_ttft_ms"],
        "max_ttft_ms": metrics["max_ttft_ms"],
        "prefill_tok_s": metrics["input_throughput"],
    }
