"""Optuna for search spaces too large to sweep: TPE picks which candidates get a capacity search.

Each trial names a policy, a chunk size and token budget (when the policy takes them) and a GPU
layout; its value is the candidate's goodput per GPU at capacity. Trials are asked for in
batches as large as the pool, so the capacity searches still run side by side, and a candidate
asked for twice is measured once. With a fixed ``seed`` the study, hence the answer, is
reproducible on any backend.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from phasesched.errors import PhaseschedError
from phasesched.tune.capacity import Probe
from phasesched.tune.space import Candidate, SearchSpace, layouts

__all__ = ["optuna_search"]

Outcome = tuple[Probe | None, bool]
Measure = Callable[[Sequence[Candidate]], list[Outcome]]


def _suggest(trial: Any, space: SearchSpace, workers: int, takes: Callable[[str, str], bool]) -> Candidate:
    policy = trial.suggest_categorical("policy", list(space.policies))
    chunk = trial.suggest_categorical("chunk", list(space.chunks)) if takes(policy, "chunk_size") else None
    budget = (
        trial.suggest_categorical("budget", list(space.budgets)) if takes(policy, "max_num_batched_tokens") else None
    )
    shapes = {s.label: s for s in layouts(workers, aggregated=space.aggregated, disaggregated=space.disaggregated)}
    return Candidate(policy, chunk, budget, shapes[trial.suggest_categorical("layout", list(shapes))])


def optuna_search(  # noqa: PLR0913 -- the space, how to measure, and the study's size
    space: SearchSpace,
    workers: int,
    takes: Callable[[str, str], bool],
    measure: Measure,
    *,
    trials: int,
    batch: int,
    seed: int,
) -> dict[Candidate, Outcome]:
    """Run ``trials`` TPE trials in batches of ``batch``; return every measured candidate's outcome.

    Raises:
        MissingExtraError: Optuna is not installed.
    """
    try:
        import optuna  # noqa: PLC0415 -- an optional extra
    except ImportError:
        from phasesched.report import MissingExtraError  # noqa: PLC0415 -- avoids an import cycle

        msg = "--search optuna needs Optuna: pip install 'phasesched[tune]'"
        raise MissingExtraError(msg) from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=seed))
    done: dict[Candidate, Outcome] = {}
    asked = 0
    while asked < trials:
        pending = [study.ask() for _ in range(min(batch, trials - asked))]
        asked += len(pending)
        picks = [_suggest(t, space, workers, takes) for t in pending]
        new = list(dict.fromkeys(c for c in picks if c not in done))
        done.update(zip(new, measure(new), strict=True))
        for trial, candidate in zip(pending, picks, strict=True):
            study.tell(trial, _value(done[candidate], candidate))
    if not done:
        msg = "the Optuna study measured no candidate"
        raise PhaseschedError(msg)
    return done


def _value(outcome: Outcome, candidate: Candidate) -> float:
    found, _ = outcome
    if found is None:
        return 0.0
    return found.rate * found.verdict.attainment / candidate.layout.workers
