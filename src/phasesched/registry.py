"""Plugin registries backed by Python entry points.

Two groups: ``phasesched.policies`` (factories ``(PolicyOptions) -> SchedulingPolicy``) and
``phasesched.executors`` (executor factories). phasesched registers its own built-ins through the
same entry points in its ``pyproject.toml``, so a third-party package is a peer, not a special
case. Entry points load lazily, on first use of a name; two distributions claiming one name is
an error, and an unknown name lists the known ones.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import metadata
from typing import Any, Generic, TypeVar

from phasesched.errors import DuplicateNameError, UnknownNameError

__all__ = ["EXECUTORS", "POLICIES", "Registry"]

T = TypeVar("T")


class Registry(Generic[T]):
    """Named plugins of one kind: entry points of ``group`` plus in-process registrations.

    >>> registry: Registry[int] = Registry("example.group")
    >>> registry.register("one", 1)
    >>> registry.get("one")
    1
    >>> registry.get("two")
    Traceback (most recent call last):
    ...
    phasesched.errors.UnknownNameError: no example.group plugin named 'two'; known: one
    """

    def __init__(self, group: str) -> None:
        self.group = group
        self._entry_points: dict[str, metadata.EntryPoint] | None = None
        self._loaded: dict[str, T] = {}
        self._registered: dict[str, T] = {}

    def register(self, name: str, plugin: T) -> None:
        """Register ``plugin`` under ``name`` in this process (tests, notebooks).

        Raises:
            DuplicateNameError: ``name`` is taken by an entry point or an earlier registration.

        """
        if name in self._registered or name in self._discover():
            msg = f"{self.group} already has a plugin named {name!r}"
            raise DuplicateNameError(msg)
        self._registered[name] = plugin

    def unregister(self, name: str) -> None:
        """Remove an in-process registration (entry points cannot be removed)."""
        if self._registered.pop(name, None) is None:
            raise UnknownNameError(self._unknown(name))

    def names(self) -> list[str]:
        """Every known name, sorted."""
        return sorted({*self._discover(), *self._registered})

    def get(self, name: str) -> T:
        """The plugin called ``name``, loading its entry point on first use.

        Raises:
            UnknownNameError: No plugin has that name; the message lists those that do.

        """
        if name in self._registered:
            return self._registered[name]
        if name not in self._loaded:
            entry_point = self._discover().get(name)
            if entry_point is None:
                raise UnknownNameError(self._unknown(name))
            self._loaded[name] = entry_point.load()
        return self._loaded[name]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name in self._registered or name in self._discover())

    def _discover(self) -> dict[str, metadata.EntryPoint]:
        if self._entry_points is None:
            found: dict[str, metadata.EntryPoint] = {}
            for entry_point in metadata.entry_points(group=self.group):
                earlier = found.get(entry_point.name)
                if earlier is not None and earlier.value != entry_point.value:
                    msg = (
                        f"{self.group} plugin {entry_point.name!r} is provided twice: "
                        f"{earlier.value} and {entry_point.value}"
                    )
                    raise DuplicateNameError(msg)
                found[entry_point.name] = entry_point
            self._entry_points = found
        return self._entry_points

    def _unknown(self, name: str) -> str:
        return f"no {self.group} plugin named {name!r}; known: {', '.join(self.names()) or '(none)'}"


POLICIES: Registry[Callable[..., Any]] = Registry("phasesched.policies")
"""Policy factories — ``factory(PolicyOptions) -> SchedulingPolicy``."""

EXECUTORS: Registry[Callable[..., Any]] = Registry("phasesched.executors")
"""Executor factories — ``factory(**options) -> Executor``."""
