"""``python -m phasesched_torch.pd``: run disaggregated prefill and decode as processes.

Without ``RANK`` in the environment it starts the ``--prefill + --decode`` ranks itself on
this machine and prints a summary; under ``torchrun`` (which sets ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``) each process runs its rank::

    python -m phasesched_torch.pd --prefill 1 --decode 2 --requests 12 --output pd.json
    torchrun --nproc-per-node 3 -m phasesched_torch.pd --prefill 1 --decode 2 --output pd.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from phasesched_torch._pd import PDRunConfig, PDRunResult, RequestSpec, launch, run_rank

__all__ = ["PDRunConfig", "PDRunResult", "RequestSpec", "launch", "main", "run_rank"]


def _config(args: argparse.Namespace) -> PDRunConfig:
    if args.config:
        return PDRunConfig.from_json(Path(args.config).read_text())
    lengths = [int(v) for v in args.prompt_lens.split(",")]
    specs = [
        RequestSpec(lengths[i % len(lengths)], args.max_new_tokens, i / args.rate if args.rate > 0 else 0.0)
        for i in range(args.requests)
    ]
    return PDRunConfig(
        num_prefill=args.prefill,
        num_decode=args.decode,
        model=args.model,
        page_size=args.page_size,
        chunk_size=args.chunk_size,
        decode_pages=args.decode_pages,
        requests=tuple(specs),
        backend=args.backend,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line and run a rank (under torchrun) or the whole job."""
    parser = argparse.ArgumentParser(prog="python -m phasesched_torch.pd", description=__doc__.splitlines()[0])
    parser.add_argument("--prefill", type=int, default=1, help="prefill workers")
    parser.add_argument("--decode", type=int, default=1, help="decode workers")
    parser.add_argument("--requests", type=int, default=8, help="requests in the workload")
    parser.add_argument("--prompt-lens", default="8,21,40", help="prompt lengths, cycled")
    parser.add_argument("--max-new-tokens", type=int, default=8, help="tokens generated per request")
    parser.add_argument("--rate", type=float, default=0.0, help="arrivals per second (0: all at once)")
    parser.add_argument("--model", default="tiny", help="phasesched_torch model preset")
    parser.add_argument("--page-size", type=int, default=4, help="tokens per KV page")
    parser.add_argument("--chunk-size", type=int, default=16, help="prefill chunk")
    parser.add_argument("--decode-pages", type=int, default=256, help="KV pages per decode worker")
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl"], help="torch.distributed backend")
    parser.add_argument("--config", help="a PDRunConfig as JSON (overrides the options above)")
    parser.add_argument("--output", help="write the results as JSON here (rank 0)")
    args = parser.parse_args(argv)
    config = _config(args)
    if "RANK" in os.environ:
        code = run_rank(
            config, int(os.environ["RANK"]), os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), args.output
        )
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # no lingering gloo threads waiting on peers that are gone
    result = launch(config, quiet=False)
    if args.output:
        Path(args.output).write_text(json.dumps(result.to_dict(), indent=1))
    states = [r["state"] for r in result.requests.values()]
    sys.stdout.write(
        f"{states.count('finished')} finished, {states.count('failed')} failed; exit codes {result.exit_codes}\n"
    )
    return 0 if all(code == 0 for code in result.exit_codes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
