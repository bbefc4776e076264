"""The plain ``python`` blocks of README.md and docs/ run, so they cannot drift from the API.

Blocks with ``>>>`` are doctests, which pytest already runs (``--doctest-glob=*.md``). Every other
block runs as it stands, unless a rule in ``RULES`` says otherwise: run it after a setup that binds
the names a fragment leaves free, check it line by line against the file it is an excerpt of, run
it only where torch is installed, or skip it for a stated reason. A rule names its block by a
substring, and must match exactly one block, so rules cannot go stale.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_FENCE = re.compile(r"^(?P<fence>`{3,}|~{3,})python[ \t]*\n(?P<code>.*?)^(?P=fence)[ \t]*$", re.MULTILINE | re.DOTALL)


@dataclass(frozen=True)
class Block:
    """One fenced ``python`` block of a Markdown file."""

    path: str
    line: int
    code: str


@dataclass(frozen=True)
class Rule:
    """How to check the one block of ``path`` that contains ``contains``."""

    path: str
    contains: str
    setup: str = ""
    excerpt_of: str = ""
    needs_torch: bool = False
    skip: str = ""


LOOP = """
from phasesched import DeterministicExecutor, Request, Scheduler, SchedulerConfig, load_policy

scheduler = Scheduler(SchedulerConfig(num_pages=64, page_size=16), load_policy("vllm"))
scheduler.add_request(Request("r0", prompt_len=20, max_new_tokens=3))
executor = DeterministicExecutor()
now = 0.0
"""

RULES = (
    Rule("docs/explanation/scheduler.md", "plan = scheduler.schedule(now)", setup=LOOP),
    Rule("docs/how-to/engine-loop.md", "plan = scheduler.schedule(now)", setup=LOOP),
    Rule(
        "docs/get-started.md",
        '"bench-results/20260101-120000/results.json"',
        setup='from phasesched.cli import main\nmain(["bench", "mixed", "--quiet", "--no-plots", "--output", '
        '"bench-results/20260101-120000"])',
    ),
    Rule("docs/how-to/executor.md", "class Executor(Protocol):", excerpt_of="src/phasesched/executor.py"),
    Rule("docs/how-to/executor.md", "wrapper.plan(plan.qo_indptr", skip="a sketch of FlashInfer's API (a GPU)"),
    Rule("docs/how-to/executor.md", 'EXECUTORS.get("torch")', needs_torch=True),
    Rule("docs/how-to/executor.md", 'EXECUTORS.get("flashinfer")', skip="needs FlashInfer and an NVIDIA GPU"),
    Rule("docs/how-to/vllm.md", "from vllm import LLM", skip="needs vLLM, a model and a GPU"),
    Rule(
        "docs/how-to/policy-plugin.md",
        "class ShortestJobFirst:",
        excerpt_of="examples/custom_policy/src/phasesched_sjf/__init__.py",
    ),
    Rule(
        "docs/how-to/policy-plugin.md",
        "def sjf(options",
        excerpt_of="examples/custom_policy/src/phasesched_sjf/__init__.py",
    ),
    Rule(
        "docs/how-to/replay-trace.md",
        "workload = load_trace(path)",
        setup=f"""
from phasesched import load_policy
from phasesched.sim import load_trace, simulate

path = {str(ROOT / "data/traces/AzureLLMInferenceTrace_conv.csv")!r}
minutes, rate_scale, policies = 0.1, 1.0, ["vllm"]
""",
    ),
)


def _blocks() -> list[Block]:
    files = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md") if "_build" not in p.parts)]
    blocks = []
    for file in files:
        text = file.read_text(encoding="utf-8")
        for match in _FENCE.finditer(text):
            code = match["code"]
            if ">>>" not in code:  # a doctest: pytest's doctest-glob runs it
                line = text.count("\n", 0, match.start()) + 1
                blocks.append(Block(str(file.relative_to(ROOT)), line, code))
    return blocks


BLOCKS = _blocks()


def _rule_for(block: Block) -> Rule | None:
    matching = [rule for rule in RULES if rule.path == block.path and rule.contains in block.code]
    assert len(matching) <= 1, f"{block.path}:{block.line} matches {len(matching)} rules"
    return matching[0] if matching else None


def _is_excerpt(code: str, source: str) -> bool:
    """Whether every line of ``code`` appears in ``source`` in order (``: ...`` elides a body)."""
    lines = iter(line.strip() for line in source.splitlines())
    for wanted in (line.strip() for line in code.splitlines()):
        if wanted and not any(line == wanted.removesuffix(" ...") for line in lines):
            return False
    return True


class TestCoverage:
    def test_every_rule_matches_one_block(self) -> None:
        """A rule whose block was edited away or duplicated fails, instead of silently skipping."""
        for rule in RULES:
            hits = [b for b in BLOCKS if b.path == rule.path and rule.contains in b.code]
            assert len(hits) == 1, f"rule {rule.path}: {rule.contains!r} matches {len(hits)} blocks"

    def test_readme_loop_runs_as_written(self) -> None:
        """The README's 'The loop' block is run as it stands, with no setup."""
        loops = [b for b in BLOCKS if b.path == "README.md" and "scheduler.update(plan" in b.code]
        assert len(loops) == 1
        assert _rule_for(loops[0]) is None


@pytest.mark.parametrize("block", BLOCKS, ids=[f"{b.path}:{b.line}" for b in BLOCKS])
def test_snippet(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The block runs (after its rule's setup), or is a verbatim excerpt of its source file."""
    rule = _rule_for(block) or Rule(block.path, "")
    if rule.skip:
        pytest.skip(rule.skip)
    if rule.excerpt_of:
        source = (ROOT / rule.excerpt_of).read_text(encoding="utf-8")
        assert _is_excerpt(block.code, source), f"{block.path}:{block.line} is no longer in {rule.excerpt_of}"
        return
    if rule.needs_torch:
        pytest.importorskip("torch")
        pytest.importorskip("phasesched_torch")
    monkeypatch.chdir(tmp_path)  # a snippet that writes files writes them here
    namespace: dict[str, object] = {"__name__": "__snippet__"}
    exec(compile(rule.setup, f"{block.path} (setup)", "exec"), namespace)  # noqa: S102 -- running the docs is the test
    exec(compile(block.code, f"{block.path}:{block.line}", "exec"), namespace)  # noqa: S102
