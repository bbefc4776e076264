"""The simulated executor: a step takes what the cost model says and yields synthetic tokens."""

from __future__ import annotations

import attrs
import numpy as np

from phasesched.costmodel.batching import RAGGED, DecodeBatching, decode_batching_of
from phasesched.costmodel.protocol import CostModel
from phasesched.executor import StepResult
from phasesched.plan import StepPlan
from phasesched.validators import whole

__all__ = ["SimulatedExecutor", "create_simulated_executor"]


@attrs.frozen
class SimulatedExecutor:
    """Runs nothing: prices each plan with a cost model and samples token ``token_id``.

    Requests end when they reach their ``max_new_tokens`` (simulated requests ignore EOS), so
    the tokens' values never matter; the durations do.

    >>> from phasesched.costmodel import RooflineCostModel
    >>> from phasesched import Request, Scheduler, SchedulerConfig
    >>> scheduler = Scheduler(SchedulerConfig(num_pages=64))
    >>> scheduler.add_request(Request("r", prompt_len=512, max_new_tokens=4, ignore_eos=True))
    >>> plan = scheduler.schedule()
    >>> result = SimulatedExecutor(RooflineCostModel.from_names()).execute(plan)
    >>> round(result.duration_s * 1e3, 1)   # ms for a 512-token prefill on H200 + Llama-3-8B
    11.0
    """

    cost_model: CostModel
    token_id: int = attrs.field(default=0, validator=whole(ge=0, le=np.iinfo(np.int32).max))

    @property
    def decode_batching(self) -> DecodeBatching:
        """The cost model's decode batching if it declares one (a profiled table), else ragged.

        The roofline prices every slice at its own context, as a ragged kernel runs it, so a
        profile of this executor is read at the mean decode context.
        """
        return decode_batching_of(self.cost_model) or RAGGED

    def execute(self, plan: StepPlan) -> StepResult:
        """The step's duration from the cost model; a token for every slice that samples."""
        duration = self.cost_model.step_time(plan.num_new, plan.kv_len) if plan.batch_size else 0.0
        tokens = np.where(plan.samples, np.int32(self.token_id), np.int32(-1))  # int32: nothing for the result to check
        return StepResult(step_id=plan.step_id, token_ids=tokens, duration_s=duration)


def create_simulated_executor(
    *, hardware: str = "H200", model: str = "llama-3-8b", tensor_parallel: int = 1
) -> SimulatedExecutor:
    """The ``sim`` entry point: a simulated executor priced by the roofline of the named presets."""
    from phasesched.costmodel.roofline import RooflineCostModel  # noqa: PLC0415 -- keep registry imports light

    return SimulatedExecutor(RooflineCostModel.from_names(hardware, model, tensor_parallel))
