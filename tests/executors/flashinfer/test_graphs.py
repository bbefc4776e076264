"""The CUDA-graph decode path on the CPU stand-in, which enforces the graph rules."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
import torch

pytest.importorskip("phasesched_flashinfer", reason="install executors/flashinfer")

from phasesched_flashinfer import FlashInferExecutor, StaleGraphBufferError
from phasesched_flashinfer._check import check_workloads, lockstep_compare
from phasesched_flashinfer._graphs import DecodeGraphs
from phasesched_flashinfer._timing import decode_plan
from phasesched_torch import LlamaModel
from tests.executors.flashinfer import fake_flashinfer
from tests.executors.flashinfer.helpers import CPU_MODEL, FAKE
from tests.executors.torch.helpers import synthetic_plan

NUM_PAGES, PAGE_SIZE = 64, 4
BUCKETS = (1, 2, 4, 8)


def _executors(model: LlamaModel) -> tuple[FlashInferExecutor, FlashInferExecutor, fake_flashinfer.CpuGraphRuntime]:
    """An eager executor and a graph one on the stand-in, sharing ``model``; and the graphs' runtime."""
    runtime = fake_flashinfer.CpuGraphRuntime()
    eager = FlashInferExecutor(model, num_pages=NUM_PAGES, page_size=PAGE_SIZE, kernels=FAKE)
    graphs = FlashInferExecutor(
        model,
        num_pages=NUM_PAGES,
        page_size=PAGE_SIZE,
        kernels=FAKE,
        use_cuda_graph=True,
        graph_batch_sizes=BUCKETS,
        graph_runtime=runtime,
    )
    return eager, graphs, runtime


def _graphs_vs_eager(graphs: FlashInferExecutor, eager: FlashInferExecutor) -> tuple[bool, int, int]:
    """Lockstep of the graph executor against the eager one: passed, decode-only steps, replays."""
    report = None
    for requests, policy in check_workloads(CPU_MODEL.vocab_size, chunked_prompts=(3, 9, 21), chunk_size=8):
        report = lockstep_compare(
            eager, graphs, requests, policy, num_pages=NUM_PAGES, page_size=PAGE_SIZE, rel_tol=1e-2, report=report
        )
    assert report is not None
    assert graphs.graphs is not None
    return report.passed, report.decode_only_steps, graphs.graphs.replays


class TestGraphsAgainstEager:
    def test_replays_match_eager_decodes(self) -> None:
        """Every decode-only step replays a graph, and the tokens and logits are the eager executor's."""
        eager, graphs, runtime = _executors(LlamaModel.random(CPU_MODEL, seed=3, dtype=torch.bfloat16, std=0.05))
        passed, decode_only, replays = _graphs_vs_eager(graphs, eager)
        assert passed
        assert replays == decode_only > 0
        assert len(runtime.graphs) == len(BUCKETS)
        assert torch.count_nonzero(graphs.kv_cache[0][NUM_PAGES]) > 0  # padding rows wrote the scratch page

    def test_a_buffer_reallocated_between_replays_is_refused(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """A planted bug that reallocates a bucket's static inputs before a replay fails loudly, naming it."""
        _, graphs, _ = _executors(LlamaModel.random(CPU_MODEL, seed=3, dtype=torch.bfloat16))
        assert graphs.graphs is not None
        prepare = DecodeGraphs._prepare

        def reallocating_prepare(self: DecodeGraphs, size: int, static: torch.Tensor, *args: object) -> object:
            bucket = self._graphs[size]
            bucket.static = torch.zeros_like(static)  # the bug: a new buffer every step
            return prepare(self, size, bucket.static, *args)  # type: ignore[arg-type]

        monkeypatch.setattr(DecodeGraphs, "_prepare", reallocating_prepare)
        with pytest.raises(StaleGraphBufferError, match=r"\['static'\]"):
            graphs.execute(decode_plan(3, 9, page_size=PAGE_SIZE, vocab_size=CPU_MODEL.vocab_size))

    def test_inputs_written_outside_the_captured_buffers_fail_the_comparison(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A planted bug that stages a step into the eager buffer, not the graph's, replays stale inputs."""
        model = LlamaModel.random(CPU_MODEL, seed=3, dtype=torch.bfloat16, std=0.05)
        eager, graphs, _ = _executors(model)
        assert graphs.graphs is not None
        staging = graphs.backend.staging
        upload = type(staging).upload
        monkeypatch.setattr(type(staging), "upload", lambda self, meta, target=None: upload(self, meta))
        passed, _, replays = _graphs_vs_eager(graphs, eager)
        assert replays > 0
        assert not passed


class TestStandInRules:
    def test_graph_wrapper_serves_only_its_batch_size(self) -> None:
        """A graph-mode decode wrapper refuses a step of another batch size than its buffers fix."""
        workspace = torch.zeros(16, dtype=torch.uint8)
        wrapper = fake_flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace,
            "NHD",
            use_cuda_graph=True,
            paged_kv_indptr_buffer=torch.zeros(5, dtype=torch.int32),
            paged_kv_indices_buffer=torch.zeros(8, dtype=torch.int32),
            paged_kv_last_page_len_buffer=torch.zeros(4, dtype=torch.int32),
            backend="fa2",
        )
        indptr, last = torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([1, 1], dtype=torch.int32)
        with pytest.raises(ValueError, match="a 2-slice step on a graph of 4"):
            wrapper.plan(
                indptr,
                torch.tensor([0, 1], dtype=torch.int32),
                last,
                4,
                1,
                128,
                4,
                q_data_type=torch.bfloat16,
                kv_data_type=torch.bfloat16,
            )

    def test_plan_inside_a_capture_is_refused(self) -> None:
        """plan() is not capturable: the stand-in runtime refuses a step that plans inside its capture."""
        executor = FlashInferExecutor(
            LlamaModel.random(CPU_MODEL, dtype=torch.bfloat16), num_pages=8, page_size=PAGE_SIZE, kernels=FAKE
        )
        plan = synthetic_plan([5], [1], [[0, 1]], page_size=PAGE_SIZE)
        with pytest.raises(ValueError, match="cannot run inside a CUDA graph capture"):
            fake_flashinfer.CpuGraphRuntime().capture(lambda: executor.logits(plan), {})
