"""The tools the agent offers, by name, with their schemas."""

from __future__ import annotations

import importlib
from typing import Any

from gateway.config import Config
from gateway.tools.base import Tool, schema
from gateway.tools.current_time import CurrentTime
from gateway.tools.read_file import ReadFile


def _optional(module: str, cls: str) -> Tool | None:
    try:
        return getattr(importlib.import_module(module), cls)()
    except (ImportError, AttributeError):
        return None


class ToolRegistry:
    def __init__(self, tools: list[Tool]) -> None:
        self._tools = {t.name: t for t in tools}
        self._schemas = [schema(t) for t in tools]

    @classmethod
    def default(cls, cfg: Config) -> ToolRegistry:
        tools: list[Tool] = [ReadFile(), CurrentTime()]
        for module, name in (
            ("gateway.tools.memory_search", "MemorySearch"),
            ("gateway.tools.memory_write", "MemoryWrite"),
        ):
            tool = _optional(module, name)
            if tool is not None:
                tools.append(tool)
        return cls(tools)

    def get(self, name: str) -> Tool | None:
        return self._tools.get(name)

    @property
    def names(self) -> list[str]:
        return list(self._tools)

    def schemas(self) -> list[dict[str, Any]]:
        """The same list object every call, so token counts and request prefixes stay stable."""
        return self._schemas
