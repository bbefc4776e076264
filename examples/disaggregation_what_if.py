"""Aggregated or disaggregated? The same two GPUs, at several KV-link bandwidths.

Two H200s serve Llama-3-8B either as two aggregated replicas (each prefills and decodes) or as
one prefill and one decode worker joined by a link whose bandwidth varies. The workload has the
Azure conversation trace's prompt and output lengths with Poisson arrivals. Disaggregation
removes prefill/decode interference (smooth token gaps) but adds a KV transfer to every TTFT and
halves the prefill capacity; the table shows where that trade pays.

    python examples/disaggregation_what_if.py --rate 8 --requests 1500
"""

from __future__ import annotations

import argparse
from pathlib import Path

from phasesched import load_policy
from phasesched.sim import Disaggregation, Empirical, Poisson, load_trace, simulate, synthetic

TRACE = Path(__file__).resolve().parents[1] / "data" / "traces" / "AzureLLMInferenceTrace_conv.csv"


def main(argv: list[str] | None = None) -> int:
    """Run the example; ``argv`` as on the command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=8.0, help="requests per second")
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--bandwidths", default="5,25,50,100,400", help="link bandwidths in GB/s")
    parser.add_argument("--policy", default="vllm")
    args = parser.parse_args(argv)

    trace = load_trace(TRACE)
    workload = synthetic(
        args.requests,
        Poisson(args.rate),
        Empirical(trace.prompt_len),
        Empirical(trace.output_len),
        seed=0,
        name="conv-lengths",
    )
    policy = load_policy(args.policy)
    header = f"{'setup':<22}{'TTFT p50':>9}{'TTFT p99':>9}{'transfer':>9}{'ITL p99':>9}{'max gap':>9}{'out tok/s':>10}"
    print(f"{len(workload)} requests at {args.rate:g} req/s, two H200 GPUs, policy {policy.name} (times in ms)")
    print(header)
    print("-" * len(header))
    runs = [("2 aggregated replicas", {"replicas": 2})]
    runs += [
        (f"1P+1D @ {bw:g} GB/s", {"disaggregation": Disaggregation(1, 1, link_bandwidth_gbs=bw)})
        for bw in map(float, args.bandwidths.split(","))
    ]
    for label, options in runs:
        m = simulate(workload, policy, **options).metrics  # type: ignore[arg-type]
        print(
            f"{label:<22}{m['median_ttft_ms']:>9.1f}{m['p99_ttft_ms']:>9.1f}{m['mean_transfer_ms']:>9.2f}"
            f"{m['p99_itl_ms']:>9.1f}{m['max_itl_ms']:>9.1f}{m['output_throughput']:>10.0f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
