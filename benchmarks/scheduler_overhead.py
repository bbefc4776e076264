"""CPU cost of the scheduler per model step: ``schedule()`` and ``update()``, in thread time.

Cases (mirroring ``shared/peers/vllm_sched``, which drives vLLM's V1 scheduler the same way):

* ``decode-N``: N requests with 512-token prompts all decoding (one token each per step), on
  the scheduler's steady-decode path (nothing waits, so it builds the step without the policy);
* ``decode-N/policy``: the same with that path off, so the policy plans and the scheduler
  checks every step, as they do whenever something waits or a plugin policy runs;
* ``mixed-256+16K``: 256 decodes while a 16K-token prompt is chunked beside them;
* ``waiting-100K``: 256 decodes running while 100,000 requests wait (the sequence cap binds).

Requests carry token ids, as an engine's do, so ``update()`` records every sampled token. The
executor is :class:`phasesched.DeterministicExecutor`, outside the timed region.
``--prefix-caching both`` runs every case with prefix caching off and on (``/cache`` rows): every
page that fills is then hashed and named, and the prompts, all alike, share cached pages. The two
run interleaved, round by round (which goes first alternates), so a busy moment of a shared
machine disturbs both alike, and a last table gives each case's cache-on / cache-off ratios.

Usage::

    python benchmarks/scheduler_overhead.py [--ns 16,64,256,1024,4096] [--steps 200] [--json out.json]
        [--prefix-caching off|on|both]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from phasesched import DeterministicExecutor, PolicyOptions, Request, Scheduler, SchedulerConfig, load_policy

PROMPT = 512
LONG_PROMPT = 16 * 1024
PAGE = 16

# vLLM 0.32 V1 scheduler on a 2-core machine of this kind, median CPU us per step
# (schedule + update_from_output), from shared/peers/vllm_sched/README.md.
VLLM_REFERENCE_US = {16: 178 + 76, 64: 648 + 285, 256: 2604 + 1266, 1024: 12666 + 6176, "mixed-256+16K": 4850 + 1900}


def make_scheduler(num_running: int, extra_tokens: int = 0, *, cache: bool = False) -> Scheduler:
    """A scheduler sized so nothing is ever preempted; ``cache`` turns prefix caching on."""
    tokens = num_running * (PROMPT + 1024) + extra_tokens
    config = SchedulerConfig(num_pages=tokens // PAGE + 1024, page_size=PAGE, max_model_len=32 * 1024)
    options = PolicyOptions(
        max_num_seqs=max(num_running, 1),
        max_num_batched_tokens=max(8192, num_running),
        enable_prefix_caching=cache,
    )
    return Scheduler(config, load_policy("vllm", options))


def add_decoders(scheduler: Scheduler, count: int, prefix: str = "d") -> None:
    """Add ``count`` requests and run them until every one is decoding."""
    executor = DeterministicExecutor()
    for i in range(count):
        scheduler.add_request(Request(f"{prefix}{i}", prompt_token_ids=list(range(PROMPT)), max_new_tokens=100_000))
    while True:
        plan = scheduler.schedule()
        scheduler.update(plan, executor.execute(plan))
        if plan.num_prefill_tokens == 0 and plan.batch_size == count:
            return


def timed_steps(
    scheduler: Scheduler, steps: int, keep: Callable[[object], bool] | None = None
) -> dict[str, list[float]]:
    """Thread-CPU microseconds of schedule() and update() over ``steps`` steps."""
    executor = DeterministicExecutor()
    sched_us: list[float] = []
    update_us: list[float] = []
    gc.collect()
    gc.freeze()
    for _ in range(steps):
        t0 = time.thread_time_ns()
        plan = scheduler.schedule()
        t1 = time.thread_time_ns()
        result = executor.execute(plan)
        t2 = time.thread_time_ns()
        scheduler.update(plan, result)
        t3 = time.thread_time_ns()
        if keep is None or keep(plan):
            sched_us.append((t1 - t0) / 1e3)
            update_us.append((t3 - t2) / 1e3)
    gc.unfreeze()
    return {"schedule": sched_us, "update": update_us}


def summarize(name: str, running: int, samples: dict[str, list[float]]) -> dict[str, object]:
    """Median / p99 per verb, and the per-running-request cost of a whole step."""
    row: dict[str, object] = {"case": name, "running": running, "steps": len(samples["schedule"])}
    for verb, values in samples.items():
        row[f"{verb}_median_us"] = statistics.median(values)
        row[f"{verb}_p99_us"] = float(np.percentile(values, 99))
    total = float(row["schedule_median_us"]) + float(row["update_median_us"])  # type: ignore[arg-type]
    row["step_median_us"] = total
    row["us_per_running_request"] = total / running
    base = name.removesuffix("/cache")
    key: object = running if base.startswith("decode") else base  # both decode paths against vLLM's one
    reference = VLLM_REFERENCE_US.get(key)  # type: ignore[call-overload]
    row["vllm_reference_us"] = reference
    row["vllm_over_phasesched"] = None if reference is None else reference / total
    return row


def pooled(rounds: list[dict[str, list[float]]]) -> dict[str, list[float]]:
    """Every round's samples together: medians and p99s over all of them, disturbed ones included."""
    return {verb: [v for r in rounds for v in r[verb]] for verb in ("schedule", "update")}


