"""A real 1P:1D split on CPU processes, measured, beside the simulator's prediction for the same requests.

Three measurements, then one comparison:

1. the link: raw ``torch.distributed`` send/recv (gloo) between two processes, fitted to
   ``latency + bytes / bandwidth``;
2. the step cost: the torch executor profiled on this machine (the library's profiler);
3. the run: one prefill and one decode worker as separate processes (``python -m
   phasesched_torch.pd`` does the same from the command line), KV pages pulled over gloo;
4. the simulator, given (1) and (2), on the same requests: TTFT component by component.

    python examples/pd_runtime.py --requests 12 --rate 4 --prompt-lens 64,160,256,400

Needs ``phasesched-torch``. Numbers from a shared machine are noisy: run it more than once.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from phasesched.costmodel.profiling import ProfileGrid
from phasesched_torch._pd_link import fit_link, measure_link
from phasesched_torch._pd_measure import (
    kv_bytes_per_token,
    measured_components,
    profile_cost_model,
    simulated_components,
    summarize_errors,
)
from phasesched_torch.pd import PDRunConfig, RequestSpec, launch


def main() -> int:
    """Measure the link, profile the executor, run 1P:1D, simulate it, and print the comparison."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=12, help="requests")
    parser.add_argument("--rate", type=float, default=4.0, help="arrivals per second (evenly spaced)")
    parser.add_argument("--prompt-lens", default="64,160,256,400", help="prompt lengths, cycled")
    parser.add_argument("--max-new-tokens", type=int, default=8, help="tokens per request")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    parser.add_argument("--repeats", type=int, default=9, help="samples per link size (profile: half as many)")
    parser.add_argument("--output", help="write everything measured as JSON here")
    args = parser.parse_args()

    lengths = [int(v) for v in args.prompt_lens.split(",")]
    specs = tuple(
        RequestSpec(lengths[i % len(lengths)], args.max_new_tokens, i / args.rate) for i in range(args.requests)
    )
    config = PDRunConfig(
        page_size=args.page_size, chunk_size=256, max_num_batched_tokens=512, requests=specs, run_timeout_s=120.0
    )
    per_token = kv_bytes_per_token(config)
    sizes = sorted({-(-p // args.page_size) * args.page_size * per_token for p in lengths})

    samples = measure_link([*sizes, 1 << 20, 4 << 20], repeats=args.repeats)
    link = fit_link(samples)
    grid = ProfileGrid(
        prefill_tokens=(0, 16, 64, 256), prefill_prefix=(0, 256), decode_seqs=(0, 1, 4), decode_context=(16, 128, 512)
    )
    cost = profile_cost_model(config, grid, repeats=max(args.repeats // 2, 1))
    result = launch(config)
    measured = measured_components(result)
    simulated = simulated_components(config, cost, link, per_token)

    transfers = [t for w in result.workers.values() for t in w["transfers"]]
    total_bytes = sum(t["nbytes"] for t in transfers)
    total_s = sum(t["seconds"] for t in transfers)
    print(
        f"link (raw gloo send/recv, fitted): {link.bandwidth_bytes_per_s / 1e6:.0f} MB/s, {link.latency_s * 1e3:.2f} ms"
    )
    print(f"run: {len(measured)}/{len(specs)} finished, exit codes {result.exit_codes}")
    print(
        f"transfers: {len(transfers)}, {total_bytes / len(transfers) / 1e3:.1f} kB and "
        f"{total_s / len(transfers) * 1e3:.2f} ms per request, achieved {total_bytes / total_s / 1e6:.0f} MB/s"
    )
    rows = summarize_errors(measured, simulated)
    print(f"{'component':<13}{'measured ms':>12}{'simulated ms':>14}{'error':>9}")
    for row in rows:
        print(f"{row['component']:<13}{row['measured_ms']:>12.2f}{row['simulated_ms']:>14.2f}{row['error_pct']:>8.0f}%")
    if args.output:
        Path(args.output).write_text(
            json.dumps(
                {
                    "link": {"latency_s": link.latency_s, "bandwidth_bytes_per_s": link.bandwidth_bytes_per_s},
                    "link_samples": samples,
                    "transfers": transfers,
                    "components": rows,
                    "measured": measured,
                    "simulated": simulated,
                },
                indent=1,
            )
        )
    return 0 if len(measured) == len(specs) else 1


if __name__ == "__main__":
    sys.exit(main())
