"""Sampling: the inverse-CDF sampler's distribution and filters, and seeded reproducibility in an engine."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
import numpy as np
import torch

from phasesched import PolicyOptions, SamplingParams, load_policy
from phasesched_torch import RequestSampler, create_executor, sample_tokens, uniform_for
from tests.executors.torch.helpers import EngineRun, make_requests, random_prompts, run_engine

N_DRAWS = 4000
TIGHT_PAGES = 8  # the longest request needs 8 pages of 4 tokens; three together need 19


def draw_grid(logits: torch.Tensor, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """Token frequencies when ``u`` sweeps a regular grid of [0, 1): exactly the sampled distribution."""
    u = (torch.arange(N_DRAWS, dtype=torch.float64) + 0.5) / N_DRAWS
    rows = logits.expand(N_DRAWS, -1)
    tokens = sample_tokens(
        rows, torch.full((N_DRAWS,), temperature), torch.full((N_DRAWS,), top_k), torch.full((N_DRAWS,), top_p), u
    )
    return np.bincount(tokens.numpy(), minlength=logits.shape[-1]) / N_DRAWS


class TestSampleTokens:
    def test_temperature_distribution(self) -> None:
        """Frequencies over a uniform grid equal softmax(logits / T)."""
        logits = torch.tensor([1.0, -0.5, 2.0, 0.3, 0.0, -2.0])
        freq = draw_grid(logits, temperature=0.7)
        np.testing.assert_allclose(freq, torch.softmax(logits / 0.7, -1).numpy(), atol=2 / N_DRAWS)

    def test_top_k_renormalises_over_the_k_best(self) -> None:
        """Top-k draws only the k most likely tokens, in proportion to their renormalised probabilities."""
        logits = torch.tensor([1.0, -0.5, 2.0, 0.3, 0.0, -2.0])
        freq = draw_grid(logits, top_k=3)
        kept = torch.tensor([0, 2, 3])
        expected = np.zeros(6)
        expected[kept] = torch.softmax(logits[kept], -1).numpy()
        np.testing.assert_allclose(freq, expected, atol=2 / N_DRAWS)

    @pytest.mark.parametrize(("top_p", "kept"), [(0.8, [0, 1]), (0.81, [0, 1, 2]), (0.3, [0]), (1.0, [0, 1, 2, 3])])
    def test_top_p_keeps_the_smallest_prefix_reaching_p(self, top_p: float, kept: list[int]) -> None:
        """With probabilities .5/.3/.15/.05, top-p keeps the tokens whose preceding mass is below p."""
        logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
        freq = draw_grid(logits, top_p=top_p)
        expected = np.zeros(4)
        expected[kept] = np.array([0.5, 0.3, 0.15, 0.05])[kept] / sum(np.array([0.5, 0.3, 0.15, 0.05])[kept])
        np.testing.assert_allclose(freq, expected, atol=2 / N_DRAWS)

    def test_degenerate_filters_are_greedy(self) -> None:
        """top_k=1, or a tiny top_p, always picks the arg-max; greedy rows ignore their draw."""
        logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(0))
        u = torch.rand(16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        argmax = logits.argmax(-1)
        ones, zeros = torch.ones(16), torch.zeros(16, dtype=torch.int64)
        assert torch.equal(sample_tokens(logits, ones, torch.ones(16, dtype=torch.int64), ones, u), argmax)
        assert torch.equal(sample_tokens(logits, ones, zeros, torch.full((16,), 1e-6), u), argmax)
        assert torch.equal(sample_tokens(logits, torch.zeros(16), zeros, ones, u), argmax)

    def test_uniform_depends_on_seed_and_position_only(self) -> None:
        """The seeded draw is a pure function of (seed, position), different for different inputs."""
        assert uniform_for(7, 12) == uniform_for(7, 12)
        draws = {uniform_for(seed, pos) for seed in (0, 1, -3) for pos in (0, 1, 1000)}
        assert len(draws) == 9
        assert all(0.0 <= u < 1.0 for u in draws)


def sampled_run(
    *,
    seed_param: int | None,
    num_pages: int,
    page_size: int = 4,
    chunk: int = 16,
    executor_seed: int = 0,
    sampling: SamplingParams | None = None,
) -> EngineRun:
    executor = create_executor(model="tiny", num_pages=num_pages, page_size=page_size, seed=executor_seed)
    params = sampling or SamplingParams(temperature=1.0, top_k=50, top_p=0.95, seed=seed_param)
    prompts = random_prompts((9, 14, 20), 512, seed=3)
    requests = make_requests(prompts, 10, sampling=params)
    return run_engine(
        executor,
        load_policy("sarathi", PolicyOptions(chunk_size=chunk)),
        requests,
        num_pages=num_pages,
        page_size=page_size,
    )


class TestSeededSamplingInTheEngine:
    def test_reproducible_across_runs(self) -> None:
        """Two fresh engines with the same seeds produce the same tokens; another seed does not."""
        first = sampled_run(seed_param=11, num_pages=64).outputs()
        assert sampled_run(seed_param=11, num_pages=64).outputs() == first
        assert sampled_run(seed_param=12, num_pages=64).outputs() != first

    def test_not_greedy(self) -> None:
        """Sampling at temperature 1 actually departs from greedy decoding."""
        greedy = sampled_run(seed_param=None, num_pages=64, sampling=SamplingParams()).outputs()
        assert sampled_run(seed_param=11, num_pages=64).outputs() != greedy

    def test_reproducible_across_preemption_and_batching(self) -> None:
        """A request preempted and recomputed, in other batches and chunks, draws the same tokens."""
        roomy = sampled_run(seed_param=5, num_pages=64, chunk=16)
        tight = sampled_run(seed_param=5, num_pages=TIGHT_PAGES, chunk=7)
        assert roomy.num_preemptions == 0
        assert tight.num_preemptions > 0, "the tight cache was meant to force preemption"
        assert tight.outputs() == roomy.outputs()

    def test_unseeded_requests_follow_the_executor_seed(self) -> None:
        """Without a request seed, draws come from the executor's seeded stream."""
        first = sampled_run(seed_param=None, num_pages=64, executor_seed=1).outputs()
        assert sampled_run(seed_param=None, num_pages=64, executor_seed=1).outputs() == first
        assert sampled_run(seed_param=None, num_pages=64, executor_seed=2).outputs() != first

    def test_parameters_reach_each_request(self) -> None:
        """Each request samples by its own parameters: greedy takes the arg-max, top-k stays in the top k."""
        executor = create_executor(model="tiny", num_pages=64, page_size=4)
        prompts = random_prompts((6, 11), 512, seed=4)
        greedy, top3 = make_requests(prompts, 12)
        top3 = type(top3)(
            top3.request_id,
            prompt_token_ids=top3.prompt_token_ids,
            max_new_tokens=12,
            sampling=SamplingParams(temperature=2.0, top_k=3, seed=1),
        )
        run = run_engine(
            executor, load_policy("sarathi", PolicyOptions(chunk_size=8)), [greedy, top3], num_pages=64, page_size=4
        )
        outputs = run.outputs()
        for logits, token in zip(run.logits["r0"], outputs["r0"], strict=True):
            assert token == int(logits.argmax())
        ranks = [
            int((logits > logits[token]).sum()) for logits, token in zip(run.logits["r1"], outputs["r1"], strict=True)
        ]
        assert max(ranks) < 3
        assert max(ranks) > 0, "a temperature-2 top-3 draw never left the arg-max in 12 tokens"


