"""Import layering: no module-level import cycle crosses a package boundary.

A package's ``__init__`` re-exports its modules, which import one another through it: cycles
inside one package are how Python packages look. A cycle *between* packages (the scheduler's
view importing a policy while the policies import the view, the metrics recorder and summary
importing each other through a lazy import) means neither side can be read or loaded on its
own. Imports under ``if TYPE_CHECKING:`` and inside functions do not run at import time, so
only the module-level ones count.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import phasesched

SOURCE = Path(phasesched.__file__).resolve().parent.parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(SOURCE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in SOURCE.joinpath("phasesched").rglob("*.py")}


def _is_type_checking_block(node: ast.stmt) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _module_level_imports(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    """Imports that run when the module is imported: not in functions, classes or TYPE_CHECKING blocks."""
    pending: list[ast.stmt] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If | ast.Try | ast.With) and not _is_type_checking_block(node):
            pending.extend(child for child in ast.iter_child_nodes(node) if isinstance(child, ast.stmt))


def _with_parents(name: str) -> Iterator[str]:
    """``a.b.c`` and the packages importing it loads first (``a.b``); the root package is left out."""
    parts = name.split(".")
    for end in range(2, len(parts) + 1):
        yield ".".join(parts[:end])


def _imports_of(name: str, *, everywhere: bool = False) -> set[str]:
    """The package's modules ``name`` imports at import time (``everywhere``: in any place, lazily too)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    nodes = (
        (n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom))
        if everywhere
        else _module_level_imports(tree)
    )
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
            continue
        base = node.module or ""
        if node.level:
            anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join([*anchor, base] if base else anchor)
        found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names)
    return {m for target in found for m in _with_parents(target) if m in MODULES and m != name}


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root, targets in graph.items():
        if root in index:
            continue
        work = [(root, iter(sorted(targets)))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for target in edges:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(component)
    return components


def _package(name: str) -> str:
    return name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]


def test_no_import_cycle_crosses_a_package() -> None:
    graph = {name: _imports_of(name) for name in MODULES}
    crossing = [sorted(c) for c in _cycles(graph) if len({_package(m) for m in c}) > 1]
    assert crossing == []


def test_the_cycle_finder_sees_a_cycle_across_packages() -> None:
    """The check above can fail: a two-package cycle is found and reported as crossing."""
    graph = {"p.a": {"q.b"}, "q.b": {"p.a"}, "p.c": set()}
    assert _cycles(graph) == [{"p.a", "q.b"}]
    assert _cycles({"p.a": {"p.c"}, "p.c": set()}) == []


def test_the_scheduler_view_and_the_recorder_import_no_layer_above_them() -> None:
    """The two cycles this test was written for, lazy imports included: view -> policies, recorder -> summary."""
    view = _imports_of("phasesched.view", everywhere=True) - {"phasesched.policies.budget"}  # an annotation only
    assert not any(m.startswith("phasesched.policies.") for m in view)
    assert "phasesched.metrics.summary" not in _imports_of("phasesched.metrics.recorder", everywhere=True)
