"""phasesched: prefill/decode scheduling policies, a paged KV manager, and the tools to measure them.

The core loop is three verbs::

    scheduler.add_request(request)
    plan = scheduler.schedule(now)        # an immutable StepPlan with FlashInfer-layout metadata
    result = executor.execute(plan)       # any object with execute(plan) -> StepResult
    outcome = scheduler.update(plan, result)

``import phasesched`` never imports torch.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from phasesched.engine import Engine as Engine
from phasesched.engine import FailurePolicy as FailurePolicy
from phasesched.engine import VirtualClock as VirtualClock
from phasesched.engine import WallClock as WallClock
from phasesched.errors import DuplicateNameError as DuplicateNameError
from phasesched.errors import DuplicateRequestError as DuplicateRequestError
from phasesched.errors import InvalidArgumentError as InvalidArgumentError
from phasesched.errors import InvalidPlanError as InvalidPlanError
from phasesched.errors import InvalidRequestError as InvalidRequestError
from phasesched.errors import InvalidResultError as InvalidResultError
from phasesched.errors import OutOfPagesError as OutOfPagesError
from phasesched.errors import PhaseschedError as PhaseschedError
from phasesched.errors import PlanInFlightError as PlanInFlightError
from phasesched.errors import RequestRejectedError as RequestRejectedError
from phasesched.errors import UnknownNameError as UnknownNameError
from phasesched.errors import UnknownRequestError as UnknownRequestError
from phasesched.errors import UnknownTableError as UnknownTableError
from phasesched.executor import DeterministicExecutor as DeterministicExecutor
from phasesched.executor import Executor as Executor
from phasesched.executor import StepResult as StepResult
from phasesched.kv import KVView as KVView
from phasesched.kv import PagedKVManager as PagedKVManager
from phasesched.plan import ScheduledPiece as ScheduledPiece
from phasesched.plan import StepPlan as StepPlan
from phasesched.policies import PolicyOptions as PolicyOptions
from phasesched.policies import SchedulingPolicy as SchedulingPolicy
from phasesched.registry import EXECUTORS as EXECUTORS
from phasesched.registry import POLICIES as POLICIES
from phasesched.registry import Registry as Registry
from phasesched.request import SLO as SLO
from phasesched.request import FinishReason as FinishReason
from phasesched.request import Phase as Phase
from phasesched.request import Request as Request
from phasesched.request import RequestStatus as RequestStatus
from phasesched.request import SamplingParams as SamplingParams
from phasesched.scheduler import FinishedRequest as FinishedRequest
from phasesched.scheduler import Scheduler as Scheduler
from phasesched.scheduler import SchedulerConfig as SchedulerConfig
from phasesched.scheduler import StepOutcome as StepOutcome
from phasesched.selection import Selection as Selection

try:
    __version__ = version("phasesched")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"


def load_policy(name: str, options: PolicyOptions | None = None) -> SchedulingPolicy:
    """Build the policy registered as ``name`` (a preset or a plugin's).

    >>> load_policy("sarathi").chunker
    FixedChunk(size=512)
    """
    factory = POLICIES.get(name)
    policy = factory(options or PolicyOptions())
    if not isinstance(policy, SchedulingPolicy):
        msg = f"policy plugin {name!r} returned {type(policy).__name__}, not a SchedulingPolicy"
        raise InvalidArgumentError(msg)
    return policy


__all__ = [
    "EXECUTORS",
    "POLICIES",
    "SLO",
    "DeterministicExecutor",
    "DuplicateNameError",
    "DuplicateRequestError",
    "Engine",
    "Executor",
    "FailurePolicy",
    "FinishReason",
    "FinishedRequest",
    "InvalidArgumentError",
    "InvalidPlanError",
    "InvalidRequestError",
    "InvalidResultError",
    "KVView",
    "OutOfPagesError",
    "PagedKVManager",
    "Phase",
    "PhaseschedError",
    "PlanInFlightError",
    "PolicyOptions",
    "Registry",
    "Request",
    "RequestRejectedError",
    "RequestStatus",
    "SamplingParams",
    "ScheduledPiece",
    "Scheduler",
    "SchedulerConfig",
    "SchedulingPolicy",
    "Selection",
    "StepOutcome",
    "StepPlan",
    "StepResult",
    "UnknownNameError",
    "UnknownRequestError",
    "UnknownTableError",
    "VirtualClock",
    "WallClock",
    "__version__",
    "load_policy",
]