class TestRequestSampler:
    def test_tracks_new_and_released_requests(self) -> None:
        """Parameters arrive with plan.new_requests and leave with plan.released (delivered in a later plan)."""
        from phasesched import Scheduler, SchedulerConfig  # noqa: PLC0415

        executor = create_executor(model="tiny", num_pages=16, page_size=4)
        scheduler = Scheduler(SchedulerConfig(num_pages=16, page_size=4))
        for request in make_requests([[1, 2, 3], [4, 5]], 2, sampling=SamplingParams(temperature=1.0, seed=3)):
            scheduler.add_request(request)
        plan = scheduler.schedule()
        scheduler.update(plan, executor.execute(plan))
        assert executor.sampler.num_tracked == 2
        assert executor.sampler.params("r0").seed == 3
        while scheduler.num_unfinished:
            plan = scheduler.schedule()
            scheduler.update(plan, executor.execute(plan))
        idle = scheduler.schedule()
        assert idle.is_empty
        assert set(idle.released) == {"r0", "r1"}
        executor.execute(idle)
        assert executor.sampler.num_tracked == 0

    def test_unknown_requests_are_greedy(self) -> None:
        """A request the sampler never saw (a synthetic profiler plan) samples greedily."""
        sampler = RequestSampler()
        logits = torch.randn(3, 20)
        assert torch.equal(sampler.sample(logits, ["a", "b", "c"], [1, 2, 3]), logits.argmax(-1))
