"""A minimal inference engine on phasesched: schedule -> execute -> update until every request is done.

The scheduler runs any registered policy (``--policy``, default ``sarathi``: decodes first, prompts
in fixed chunks under one token budget). The executor is the torch reference executor (a tiny Llama
with random weights) when ``phasesched-torch`` is installed, else phasesched's
``DeterministicExecutor``, which computes nothing and emits position-derived tokens (no torch
needed). Run::

    python examples/engine_loop.py                      # torch if installed
    python examples/engine_loop.py --executor deterministic --policy vllm
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from pathlib import Path

from phasesched import (
    POLICIES,
    DeterministicExecutor,
    Executor,
    PolicyOptions,
    Request,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    load_policy,
)
from phasesched.costmodel import CostModel, ProfiledCostModel, RooflineCostModel

PAGE_SIZE = 16
NUM_PAGES = 64
VOCAB_SIZE = 512  # the "tiny" preset's vocabulary
PROMPT_LENGTHS = (45, 12, 80, 5)


def make_executor(choice: str) -> tuple[str, Executor]:
    """The executor to use, and its name."""
    if choice != "deterministic" and importlib.util.find_spec("phasesched_torch") is not None:
        from phasesched_torch import create_executor  # noqa: PLC0415 -- optional dependency

        return "torch", create_executor(model="tiny", num_pages=NUM_PAGES, page_size=PAGE_SIZE, seed=0)
    if choice == "torch":
        msg = "phasesched-torch is not installed: pip install -e executors/torch"
        raise SystemExit(msg)
    return "deterministic", DeterministicExecutor(vocab_size=VOCAB_SIZE)


def make_requests() -> list[Request]:
    """Prompts of a few lengths; the last request samples (seeded), the others decode greedily."""
    requests = []
    for i, length in enumerate(PROMPT_LENGTHS):
        prompt = [(31 * i + 7 * j + 1) % VOCAB_SIZE for j in range(length)]
        sampling = SamplingParams(temperature=0.8, top_p=0.9, seed=1234) if i == len(PROMPT_LENGTHS) - 1 else None
        requests.append(
            Request(f"req-{i}", prompt_token_ids=prompt, max_new_tokens=8, sampling=sampling or SamplingParams())
        )
    return requests


def main(argv: list[str] | None = None) -> int:
    """Run every request to completion, printing each step and each finished request's tokens."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--executor", choices=("auto", "torch", "deterministic"), default="auto")
    parser.add_argument(
        "--policy", choices=POLICIES.names(), default="sarathi", help="a registered policy (default sarathi)"
    )
    parser.add_argument(
        "--chunk-size", type=int, default=32, help="the policy's chunk size (sarathi: chunk and per-step token budget)"
    )
    parser.add_argument(
        "--cost-model",
        type=Path,
        metavar="FILE.csv",
        help="profile CSV that SLO-adaptive policies (sarathi-slo) predict with; default: an H200 roofline",
    )
    args = parser.parse_args(argv)

    name, executor = make_executor(args.executor)
    cost: CostModel = (
        ProfiledCostModel.from_csv(args.cost_model)
        if args.cost_model is not None
        else RooflineCostModel.from_names("H200", "llama-3-8b")
    )
    options = PolicyOptions(max_model_len=NUM_PAGES * PAGE_SIZE, chunk_size=args.chunk_size, cost_model=cost)
    policy = load_policy(args.policy, options)
    scheduler = Scheduler(SchedulerConfig(num_pages=NUM_PAGES, page_size=PAGE_SIZE), policy)
    for request in make_requests():
        scheduler.add_request(request)

    start, steps = time.perf_counter(), 0
    while scheduler.num_unfinished:
        plan = scheduler.schedule(now=time.perf_counter() - start)
        result = executor.execute(plan)
        outcome = scheduler.update(plan, result)
        steps += 1
        timing = "" if result.duration_s is None else f", {result.duration_s * 1e3:.1f} ms"
        print(
            f"step {plan.step_id:3d}: {plan.batch_size} slices, {plan.num_prefill_tokens:3d} prefill tokens, "
            f"{plan.num_decodes} decodes{timing}"
        )
        for record in outcome.finished:
            print(
                f"  {record.request_id} done ({record.reason.value}): prompt of {record.prompt_len} tokens -> "
                f"{list(record.output_token_ids or ())}"
            )
    print(f"{name} executor, {policy.name} policy: {steps} steps in {time.perf_counter() - start:.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
