"""CPU cost of the scheduler per model step: ``schedule()`` and ``update()``, in thread time.

Cases (mirroring ``shared/peers/vllm_sched``, which drives vLLM's V1 scheduler the same way):

* ``decode-N``: N requests with 512-token prompts all decoding (one token each per step), on
  the scheduler's steady-decode path (nothing waits, so it builds the step without the policy);
* ``decode-N/policy``: the same with that path off, so the policy plans and the scheduler
  checks every step, as they do whenever something waits or a plugin policy runs;
* ``mixed-256+16K``: 256 decodes while a 16K-token prompt is chunked beside them (the
  sequence cap and the KV cache leave it room: the script checks that it is admitted);
* ``waiting-100K``: 256 decodes running while 100,000 requests wait (the sequence cap binds).

**Against vLLM.** When vLLM's side-by-side harness (``shared/peers/vllm_sched``, see its README)
and its venv are found, the script first runs vLLM 0.32's V1 scheduler and phasesched on that
harness's cases (decode-16/64/256/1024, 256 decodes + a 16K prompt chunked at 8192, 1024
decodes with 100 x 2K prompts waiting or being admitted) in two long-lived worker processes,
interleaved case by case and round by round (vLLM first on odd rounds, phasesched first on even
ones), and prints the ratio of their median CPU us per step measured in the same round, with its
median and range over the rounds, and whether both scheduled identical batches step for step.
Without the harness or the venv it says why and prints phasesched's figures alone.

Requests carry token ids, as an engine's do, so ``update()`` records every sampled token. The
executor is :class:`phasesched.DeterministicExecutor`, outside the timed region.
``--prefix-caching both`` runs every case with prefix caching off and on (``/cache`` rows): every
page that fills is then hashed and named (the running prompts differ, so the batches match the
cache-off ones step for step; the waiting prompts, all alike, share cached pages). The two
run interleaved, round by round (which goes first alternates), so a busy moment of a shared
machine disturbs both alike, and a last table gives each case's cache-on / cache-off ratios:
of the median step, and of the mean step (steady decode steps name their pages in one batch
every ``page_size`` steps, which the median never sees and the mean spreads over every step).

Usage::

    python benchmarks/scheduler_overhead.py [--ns 16,64,256,1024,4096] [--steps 200] [--json out.json]
        [--prefix-caching off|on|both] [--vllm-harness DIR] [--vllm-python PY] [--vllm-rounds 3]
        [--compare-pythonpath SRC_DIR ...] [--only-vllm] [--side-by-side-cache on|off]

``--compare-pythonpath`` adds, to the interleaved rounds, phasesched workers importing the
package from other source trees (an older commit's ``src``, say), for before/after ratios
measured in the same window. ``--side-by-side-cache off`` turns prefix caching off on both sides
of that comparison (vLLM's ``--no-prefix-caching``; ``ps_bench_no_cache.py`` for phasesched).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from phasesched import DeterministicExecutor, PolicyOptions, Request, Scheduler, SchedulerConfig, load_policy

PROMPT = 512
LONG_PROMPT = 16 * 1024
PAGE = 16

REPO = Path(__file__).resolve().parents[1]
HARNESS_CASES = ("decode-16", "decode-64", "decode-256", "decode-1024", "mixed", "wait-1024", "admit-1024")


def make_scheduler(num_running: int, extra_tokens: int = 0, *, cache: bool = False, extra_seqs: int = 0) -> Scheduler:
    """A scheduler sized so nothing is ever preempted; ``cache`` turns prefix caching on."""
    tokens = num_running * (PROMPT + 1024) + extra_tokens
    config = SchedulerConfig(num_pages=tokens // PAGE + 1024, page_size=PAGE, max_model_len=32 * 1024)
    options = PolicyOptions(
        max_num_seqs=max(num_running + extra_seqs, 1),
        max_num_batched_tokens=max(8192, num_running),
        enable_prefix_caching=cache,
    )
    return Scheduler(config, load_policy("vllm", options))


def add_decoders(scheduler: Scheduler, count: int, prefix: str = "d") -> None:
    """Add ``count`` requests and run them until every one is decoding.

    Each prompt starts with its own token, so with the cache on every page is hashed and named
    but none is shared: the requests are admitted and reach their pages' ends on the same steps
    as with the cache off, and the on/off ratio is the cache's own cost.
    """
    executor = DeterministicExecutor()
    for i in range(count):
        prompt = [i, *range(PROMPT - 1)]
        scheduler.add_request(Request(f"{prefix}{i}", prompt_token_ids=prompt, max_new_tokens=100_000))
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
    row["step_mean_us"] = statistics.fmean(samples["schedule"]) + statistics.fmean(samples["update"])
    row["us_per_running_request"] = total / running
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
    """256 decodes while one 16K prompt at a time is chunked beside them, under an 8192-token budget.

    The sequence cap leaves a seat for the prompt and the KV cache holds it beside the 256
    decodes' growth, so it is admitted at once and nothing is preempted (both are checked):
    only steps with all 256 decodes and a chunk of the prompt are timed. A round is one prompt's
    first three chunks (then it finishes).
    """

    def build(cache: bool) -> Scheduler:
        scheduler = make_scheduler(256, extra_tokens=LONG_PROMPT * 4, cache=cache, extra_seqs=1)
        add_decoders(scheduler, 256)
        return scheduler

    def one_round(scheduler: Scheduler, index: int) -> dict[str, list[float]]:
        long_id = f"long{index}"
        # A first token no other prompt has (the decoders' are their numbers): no long prompt hits the cache.
        prompt = [1_000_000 + index, *range(LONG_PROMPT - 1)]
        scheduler.add_request(Request(long_id, prompt_token_ids=prompt, max_new_tokens=1))

        def mixed(plan: object) -> bool:
            assert not plan.preempted, "the mixed case preempted a request: the KV cache is too small"  # type: ignore[attr-defined]
            return plan.batch_size == 257 and long_id in plan.request_ids  # type: ignore[attr-defined,no-any-return]

        chunk = timed_steps(scheduler, 3, keep=mixed)
        assert chunk["schedule"], f"{long_id} was not admitted beside the 256 decodes"
        executor = DeterministicExecutor()
        while long_id in scheduler.running_request_ids():  # let it finish before the next one
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
    """Cache on over cache off, per case: what the prefix cache costs the scheduler per step.

    Steady decode steps name their filled pages in one batch every ``page_size`` steps, so the
    median step pays none of it: the mean ratio is the cost spread over every step.
    """
    by_case = {str(r["case"]): r for r in rows}
    pairs = [(case, by_case[case + "/cache"]) for case in by_case if case + "/cache" in by_case]
    if not pairs:
        return
    header = f"{'case':<26}{'sched on/off':>14}{'upd on/off':>12}{'step on/off':>13}{'mean on/off':>13}"
    print()
    print(header)
    print("-" * len(header))
    for case, on in pairs:
        off = by_case[case]
        keys = ("schedule_median_us", "update_median_us", "step_median_us", "step_mean_us")
        ratios = [float(on[k]) / float(off[k]) for k in keys]  # type: ignore[arg-type]
        print(f"{case:<26}{ratios[0]:>13.2f}x{ratios[1]:>11.2f}x{ratios[2]:>12.2f}x{ratios[3]:>12.2f}x")


def print_table(rows: list[dict[str, object]]) -> None:
    header = f"{'case':<26}{'running':>8}{'sched p50':>11}{'sched p99':>11}{'upd p50':>10}{'upd p99':>10}{'us/req':>9}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['case']:<26}{r['running']:>8}{r['schedule_median_us']:>11.1f}{r['schedule_p99_us']:>11.1f}"
            f"{r['update_median_us']:>10.1f}{r['update_p99_us']:>10.1f}{r['us_per_running_request']:>9.2f}"
        )


# ---------------------------------------------------------------------------- against vLLM, interleaved
class Worker:
    """A long-lived harness process that runs one case per request (the side-by-side harness's protocol)."""

    def __init__(self, name: str, argv: list[str], cwd: Path, log: object, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.log = log
        self.process = subprocess.Popen(  # noqa: S603 -- our own harness scripts
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, bufsize=1, cwd=cwd, env=env
        )
        self._wait("@@READY")

    def _wait(self, token: str) -> str:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith(token):
                return line.strip()
            if line.startswith("@@ERROR"):
                msg = f"{self.name}: {line.strip()}"
                raise RuntimeError(msg)
        msg = f"{self.name} exited (rc={self.process.wait()})"
        raise RuntimeError(msg)

    def run(self, case: str, lifecycles: int, json_out: Path) -> dict[str, object]:
        """Run ``case``; return its result (the harness's JSON layout)."""
        assert self.process.stdin is not None
        command = {"cases": case, "lifecycles": lifecycles, "trace": True, "json_out": str(json_out)}
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        self._wait("@@DONE")
        with json_out.open(encoding="utf-8") as handle:
            result: dict[str, object] = json.load(handle)["results"][0]
        return result

    def close(self) -> None:
        """Ask the worker to quit, and wait for it."""
        try:
            assert self.process.stdin is not None
            self.process.stdin.write("quit\n")
            self.process.stdin.flush()
            self.process.wait(timeout=60)
        except (BrokenPipeError, subprocess.TimeoutExpired):
            self.process.kill()


def find_vllm(harness: Path, python: str) -> str | None:
    """Why vLLM cannot be measured here, or ``None`` when its harness and venv are ready."""
    if not (harness / "side_by_side" / "vllm_driver.py").is_file():
        return f"vLLM's side-by-side harness is not at {harness} (see --vllm-harness)"
    if not Path(python).is_file():
        return f"no vLLM venv at {python} (make one with {harness / 'setup_venv.sh'}, or see --vllm-python)"
    probe = subprocess.run([python, "-c", "import vllm"], capture_output=True, check=False)  # noqa: S603
    if probe.returncode:
        return f"{python} cannot import vllm"
    return None


def _total_median(result: dict[str, object]) -> float:
    headline: dict[str, dict[str, float]] = result["headline"]  # type: ignore[assignment]
    return headline["total_cpu"]["median_us"] if headline.get("n") else float("nan")


def _trace(result: dict[str, object]) -> list[tuple[int, ...]]:
    """The per-step (decodes, prefill tokens, batch) trace without idle steps (vLLM runs one more per lifecycle)."""
    steps: list[list[int]] = result["trace"]  # type: ignore[assignment]
    return [tuple(step) for step in steps if any(step)]


def side_by_side(args: argparse.Namespace) -> list[dict[str, object]]:
    """vLLM's harness and phasesched's driver on the same cases, interleaved (ABBA) round by round."""
    bench_dir = Path(args.vllm_harness) / "side_by_side"
    out = Path(tempfile.mkdtemp(prefix="phasesched_vs_vllm_"))
    env = {
        **os.environ,
        "VLLM_TARGET_DEVICE": "cpu",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_LOGGING_LEVEL": "WARNING",
        "OMP_NUM_THREADS": "1",
        "PYTHONHASHSEED": "0",
    }
    log = (out / "workers.log").open("a", encoding="utf-8")
    cached = args.side_by_side_cache == "on"
    vllm_argv = [args.vllm_python, "vllm_driver.py", "--serve", *([] if cached else ["--no-prefix-caching"])]
    ours_argv = [sys.executable, "ps_bench.py" if cached else str(REPO / "benchmarks" / "ps_bench_no_cache.py")]
    sides = {"vllm": Worker("vllm", vllm_argv, bench_dir, log, env)}
    sides["ours"] = Worker("ours", [*ours_argv, "--serve"], bench_dir, log, env)
    for i, source in enumerate(args.compare_pythonpath):
        other = {**env, "PYTHONPATH": str(Path(source).resolve())}
        sides[f"other{i}"] = Worker(f"other{i}", [*ours_argv, "--serve"], bench_dir, log, other)
    cases = [c for c in args.vllm_cases.split(",") if c]
    results: dict[tuple[str, str], list[dict[str, object]]] = {}
    try:
        for name, worker in sides.items():  # warm-up, discarded
            worker.run("decode-16", 1, out / f"warmup_{name}.json")
        for round_ in range(1, args.vllm_rounds + 1):
            print(f"# round {round_}/{args.vllm_rounds}", file=sys.stderr, flush=True)
            for case in cases:
                order = list(sides) if round_ % 2 else list(reversed(sides))
                for name in order:
                    result = sides[name].run(case, args.vllm_lifecycles, out / f"r{round_}_{name}_{case}.json")
                    results.setdefault((name, case), []).append(result)
    finally:
        for worker in sides.values():
            worker.close()
        log.close()
    rows = []
    for case in cases:
        vllm, ours = results[("vllm", case)], results[("ours", case)]
        row: dict[str, object] = {
            "case": case,
            "vllm_us": statistics.median(_total_median(r) for r in vllm),
            "ours_us": statistics.median(_total_median(r) for r in ours),
            "ratios": [_total_median(v) / _total_median(o) for v, o in zip(vllm, ours, strict=True)],
            "identical_batches": all(_trace(v) == _trace(o) for v, o in zip(vllm, ours, strict=True)),
        }
        for i in range(len(args.compare_pythonpath)):
            other = results[(f"other{i}", case)]
            row[f"other{i}_us"] = statistics.median(_total_median(r) for r in other)
            row[f"other{i}_over_ours"] = [_total_median(b) / _total_median(o) for b, o in zip(other, ours, strict=True)]
        rows.append(row)
    print(f"results in {out}", file=sys.stderr)
    return rows


def print_ratio_table(rows: list[dict[str, object]], others: list[str]) -> None:
    """Case, vLLM and phasesched median CPU us per step, the ratio's median and range over rounds."""
    header = f"{'case':<14}{'vLLM us/step':>14}{'ours us/step':>14}{'vLLM/ours':>11}{'range':>14}{'batches':>11}"
    for i in range(len(others)):
        header += f"{f'other{i} us':>13}{f'other{i}/ours':>14}"
    print(header)
    print("-" * len(header))
    for r in rows:
        ratios: list[float] = r["ratios"]  # type: ignore[assignment]
        line = (
            f"{r['case']:<14}{r['vllm_us']:>14,.0f}{r['ours_us']:>14,.1f}{statistics.median(ratios):>10.1f}x"
            f"{f'{min(ratios):.1f}-{max(ratios):.1f}':>14}{'identical' if r['identical_batches'] else 'DIFFER':>11}"
        )
        for i in range(len(others)):
            speedups: list[float] = r[f"other{i}_over_ours"]  # type: ignore[assignment]
            line += f"{r[f'other{i}_us']:>13,.1f}{statistics.median(speedups):>13.1f}x"
        print(line)
    for i, source in enumerate(others):
        print(f"other{i}: phasesched imported from {source}")


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
    parser.add_argument(
        "--vllm-harness", default=str(REPO.parent / "shared" / "peers" / "vllm_sched"), help="vLLM's harness"
    )
    vllm_python = os.environ.get("VLLM_PY", "/tmp/vllm-peer/venv/bin/python")  # noqa: S108 -- setup_venv.sh's default
    parser.add_argument("--vllm-python", default=vllm_python, help="python of vLLM's venv (or $VLLM_PY)")
    parser.add_argument("--vllm-rounds", type=int, default=3, help="interleaved rounds against vLLM")
    parser.add_argument("--vllm-lifecycles", type=int, default=2, help="request lifecycles per case and round")
    parser.add_argument("--vllm-cases", default=",".join(HARNESS_CASES), help="harness cases to compare")
    parser.add_argument(
        "--side-by-side-cache",
        choices=("on", "off"),
        default="on",
        help="prefix caching of both schedulers against vLLM (on: the harness's default)",
    )
    parser.add_argument("--no-vllm", action="store_true", help="skip the comparison with vLLM")
    parser.add_argument("--only-vllm", action="store_true", help="only the comparison with vLLM")
    parser.add_argument(
        "--compare-pythonpath", action="append", default=[], metavar="SRC", help="also time phasesched from SRC"
    )
    args = parser.parse_args(argv)
    document: dict[str, object] = {"python": sys.version}
    why_not = "--no-vllm" if args.no_vllm else find_vllm(Path(args.vllm_harness), args.vllm_python)
    if why_not is None:
        print(
            "vLLM 0.32 V1 scheduler vs phasesched, CPU us per step (schedule + update), interleaved rounds, "
            f"prefix caching {args.side_by_side_cache}"
        )
        ratio_rows = side_by_side(args)
        print_ratio_table(ratio_rows, args.compare_pythonpath)
        document["vllm_side_by_side"] = ratio_rows
        print()
    else:
        print(f"vLLM not measured ({why_not}): phasesched's figures only")
    if args.only_vllm:
        if args.json:
            with Path(args.json).open("w", encoding="utf-8") as handle:
                json.dump(document, handle, indent=2)
        return 0
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
    document["rows"] = rows
    if args.json:
        with Path(args.json).open("w", encoding="utf-8") as handle:
            json.dump(document, handle, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
