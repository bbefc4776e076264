"""A real P/D run next to the simulator's prediction for the same requests: TTFT component by component.

TTFT is split into the phases the simulator charges (:data:`phasesched.metrics.recorder.BUDGET_PHASES`):

* ``queue``: arrival to the prompt's first step on the prefill worker;
* ``prefill``: that step to the prompt's last (interference between chunks included);
* ``transfer``: the pull, from the decode worker's request to the pages in place (runtime),
  the KV link's time (simulator);
* ``first_decode``: the rest of TTFT: waiting for the decode side's admission and its first step.

The simulator is given a cost model profiled on this machine with the same executor and the
link's bandwidth and latency fitted to raw ``torch.distributed`` send/recv samples.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import torch

from phasesched.costmodel.profiled import ProfiledCostModel
from phasesched.costmodel.profiling import ProfileGrid, Profiler
from phasesched.sim import simulate
from phasesched.sim.deployment import Deployment, Disaggregation
from phasesched.sim.workload import Workload
from phasesched_torch._executor import create_executor
from phasesched_torch._pd import PDRunConfig, PDRunResult
from phasesched_torch._pd_link import LinkFit

__all__ = ["COMPONENTS", "measured_components", "profile_cost_model", "simulated_components", "summarize_errors"]

COMPONENTS = ("queue", "prefill", "transfer", "first_decode", "ttft")
"""The TTFT components compared, in order, and TTFT itself."""


@attrs.frozen
class _KVDeployment(Deployment):
    """A deployment whose KV bytes per token are given (the torch presets are not cost-model presets)."""

    bytes_per_token: int = 0

    def kv_bytes_per_token(self) -> int:
        return self.bytes_per_token


def kv_bytes_per_token(config: PDRunConfig) -> int:
    """KV bytes of one token across the model, as the runtime's pages hold them."""
    model = create_executor(model=config.model, num_pages=1, page_size=config.page_size).model
    per_page = sum(layer[0].numel() * layer.element_size() for layer in model.new_kv_cache(1, config.page_size))
    return per_page // config.page_size


def profile_cost_model(config: PDRunConfig, grid: ProfileGrid, repeats: int = 5) -> ProfiledCostModel:
    """Profile the run's executor on this machine (the library's profiler) and build the simulator's cost model.

    Profiled on one thread, as the runtime's workers run (``OMP_NUM_THREADS=1``).
    """
    num_pages = max(grid.max_pages(config.page_size), 8)
    executor = create_executor(model=config.model, num_pages=num_pages, page_size=config.page_size, seed=config.seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    profiler = Profiler(executor, num_pages=num_pages, page_size=config.page_size, grid=grid)
    try:
        profiler.run_pass(repeats=repeats, warmup=1)
    finally:
        torch.set_num_threads(threads)
    return profiler.cost_model()  # reads decodes as the executor batches them


def measured_components(result: PDRunResult) -> dict[str, dict[str, float]]:
    """Per finished request, its measured TTFT components in seconds."""
    out = {}
    for request_id, r in result.requests.items():
        if r["state"] != "finished" or r["pull_start"] is None:
            continue
        transfer = r["pull_end"] - r["pull_start"]
        out[request_id] = {
            "queue": r["prefill_start"] - r["arrival"],
            "prefill": r["prefill_end"] - r["prefill_start"],
            "transfer": transfer,
            "first_decode": r["first_token"] - r["prefill_end"] - transfer,
            "ttft": r["first_token"] - r["arrival"],
        }
    return out


def simulated_components(
    config: PDRunConfig, cost_model: ProfiledCostModel, link: LinkFit, bytes_per_token: int
) -> dict[str, dict[str, float]]:
    """Per request, the simulator's TTFT components for the same requests on a 1P:1D split."""
    specs = config.requests
    order = np.argsort([s.arrival_time for s in specs], kind="stable")
    workload = Workload(
        "pd-run",
        arrival_s=[specs[i].arrival_time for i in order],
        prompt_len=[specs[i].prompt_len for i in order],
        output_len=[specs[i].max_new_tokens for i in order],
    )
    deployment = _KVDeployment(
        cost_model=cost_model,
        num_pages=min(config.prefill_pages, config.decode_pages),
        page_size=config.page_size,
        bytes_per_token=bytes_per_token,
    )
    disaggregation = Disaggregation(
        config.num_prefill,
        config.num_decode,
        link_bandwidth_gbs=link.bandwidth_bytes_per_s / 1e9,
        link_latency_s=link.latency_s,
    )
    result = simulate(
        workload, config.policy(), deployment, disaggregation=disaggregation, keep_requests=True, fast_forward=False
    )
    records = result.metrics.requests or ()
    out = {}
    for record in records:
        b = record.budget
        original = f"r{int(order[int(record.request_id[1:])])}"  # the workload numbers requests in arrival order
        out[original] = {
            "queue": b.queue_s,
            "prefill": b.prefill_s + b.interference_s,
            "transfer": b.transfer_s,
            "first_decode": b.first_decode_s,
            "ttft": record.ttft_s,
        }
    return out


def summarize_errors(
    measured: Mapping[str, Mapping[str, float]], simulated: Mapping[str, Mapping[str, float]]
) -> list[dict[str, Any]]:
    """Per component: mean measured and simulated milliseconds, and the simulator's error of the mean."""
    rows = []
    common: Sequence[str] = sorted(set(measured) & set(simulated))
    for component in COMPONENTS:
        real = float(np.mean([measured[r][component] for r in common])) * 1e3
        sim = float(np.mean([simulated[r][component] for r in common])) * 1e3
        error = (sim - real) / real * 100 if real > 0 else float("nan")
        rows.append({"component": component, "measured_ms": real, "simulated_ms": sim, "error_pct": error})
    return rows
