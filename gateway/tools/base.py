"""The tool contract: a JSON schema for the model and an async `run`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

# The engine owns the file reference type (context/ imports nothing from the shell);
# tools name it from here as before.
from context.truncate import FileRef

if TYPE_CHECKING:
    from gateway.config import Config


@dataclass(frozen=True, slots=True)
class ToolContext:
    """What a tool may touch: one scope's workspace and one session."""

    session_key: str
    scope: str
    workspace: Path
    config: Config
    services: Any = None  # gateway.app.Services: store, memory (set by the agent)


@dataclass(frozen=True, slots=True)
class ToolOutput:
    text: str
    file_ref: FileRef | None = None


class ToolError(Exception):
    """A failure the model should see as the tool's result (bad args, missing file)."""


class Tool(Protocol):
    name: str
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments

    async def run(self, args: dict[str, Any], ctx: ToolContext) -> ToolOutput: ...


def schema(tool: Tool) -> dict[str, Any]:
    """The OpenAI `tools` entry for a tool."""
    return {
        "type": "function",
        "function": {"name": tool.name, "description": tool.description, "parameters": tool.parameters},
    }
