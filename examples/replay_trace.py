"""Replay the Azure LLM conversation trace through several policies and plot what users feel.

Loads the trace shipped in ``data/traces`` (or one you pass), keeps its first minutes, replays
them on a simulated H200 + Llama-3-8B under each policy, prints time-to-first-token and
inter-token latency percentiles, and saves the CDFs of both as a PNG.

    python examples/replay_trace.py --minutes 5 --policies vllm,sarathi,sglang --output bench-results
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib as mpl

mpl.use("Agg")
import matplotlib.pyplot as plt

from phasesched import load_policy
from phasesched.sim import load_trace, simulate

TRACE = Path(__file__).resolve().parents[1] / "data" / "traces" / "AzureLLMInferenceTrace_conv.csv"


def main(argv: list[str] | None = None) -> int:
    """Run the example; ``argv`` as on the command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--minutes", type=float, default=5.0, help="replay this much of the trace")
    parser.add_argument("--rate-scale", type=float, default=1.0, help="replay this many times faster")
    parser.add_argument("--policies", default="vllm,sarathi,sglang,orca")
    parser.add_argument("--output", type=Path, default=Path("bench-results"))
    args = parser.parse_args(argv)

    workload = load_trace(args.trace).window(0.0, args.minutes * 60.0).time_scaled(1.0 / args.rate_scale)
    print(f"{workload.name}: {len(workload)} requests over {workload.duration_s:.0f} s ({workload.rate:.2f} req/s)")
    fig, (ax_ttft, ax_itl) = plt.subplots(1, 2, figsize=(11, 4))
    print(f"{'policy':<10}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}{'out tok/s':>11}   (ms)")
    for name in args.policies.split(","):
        metrics = simulate(workload, load_policy(name)).metrics
        print(
            f"{name:<10}{metrics['median_ttft_ms']:>10.1f}{metrics['p99_ttft_ms']:>10.1f}"
            f"{metrics['median_itl_ms']:>9.1f}{metrics['p99_itl_ms']:>9.1f}{metrics['output_throughput']:>11.0f}"
        )
        values, fractions = metrics.distributions["ttft"].cdf(400)
        ax_ttft.plot(values * 1e3, fractions, label=name)
        values, fractions = metrics.distributions["itl"].cdf(2000)
        ax_itl.plot(values * 1e3, 1.0 - fractions + 1e-6, label=name)  # the tail: gaps longer than x
    ax_ttft.set(xscale="log", xlabel="time to first token (ms)", ylabel="fraction of requests", title="TTFT (CDF)")
    ax_itl.set(
        xscale="log", yscale="log", xlabel="token gap (ms)", ylabel="fraction of gaps longer", title="Token gaps (tail)"
    )
    for axis in (ax_ttft, ax_itl):
        axis.grid(alpha=0.3)
        axis.legend()
    args.output.mkdir(parents=True, exist_ok=True)
    path = args.output / "replay_trace.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