Round = Callable[[Scheduler, int], dict[str, list[float]]]


def interleaved(
    caches: list[bool], rounds: int, build: Callable[[bool], Scheduler], one_round: Round
) -> dict[bool, dict[str, list[float]]]:
    """Every round of each setting, alternating which goes first: a busy moment then disturbs both alike."""
    schedulers = {cache: build(cache) for cache in caches}
    samples: dict[bool, list[dict[str, list[float]]]] = {cache: [] for cache in caches}
    for index in range(rounds):
        for cache in caches if index % 2 == 0 else caches[::-1]:
            samples[cache].append(one_round(schedulers[cache], index))
    return {cache: pooled(samples[cache]) for cache in caches}


def named(base: str, cache: bool) -> str:
    return base + ("/cache" if cache else "")


def decode_case(
    n: int, steps: int, rounds: int, caches: list[bool], *, ask_policy: bool = False
) -> list[dict[str, object]]:
    """``n`` requests decoding; ``ask_policy`` turns off the steady-decode path, so the policy plans every step."""

    def build(cache: bool) -> Scheduler:
        scheduler = make_scheduler(n, cache=cache)
        scheduler._steady_fast_path = not ask_policy  # noqa: SLF001 -- the switch the equivalence tests use
        add_decoders(scheduler, n)
        return scheduler

    samples = interleaved(caches, rounds, build, lambda scheduler, _: timed_steps(scheduler, steps))
    base = f"decode-{n}" + ("/policy" if ask_policy else "")
    return [summarize(named(base, cache), n, samples[cache]) for cache in caches]


