"""Plugin registries: entry points, duplicates, unknown names."""

from __future__ import annotations

from importlib import metadata

import pytest

from phasesched import EXECUTORS, POLICIES, DeterministicExecutor, DuplicateNameError, Registry, UnknownNameError
from phasesched.policies import presets


class TestRegistry:
    def test_builtins_come_from_entry_points(self) -> None:
        """Built-in presets and executors are registered through the same entry points as plugins."""
        assert {"vllm", "sarathi", "sglang", "orca", "no-chunk", "trtllm-equal-progress"} <= set(POLICIES.names())
        assert POLICIES.get("vllm") is presets.vllm
        assert EXECUTORS.get("deterministic") is DeterministicExecutor

    def test_unknown_name_lists_known(self) -> None:
        """An unknown name raises UnknownNameError that lists every known name."""
        with pytest.raises(UnknownNameError, match="deterministic"):
            EXECUTORS.get("warp-drive")

    def test_register_and_duplicates(self) -> None:
        """In-process registration works once per name; a second claim raises."""
        registry: Registry[int] = Registry("phasesched.test-group")
        registry.register("x", 1)
        assert registry.get("x") == 1
        assert "x" in registry
        with pytest.raises(DuplicateNameError):
            registry.register("x", 2)
        registry.unregister("x")
        assert "x" not in registry

    def test_cannot_shadow_an_entry_point(self) -> None:
        """Registering a name an installed plugin already provides raises."""
        registry = Registry[object]("phasesched.policies")
        with pytest.raises(DuplicateNameError):
            registry.register("vllm", object())

    def test_two_distributions_claiming_one_name(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Two entry points with one name but different targets raise DuplicateNameError."""
        points = [
            metadata.EntryPoint("dup", "a.b:c", "phasesched.fake"),
            metadata.EntryPoint("dup", "d.e:f", "phasesched.fake"),
        ]
        monkeypatch.setattr(metadata, "entry_points", lambda group: points)
        with pytest.raises(DuplicateNameError, match="provided twice"):
            Registry[object]("phasesched.fake").names()

    def test_plugins_load_lazily(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Listing names does not import plugin modules; get() does."""
        points = [metadata.EntryPoint("lazy", "module_that_does_not_exist:factory", "phasesched.fake")]
        monkeypatch.setattr(metadata, "entry_points", lambda group: points)
        registry = Registry[object]("phasesched.fake")
        assert registry.names() == ["lazy"]
        with pytest.raises(ModuleNotFoundError):
            registry.get("lazy")
