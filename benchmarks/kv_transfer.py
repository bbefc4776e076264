"""KV transfer over gloo: the P/D runtime's pulls against raw torch.distributed send/recv, and TTFT vs the simulator.

1. **Transfers.** One prefill and one decode worker (``phasesched_torch.pd``, tiny Llama, gloo
   on the CPU) serve requests whose prompts fill 1 to 256 pages of 16 tokens (8 KB of KV per
   page), one at a time (arrivals spaced out, so pulls never overlap). Each pull is timed on the
   decode worker from its ``Pull`` message to the pages in place: the control messages through
   the job's ``TCPStore``, the prefill worker noticing the pull between its steps, the
   send/receive, the checksum and the scatter into the cache.
2. **Raw link.** A two-process ping-pong of plain tensors of the same byte sizes
   (:func:`phasesched_torch._pd_link.measure_link`): the time the bytes alone need.
   The ratio of (1) to (2) is the protocol's overhead.
3. **TTFT.** ``examples/pd_runtime.py``'s comparison: a 1P:1D run beside the simulator given a
   profile of this machine and the fitted link; the error per TTFT component.

    python benchmarks/kv_transfer.py [--pages 1,4,16,64,256] [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
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

PAGE_SIZE = 16


def transfer_table(pages: list[int], repeats: int) -> list[dict[str, float]]:
    """Per pages-per-request: median pull time and bandwidth, median raw send/recv time, and their ratio."""
    specs = []
    for k in range(repeats):
        for i, n in enumerate(pages):
            specs.append(RequestSpec(n * PAGE_SIZE, 1, 1.0 * (k * len(pages) + i)))  # alone: no step to wait for
    config = PDRunConfig(
        page_size=PAGE_SIZE,
        prefill_pages=2 * max(pages) + 8,
        decode_pages=2 * max(pages) + 8,
        chunk_size=1024,
        max_num_batched_tokens=4096,
        requests=tuple(specs),
        run_timeout_s=180.0,
    )
    result = launch(config)
    transfers = [t for w in result.workers.values() for t in w["transfers"]]
    raw = measure_link(sorted({t["nbytes"] for t in transfers}), repeats=max(repeats, 5))
    rows = []
    for n in pages:
        mine = [t for t in transfers if t["num_pages"] in (n, n + 1)]  # the last prompt token may open a page
        if not mine:
            continue
        nbytes = mine[0]["nbytes"]
        pull = statistics.median(t["seconds"] for t in mine)
        send = statistics.median(t for b, t in raw if b == nbytes)
        rows.append(
            {
                "pages": n,
                "bytes": nbytes,
                "pull_ms": pull * 1e3,
                "pull_MBps": nbytes / pull / 1e6,
                "raw_ms": send * 1e3,
                "raw_MBps": nbytes / send / 1e6,
                "overhead_x": pull / send,
            }
        )
    return rows


def ttft_table(requests: int) -> list[dict[str, float]]:
    """The simulator's TTFT error per component for a 1P:1D run (as examples/pd_runtime.py)."""
    lengths = [64, 160, 256, 400]
    specs = tuple(RequestSpec(lengths[i % 4], 8, i / 4.0) for i in range(requests))
    config = PDRunConfig(page_size=PAGE_SIZE, chunk_size=256, max_num_batched_tokens=512, requests=specs)
    per_token = kv_bytes_per_token(config)
    link = fit_link(
        measure_link([-(-p // PAGE_SIZE) * PAGE_SIZE * per_token for p in lengths] + [1 << 20, 4 << 20], repeats=9)
    )
    grid = ProfileGrid(
        prefill_tokens=(0, 16, 64, 256), prefill_prefix=(0, 256), decode_seqs=(0, 1, 4), decode_context=(16, 128, 512)
    )
    cost = profile_cost_model(config, grid)
    result = launch(config)
    return summarize_errors(measured_components(result), simulated_components(config, cost, link, per_token))


def main() -> int:
    """Run both tables and print them."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", default="1,4,16,64,256", help="pages per request")
    parser.add_argument("--repeats", type=int, default=3, help="requests per size")
    parser.add_argument("--requests", type=int, default=16, help="requests in the TTFT run")
    parser.add_argument("--json", help="save the results here")
    args = parser.parse_args()
    transfers = transfer_table([int(p) for p in args.pages.split(",")], args.repeats)
    print(f"{'pages':>6}{'bytes':>10}{'pull ms':>9}{'pull MB/s':>11}{'raw ms':>8}{'raw MB/s':>10}{'ratio':>7}")
    for r in transfers:
        print(
            f"{r['pages']:>6}{r['bytes']:>10}{r['pull_ms']:>9.2f}{r['pull_MBps']:>11.1f}"
            f"{r['raw_ms']:>8.2f}{r['raw_MBps']:>10.1f}{r['overhead_x']:>7.1f}"
        )
    ttft = ttft_table(args.requests)
    print(f"\n{'component':<13}{'measured ms':>12}{'simulated ms':>14}{'error':>9}")
    for row in ttft:
        print(f"{row['component']:<13}{row['measured_ms']:>12.2f}{row['simulated_ms']:>14.2f}{row['error_pct']:>8.0f}%")
    if args.json:
        Path(args.json).write_text(json.dumps({"transfers": transfers, "ttft": ttft}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
