"""Resolve cross-references to re-exported names at the place the name is documented.

Every name is documented once, under the module that defines it (``phasesched.scheduler.Scheduler``),
but docstrings and pages spell it the way users import it (``phasesched.Scheduler``), or
unqualified inside a package that re-exports it (``CostModel`` in ``phasesched.costmodel``). When
Sphinx finds no target, this imports what the reference names and links to the documented entry
for the same object. Anything it cannot import still warns, as ``nitpicky`` wants.

The executor packages are documented at their top level, from ``__all__``. Their constants are
defined, with their docstrings, in private submodules, where autodoc does not look: for the
packages in ``reexport_packages``, ``autodata`` of a re-exported constant gets its docstring.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import TYPE_CHECKING, Any

from sphinx.pycode import ModuleAnalyzer

if TYPE_CHECKING:
    from docutils import nodes
    from sphinx.addnodes import pending_xref
    from sphinx.application import Sphinx
    from sphinx.environment import BuildEnvironment

_MISSING = object()


def _import(dotted: str) -> Any:
    """The object a dotted name refers to, or ``_MISSING``."""
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attr in parts[split:]:
            obj = getattr(obj, attr, _MISSING)
            if obj is _MISSING:
                return _MISSING
        return obj
    return _MISSING


def _documented_names(env: BuildEnvironment, obj: Any, tail: str) -> list[str]:
    """Names under which the Python domain documents ``obj``: its definition first."""
    names = []
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if isinstance(module, str) and isinstance(qualname, str):
        names.append(f"{module}.{qualname}")
    # Data (a registry instance) has no __qualname__: find a documented name bound to it.
    for name, _, _, _, _, _ in env.get_domain("py").get_objects():
        if name.rsplit(".", 1)[-1] == tail and name not in names and _import(name) is obj:
            names.append(name)
    return names


def _resolve(
    app: Sphinx, env: BuildEnvironment, node: pending_xref, contnode: nodes.TextElement
) -> nodes.reference | None:
    if node.get("refdomain") != "py":
        return None
    target = node["reftarget"].lstrip(".~")
    scopes = [node.get("py:module"), node.get("py:class")]
    candidates = [target]
    if scopes[0]:
        candidates.insert(0, f"{scopes[0]}.{target}")
        if scopes[1]:
            candidates.insert(0, f"{scopes[0]}.{scopes[1]}.{target}")
    domain = env.get_domain("py")
    for candidate in candidates:
        obj = _import(candidate)
        if obj is _MISSING:
            continue
        for name in _documented_names(env, obj, candidate.rsplit(".", 1)[-1]):
            if name == candidate:
                continue
            ref = domain.resolve_xref(env, node["refdoc"], app.builder, node["reftype"], name, node, contnode)
            if ref is not None:
                return ref
    return None


def _constant_doc(app: Sphinx, name: str, obj: Any) -> list[str]:
    """The docstring of a constant a package in ``reexport_packages`` re-exports as ``name``."""
    for package_name in app.config.reexport_packages:
        package = importlib.import_module(package_name)
        if name not in getattr(package, "__all__", ()) or getattr(package, name, _MISSING) is not obj:
            continue
        for info in pkgutil.iter_modules(package.__path__, f"{package_name}."):
            if getattr(importlib.import_module(info.name), name, _MISSING) is obj:
                doc = ModuleAnalyzer.for_module(info.name).find_attr_docs().get(("", name))
                if doc:
                    return list(doc)
    return []


def _fill_constant(  # noqa: PLR0913, PLR0917 -- the autodoc-process-docstring signature
    app: Sphinx, what: str, name: str, obj: Any, options: object, lines: list[str]
) -> None:
    del options
    # Replace what autodoc found instead: nothing, or the docstring of the value's type (dict).
    if what == "data" and (doc := _constant_doc(app, name.rsplit(".", 1)[-1], obj)):
        lines[:] = doc


def setup(app: Sphinx) -> dict[str, Any]:
    """Register the ``reexport_packages`` setting and the two handlers."""
    app.add_config_value("reexport_packages", [], "env", list)
    app.connect("missing-reference", _resolve)
    app.connect("autodoc-process-docstring", _fill_constant)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