def mixed_case(steps: int, caches: list[bool]) -> list[dict[str, object]]:
    """256 decodes beside a 16K prompt's chunks; a round is one prompt's first three chunks (then it finishes)."""

    def build(cache: bool) -> Scheduler:
        scheduler = make_scheduler(257, extra_tokens=LONG_PROMPT * 4, cache=cache)  # room for the long prompt
        add_decoders(scheduler, 256)
        return scheduler

    def one_round(scheduler: Scheduler, index: int) -> dict[str, list[float]]:
        prompt = [index + 1, *range(LONG_PROMPT - 1)]  # a new first token: no long prompt hits the cache
        scheduler.add_request(Request(f"long{index}", prompt_token_ids=prompt, max_new_tokens=1))
        chunk = timed_steps(scheduler, 3, keep=lambda plan: plan.num_prefill_tokens > 0)  # type: ignore[attr-defined]
        executor = DeterministicExecutor()
        while f"long{index}" in scheduler.running_request_ids():  # let it finish before the next one
            plan = scheduler.schedule()
            scheduler.update(plan, executor.execute(plan))
        return chunk

    samples = interleaved(caches, -(-steps // 3), build, one_round)
    return [summarize(named("mixed-256+16K", cache), 257, samples[cache]) for cache in caches]


def waiting_case(steps: int, rounds: int, caches: list[bool], waiting: int = 100_000) -> list[dict[str, object]]:
    def build(cache: bool) -> Scheduler:
        scheduler = make_scheduler(256, cache=cache)
        add_decoders(scheduler, 256)
        prompt = tuple(range(PROMPT))
        for i in range(waiting):
            scheduler.add_request(Request(f"w{i}", prompt_token_ids=prompt, max_new_tokens=16))
        return scheduler

    samples = interleaved(caches, rounds, build, lambda scheduler, _: timed_steps(scheduler, steps))
    return [summarize(named(f"waiting-{waiting // 1000}K+256", cache), 256, samples[cache]) for cache in caches]


def print_ratios(rows: list[dict[str, object]]) -> None:
    """Cache on over cache off, per case: what the prefix cache costs the scheduler per step."""
    by_case = {str(r["case"]): r for r in rows}
    pairs = [(case, by_case[case + "/cache"]) for case in by_case if case + "/cache" in by_case]
    if not pairs:
        return
    header = f"{'case':<26}{'sched on/off':>14}{'upd on/off':>12}{'step on/off':>13}"
    print()
    print(header)
    print("-" * len(header))
    for case, on in pairs:
        off = by_case[case]
        ratios = [float(on[k]) / float(off[k]) for k in ("schedule_median_us", "update_median_us", "step_median_us")]  # type: ignore[arg-type]
        print(f"{case:<26}{ratios[0]:>13.2f}x{ratios[1]:>11.2f}x{ratios[2]:>12.2f}x")


def print_table(rows: list[dict[str, object]]) -> None:
    header = (
        f"{'case':<26}{'running':>8}{'sched p50':>11}{'sched p99':>11}{'upd p50':>10}{'upd p99':>10}"
        f"{'us/req':>9}{'vLLM us':>10}{'vLLM/ours':>11}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        ref = r["vllm_reference_us"]
        ratio = r["vllm_over_phasesched"]
        print(
            f"{r['case']:<26}{r['running']:>8}{r['schedule_median_us']:>11.1f}{r['schedule_p99_us']:>11.1f}"
            f"{r['update_median_us']:>10.1f}{r['update_p99_us']:>10.1f}{r['us_per_running_request']:>9.2f}"
            f"{'-' if ref is None else ref:>10}{'-' if ratio is None else f'{ratio:.1f}x':>11}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ns", default="16,64,256,1024,4096", help="running-request counts for decode-N")
    parser.add_argument("--steps", type=int, default=100, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per case, pooled")
    parser.add_argument("--skip-policy", action="store_true", help="skip decode-N/policy (the policy asked every step)")
    parser.add_argument("--skip-mixed", action="store_true")
    parser.add_argument("--skip-waiting", action="store_true")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    parser.add_argument("--prefix-caching", choices=("off", "on", "both"), default="off")
    args = parser.parse_args(argv)
    ns = [int(n) for n in args.ns.split(",")]
    caches = {"off": [False], "on": [True], "both": [False, True]}[args.prefix_caching]
    rows: list[dict[str, object]] = []
    for n in ns:
        rows += decode_case(n, args.steps, args.rounds, caches)
    if not args.skip_policy:
        for n in ns:
            rows += decode_case(n, args.steps, args.rounds, caches, ask_policy=True)
    if not args.skip_mixed:
        rows += mixed_case(max(args.steps // 4, 10), caches)
    if not args.skip_waiting:
        rows += waiting_case(args.steps, args.rounds, caches)
    print_table(rows)
    print_ratios(rows)
    if args.json:
        with Path(args.json).open("w", encoding="utf-8") as handle:
            json.dump({"python": sys.version, "rows": rows}, handle, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
