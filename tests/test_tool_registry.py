"""The registry: built-ins first, then sources; one list object while nothing changed."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gateway.tools.base import Tool, ToolContext, ToolOutput
from gateway.tools.registry import ToolRegistry


class Named:
    def __init__(self, name: str) -> None:
        self.name = name
        self.description = f"the {name} tool"
        self.parameters: dict[str, Any] = {"type": "object", "properties": {}}

    async def run(self, args: dict[str, Any], ctx: ToolContext) -> ToolOutput:
        return ToolOutput(self.name)


class Source:
    name = "test"

    def __init__(self) -> None:
        self.version = 0
        self._tools: list[Tool] = []

    def set(self, *names: str) -> None:
        self._tools = [Named(n) for n in sorted(names)]
        self.version += 1

    def tools(self) -> Sequence[Tool]:
        return self._tools


def test_sources_follow_builtins_and_the_list_is_stable_between_changes() -> None:
    source = Source()
    registry = ToolRegistry([Named("read_file")], [source])
    first = registry.schemas()
    assert [s["function"]["name"] for s in first] == ["read_file"]
    assert registry.schemas() is first
    source.set("b__x", "a__y")
    changed = registry.schemas()
    assert changed is not first
    assert [s["function"]["name"] for s in changed] == ["read_file", "a__y", "b__x"]
    assert registry.schemas() is changed
    assert registry.get("a__y") is not None and registry.get("gone") is None
    source.set("a__y")  # a server died: only its tools go
    assert registry.names == ["read_file", "a__y"]


def test_a_source_cannot_shadow_a_builtin() -> None:
    source = Source()
    builtin = Named("read_file")
    registry = ToolRegistry([builtin], [source])
    source.set("read_file")
    assert registry.get("read_file") is builtin
    assert len(registry.schemas()) == 1
