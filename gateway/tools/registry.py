"""The tools the agent offers, by name, with their schemas.

Built-in tools are fixed at start. Everything else comes from a `ToolSource`: a small
object that owns some tools and may change them while the gateway runs (MCP servers
connecting and dying, a web tool switched on by a config reload). The registry asks the
sources for their version at every `schemas()` call and rebuilds its list only when one
changed, so between changes it hands out the same list object (token counts and
request prefixes stay stable, SPEC §5 "prompt stability").
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any, Protocol

from gateway.config.schema import Config
from gateway.tools.base import Tool, schema
from gateway.tools.current_time import CurrentTime
from gateway.tools.read_file import ReadFile


class ToolSource(Protocol):
    """Tools that come and go while the gateway runs.

    `version` changes (e.g. increments) whenever `tools()` would return something else;
    `tools()` returns them in a stable order (the same tools give the same order and the
    same schemas, whatever order they appeared in)."""

    name: str

    @property
    def version(self) -> int: ...

    def tools(self) -> Sequence[Tool]: ...


def _optional(module: str, cls: str) -> Tool | None:
    try:
        return getattr(importlib.import_module(module), cls)()
    except (ImportError, AttributeError):
        return None


class ToolRegistry:
    def __init__(self, tools: list[Tool], sources: Sequence[ToolSource] = ()) -> None:
        self._builtin = list(tools)
        self._sources: list[ToolSource] = list(sources)
        self._seen: tuple[int, ...] | None = None  # the sources' versions the list was built from
        self._tools: dict[str, Tool] = {}
        self._schemas: list[dict[str, Any]] = []
        self._refresh()

    @classmethod
    def default(cls, cfg: Config) -> ToolRegistry:
        tools: list[Tool] = [ReadFile(), CurrentTime()]
        for module, name in (
            ("gateway.tools.memory_search", "MemorySearch"),
            ("gateway.tools.memory_write", "MemoryWrite"),
            ("gateway.tools.tasks", "ScheduleTask"),
            ("gateway.tools.tasks", "ListTasks"),
            ("gateway.tools.tasks", "CancelTask"),
            ("gateway.tools.delegate", "Delegate"),
        ):
            tool = _optional(module, name)
            if tool is not None:
                tools.append(tool)
        return cls(tools)

    def add_source(self, source: ToolSource) -> None:
        """Sources are listed after the built-ins, in the order they were added."""
        self._sources.append(source)
        self._seen = None

    def remove_source(self, source: ToolSource) -> None:
        self._sources = [s for s in self._sources if s is not source]
        self._seen = None

    @property
    def sources(self) -> list[ToolSource]:
        return list(self._sources)

    def _refresh(self) -> None:
        versions = tuple(s.version for s in self._sources)
        if versions == self._seen:
            return
        tools: dict[str, Tool] = {t.name: t for t in self._builtin}
        for source in self._sources:
            for tool in source.tools():
                tools.setdefault(tool.name, tool)  # a built-in (or earlier source) keeps its name
        self._tools = tools
        self._schemas = [schema(t) for t in tools.values()]
        self._seen = versions

    def get(self, name: str) -> Tool | None:
        self._refresh()
        return self._tools.get(name)

    @property
    def names(self) -> list[str]:
        self._refresh()
        return list(self._tools)

    def schemas(self) -> list[dict[str, Any]]:
        """The same list object every call while no source changed, so token counts and
        request prefixes stay stable."""
        self._refresh()
        return self._schemas
