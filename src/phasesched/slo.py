"""Service-level objectives: parsing ``ttft=500ms,tpot=50ms,itl_p99=100ms`` and judging a run against them.

Two kinds of target, as the serving papers use them:

* **per-request** targets, ``ttft`` and ``tpot``: DistServe's definition. A request *attains*
  the SLO when it meets every per-request target; *attainment* is the share of requests that
  do, and *goodput* the rate of those requests (per GPU when divided by the GPUs used);
* **run-level** percentile targets, ``<metric>_p<N>`` or ``<metric>_mean`` for ``ttft``,
  ``tpot``, ``itl`` or ``e2el`` with ``N`` one of 50, 90, 95, 99: the run's distribution must
  meet them (a token gap belongs to no single request, so ``itl_p99`` can only be judged on
  the run).

A run *meets* the SLO when its attainment reaches the target share (``attainment=0.9``,
default 90%) and every run-level target holds.

>>> slo = SLO.parse("ttft=500ms,tpot=50ms,itl_p99=0.1s")
>>> slo.ttft_s, slo.tpot_s, slo.run_targets_ms
(0.5, 0.05, (('p99_itl_ms', 100.0),))
>>> slo.describe()
'TTFT <= 500 ms, TPOT <= 50 ms per request for 90% of requests; p99 ITL <= 100 ms'
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

import attrs

from phasesched.errors import InvalidArgumentError

__all__ = ["SLO", "SLOVerdict", "parse_duration_s"]

_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e-?[0-9]+)?)\s*(us|ms|s)?\s*$")
_RUN_KEY = re.compile(r"^(ttft|tpot|itl|e2el)_(mean|p50|p90|p95|p99)$")
_SLACK = 1e-12
"""Attainment within this of the target counts as meeting it (``good / total`` is a float)."""
_STAT_PREFIX = {"mean": "mean", "p50": "median", "p90": "p90", "p95": "p95", "p99": "p99"}


def parse_duration_s(text: str) -> float:
    """``"500ms"``, ``"0.5s"``, ``"800us"`` (or a bare number of seconds) as seconds.

    Raises:
        InvalidArgumentError: Not a non-negative duration.

    >>> parse_duration_s("250ms"), parse_duration_s("2")
    (0.25, 2.0)
    """
    match = _DURATION.match(text)
    if match is None:
        msg = f"expected a duration such as 500ms, 0.5s or 800us, got {text!r}"
        raise InvalidArgumentError(msg)
    return float(match.group(1)) * _UNITS[match.group(2) or "s"]


def _share(text: str) -> float:
    value = float(text.rstrip("%")) / (100 if text.endswith("%") else 1)
    if not 0 < value <= 1:
        msg = f"attainment must be in (0, 1] or (0%, 100%], got {text!r}"
        raise InvalidArgumentError(msg)
    return value


@attrs.frozen
class SLOVerdict:
    """How one run fares against an :class:`SLO`.

    Attributes:
        attainment: Share of requests meeting every per-request target (1.0 when there is none).
        meets: Attainment reaches the target and every run-level target holds.
        misses: The run-level targets missed, as ``"p99 ITL 130.2 ms > 100 ms"``.
    """

    attainment: float
    meets: bool
    misses: tuple[str, ...] = ()


@attrs.frozen
class SLO:
    """Latency targets and the share of requests that must meet them.

    Attributes:
        ttft_s: Per-request time-to-first-token target, seconds.
        tpot_s: Per-request time-per-output-token target, seconds.
        run_targets_ms: Run-level targets as ``(results key, ms)``, e.g. ``("p99_itl_ms", 100.0)``.
        attainment: The share of requests that must meet the per-request targets.
    """

    ttft_s: float | None = None
    tpot_s: float | None = None
    run_targets_ms: tuple[tuple[str, float], ...] = ()
    attainment: float = attrs.field(default=0.9, validator=[attrs.validators.gt(0.0), attrs.validators.le(1.0)])

    @classmethod
    def parse(cls, text: str) -> SLO:
        """Read ``key=value`` pairs separated by commas (see the module docstring).

        Raises:
            InvalidArgumentError: An unknown key, a malformed value, or no target at all.
        """
        fields: dict[str, object] = {}
        run: list[tuple[str, float]] = []
        for pair in (p.strip() for p in text.split(",") if p.strip()):
            key, sep, value = pair.partition("=")
            key = key.strip().lower()
            if not sep:
                msg = f"SLO targets are key=value pairs, got {pair!r}"
                raise InvalidArgumentError(msg)
            if key in {"ttft", "tpot"}:
                fields[f"{key}_s"] = parse_duration_s(value)
            elif key == "attainment":
                fields["attainment"] = _share(value.strip())
            elif match := _RUN_KEY.match(key):
                run.append((f"{_STAT_PREFIX[match.group(2)]}_{match.group(1)}_ms", parse_duration_s(value) * 1e3))
            else:
                known = "ttft, tpot, attainment, <ttft|tpot|itl|e2el>_<mean|p50|p90|p95|p99>"
                msg = f"unknown SLO target {key!r}; known: {known}"
                raise InvalidArgumentError(msg)
        slo = cls(run_targets_ms=tuple(run), **fields)  # type: ignore[arg-type]
        if not slo.has_targets:
            msg = f"an SLO needs at least one latency target, got {text!r}"
            raise InvalidArgumentError(msg)
        return slo

    @property
    def has_targets(self) -> bool:
        """Whether any latency target is set."""
        return self.ttft_s is not None or self.tpot_s is not None or bool(self.run_targets_ms)

    def judge(self, values: Mapping[str, float]) -> SLOVerdict:
        """Judge a run from its results (``completed``, ``request_goodput`` and the latency keys).

        ``request_goodput`` must have been counted against ``ttft_s`` and ``tpot_s``
        (the simulator does, given them).
        """
        completed = values.get("completed", 0)
        good = values.get("request_goodput", 0.0) / values["request_throughput"] if completed else 0.0
        attained = good if (self.ttft_s is not None or self.tpot_s is not None) else 1.0
        failed = values.get("failed", 0)
        if failed:  # rejected requests count as missing the SLO
            attained *= completed / (completed + failed)
        misses = tuple(
            f"{_label(key)} {values[key]:.1f} ms > {target:g} ms"
            for key, target in self.run_targets_ms
            if not values.get(key, math.nan) <= target
        )
        return SLOVerdict(attained, attained >= self.attainment - _SLACK and not misses, misses)

    def max_misses(self, total: int) -> int | None:
        """The most of ``total`` requests that may miss the per-request targets (or fail) with the SLO still met.

        A run whose misses pass this can stop: nothing it does later brings it back.
        ``None`` when there is no per-request target to miss.

        >>> SLO(ttft_s=1.0).max_misses(1000), SLO(ttft_s=1.0, attainment=1.0).max_misses(7)
        (100, 0)
        """
        if self.ttft_s is None and self.tpot_s is None:
            return None
        misses = math.floor((1.0 - self.attainment) * total)
        # The float product may land a request either side: settle it with the test judge() applies.
        while misses < total and self._attained(total - misses - 1, total):
            misses += 1
        while misses > 0 and not self._attained(total - misses, total):
            misses -= 1
        return misses

    def _attained(self, good: int, total: int) -> bool:
        return good / total >= self.attainment - _SLACK

    def describe(self) -> str:
        """The targets in words."""
        per_request = [f"{name} <= {v * 1e3:g} ms" for name, v in (("TTFT", self.ttft_s), ("TPOT", self.tpot_s)) if v]
        parts = []
        if per_request:
            parts.append(f"{', '.join(per_request)} per request for {self.attainment:.0%} of requests")
        parts += [f"{_label(key)} <= {target:g} ms" for key, target in self.run_targets_ms]
        return "; ".join(parts)

    def to_dict(self) -> dict[str, object]:
        """The targets, JSON-ready, in milliseconds."""
        return {
            "ttft_ms": None if self.ttft_s is None else self.ttft_s * 1e3,
            "tpot_ms": None if self.tpot_s is None else self.tpot_s * 1e3,
            **dict(self.run_targets_ms),
            "attainment": self.attainment,
        }


def _label(key: str) -> str:
    """``"p99_itl_ms"`` as ``"p99 ITL"``."""
    stat, metric, _ = key.split("_")
    return f"{stat} {metric.upper()}"
