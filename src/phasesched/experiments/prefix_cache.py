"""Prefix caching on and off: hit rate, TTFT and prefill saved, and how the best chunk size moves.

One policy (``vllm`` unless the context names others) serves each workload with prefix caching on
and off, at several chunk sizes: a synthetic chat workload whose sessions share a system prompt,
and a trace with block hashes (Mooncake's ``hash_ids``): ``phasesched bench prefix-cache`` serves
the Mooncake conversation trace a checkout ships unless ``--trace`` names another. Everything but the cache
and the chunk is held constant, so the differences are the cache's.
"""

from __future__ import annotations

import time
from typing import Any

import attrs

from phasesched.experiments.context import Column, ExperimentContext, Row, json_object
from phasesched.sim.arrivals import Poisson
from phasesched.sim.lengths import LogNormal
from phasesched.sim.shared_prefix import SharedPrefixes, shared_prefix
from phasesched.sim.simulator import simulate
from phasesched.sim.workload import Workload

__all__ = ["PrefixCacheConfig", "PrefixCacheResult", "run_prefix_cache"]


@attrs.frozen(eq=False)
class PrefixCacheConfig:
    """What the comparison serves.

    Attributes:
        sessions: Chat sessions of the synthetic workload (3 turns each, 70% share one of four
            2048-token system prompts).
        rate: Sessions starting per second.
        chunk_sizes: Chunk sizes (and token budgets) compared.
        trace: A block-hashed trace to serve too (its first ``trace_limit`` requests).
        trace_limit: Requests of the trace served.
    """

    sessions: int = 200
    rate: float = 4.0
    chunk_sizes: tuple[int, ...] = (512, 2048, 8192)
    trace: Workload | None = None
    trace_limit: int = 1000

    @classmethod
    def quick(cls) -> PrefixCacheConfig:
        """Tiny sizes, for tests."""
        return cls(sessions=12, chunk_sizes=(512, 2048), trace_limit=24)

    def workloads(self, seed: int) -> list[Workload]:
        """The synthetic workload, then the trace's head if there is a trace."""
        sharing = SharedPrefixes(system_prompt=2048, num_system_prompts=4, share=0.7, turns=3, think_s=20.0)
        chat = shared_prefix(
            self.sessions, Poisson(self.rate), LogNormal(256, 0.8), LogNormal(200, 0.6), sharing, seed=seed
        )
        return [chat] + ([self.trace.head(self.trace_limit)] if self.trace is not None else [])


@attrs.frozen(eq=False)
class PrefixCacheResult:
    """One row per (workload, policy, cache, chunk size); ``best_chunk`` per (workload, policy, cache).

    Each row also carries its group's ``best_chunk``, so the table shows how the cache moves it.

    Attributes:
        config: What was served.
        rows: The measured points.
        best_chunk: ``"workload/policy/cache"`` to the chunk size with the lowest p99 TTFT.
        wall_s: Seconds the experiment took.
    """

    config: PrefixCacheConfig
    rows: tuple[Row, ...]
    best_chunk: dict[str, int]
    wall_s: float
    name: str = "prefix_cache"

    @property
    def title(self) -> str:
        """The table heading."""
        return "Prefix caching on vs off"

    @property
    def columns(self) -> tuple[Column, ...]:
        """The terminal table's columns."""
        return (
            Column("workload", "workload"),
            Column("policy", "policy"),
            Column("cache", "cache"),
            Column("chunk", "chunk", ",d"),
            Column("hit_rate", "hit rate", ".3f"),
            Column("prefill_saved_tokens", "prefill saved", ",d"),
            Column("median_ttft_ms", "p50 TTFT ms"),
            Column("p99_ttft_ms", "p99 TTFT ms"),
            Column("best_chunk", "best chunk", ",d"),
        )

    def to_dict(self) -> dict[str, Any]:
        """Rows and best chunk sizes, JSON-ready."""
        return json_object({"experiment": self.name, "rows": self.rows, "best_chunk": self.best_chunk})


def run_prefix_cache(context: ExperimentContext, config: PrefixCacheConfig | None = None) -> PrefixCacheResult:
    """Serve each workload with each policy, cache on and off, at each chunk size."""
    config = config or PrefixCacheConfig()
    started = time.perf_counter()
    rows: list[Row] = []
    max_len = context.deployment.max_model_len - 1
    for workload in (w.clip_lengths(max_prompt=max_len) for w in config.workloads(context.seed)):
        for name in context.policy_names(("vllm",)):
            for cache in (False, True):
                for chunk in config.chunk_sizes:
                    policy = context.load(
                        name, enable_prefix_caching=cache, chunk_size=chunk, max_num_batched_tokens=chunk
                    )
                    result = simulate(workload, policy, context.deployment)
                    rows.append(_row(workload.name, name, chunk, cache=cache, result=result))
    best: dict[str, int] = {}
    for row in sorted(rows, key=lambda r: (r["p99_ttft_ms"] is None, r["p99_ttft_ms"])):
        best.setdefault(_group(row), row["chunk"])
    rows = [{**row, "best_chunk": best[_group(row)]} for row in rows]
    return PrefixCacheResult(config, tuple(rows), best, time.perf_counter() - started)


def _group(row: Row) -> str:
    """The ``best_chunk`` key of a row: its workload, policy and cache setting."""
    return f"{row['workload']}/{row['policy']}/{row['cache']}"


def _row(workload: str, policy: str, chunk: int, *, cache: bool, result: Any) -> Row:
    metrics = result.metrics
    return {
        "workload": workload,
        "policy": policy,
        "cache": "on" if cache else "off",
        "chunk": chunk,
        "hit_rate": result.prefix_cache.hit_rate,
        "prefill_saved_tokens": result.prefix_cache.hits,
        "median_ttft_ms": metrics["median_ttft_ms"],
        "p99_ttft_ms": metrics["p99_ttft_ms"],
        "completed": metrics["completed"],
    }
