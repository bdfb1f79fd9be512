"""The tool contract: a JSON schema for the model and an async `run`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

# The engine owns the file reference type (context/ imports nothing from the shell);
# tools name it from here as before.
from context.truncate import FileRef

if TYPE_CHECKING:
    from gateway.config.schema import Config
    from gateway.memory.files import Memory
    from gateway.skills.catalog import Skills
    from gateway.tools.tasks import TaskBook
    from gateway.types import Inbound


@dataclass(frozen=True, slots=True)
class ToolContext:
    """What a tool may touch: one scope's workspace and one session."""

    session_key: str
    scope: str
    workspace: Path
    config: Config
    memory: Memory | None = None  # long-term memory (memory_search)
    tasks: TaskBook | None = None  # people's scheduled tasks (schedule_task, list_tasks, cancel_task)
    inbound: Inbound | None = None  # the message that started the turn (who asked, where to answer)
    skills: Skills | None = None  # the skills this turn's agent may read under skills/ (SPEC §5.6)
    # Runs a sub-turn for `delegate` (SPEC §5.8): (task, agent or None) → its final answer;
    # None inside a sub-turn, which cannot delegate further.
    delegate: Callable[[str, str | None], Awaitable[ToolOutput]] | None = None


@dataclass(frozen=True, slots=True)
class ToolImage:
    """An image a tool returned, still base64 as it came: the agent decodes and saves it
    under files/ off the loop (SPEC §5.2)."""

    name: str  # the file name to save it as, e.g. mcp_echo_picture_1.png
    mime: str
    data: str  # base64


@dataclass(frozen=True, slots=True)
class ToolOutput:
    text: str
    file_ref: FileRef | None = None
    images: tuple[ToolImage, ...] = ()
    # Where the text came from when it is outside content (SPEC §5.7): "web page <url>",
    # "MCP server <name>"…; the request shows it fenced as data (context/outside.py).
    source: str | None = None


class ToolError(Exception):
    """A failure the model should see as the tool's result (bad args, missing file)."""


class ToolArgumentError(ToolError):
    """The call's arguments were wrong; the message says which and how to call again."""


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
    "array": (list,), "object": (dict,),
}
_SHOWN_CHARS = 60  # how much of a bad value an error repeats back


def shown(value: Any) -> str:
    """A bad value as an error repeats it: short, so a huge argument is not echoed whole."""
    text = repr(value)
    return text if len(text) <= _SHOWN_CHARS else f"{text[:_SHOWN_CHARS]}… ({len(text):,} characters)"


def check_arguments(parameters: dict[str, Any], args: dict[str, Any]) -> None:
    """Check `args` against the parts of a tool's JSON schema that built-in tools use
    (required, additionalProperties, type, minimum, maximum, enum); models do not always
    follow the schema they were given."""
    properties: dict[str, Any] = parameters.get("properties", {})
    for name in parameters.get("required", ()):
        if args.get(name) is None:
            raise ToolArgumentError(f"the argument {name!r} is required")
    if parameters.get("additionalProperties") is False:
        unknown = sorted(set(args) - set(properties))
        if unknown:
            raise ToolArgumentError(f"unknown argument {shown(unknown[0])}; the arguments are "
                                    + ", ".join(properties))
    for name, rule in properties.items():
        value = args.get(name)
        if value is None:
            continue
        kind = rule.get("type")
        if kind in _JSON_TYPES and (not isinstance(value, _JSON_TYPES[kind])
                                    or (isinstance(value, bool) and kind != "boolean")):
            raise ToolArgumentError(f"{name} must be {'an' if kind[0] in 'aeiou' else 'a'} {kind}, "
                                    f"not {shown(value)}")
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if number and "minimum" in rule and value < rule["minimum"]:
            raise ToolArgumentError(f"{name} must be {rule['minimum']} or more, not {shown(value)}")
        if number and "maximum" in rule and value > rule["maximum"]:
            raise ToolArgumentError(f"{name} must be {rule['maximum']} or less, not {shown(value)}")
        if "enum" in rule and value not in rule["enum"]:
            raise ToolArgumentError(f"{name} must be one of {', '.join(map(repr, rule['enum']))}, "
                                    f"not {shown(value)}")


class Tool(Protocol):
    """A tool may also have `status(args) -> str`: the short line a person sees while it
    runs ("fetching example.com…"); `status_line` falls back to a generic one. And
    `files_named(args) -> list[str]`: the workspace paths the call would read, which its
    approval card shows (`files_named` below)."""

    name: str
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments

    async def run(self, args: dict[str, Any], ctx: ToolContext) -> ToolOutput: ...


def files_named(tool: Tool, args: dict[str, Any]) -> list[str]:
    """Workspace paths a call's arguments name, for its approval card (SPEC §5.7): a tool
    may have `files_named(args) -> list[str]` (exec: the files its command reads); none
    otherwise, and none when the arguments confuse it."""
    named = getattr(tool, "files_named", None)
    if not callable(named):
        return []
    try:
        found = named(args)
    except Exception:  # the arguments are the model's: a bad one must not break the turn
        return []
    return [name for name in found if isinstance(name, str)] if isinstance(found, list) else []


def status_line(tool: Tool, args: dict[str, Any]) -> str:
    """What is happening while `tool` runs, in a few words (SPEC §5.1)."""
    status = getattr(tool, "status", None)
    if callable(status):
        try:
            line = status(args)
        except Exception:  # the arguments are the model's: a bad one must not break the turn
            line = None
        if isinstance(line, str) and line.strip():
            return line.strip()
    return f"running {tool.name}…"


def schema(tool: Tool) -> dict[str, Any]:
    """The OpenAI `tools` entry for a tool."""
    return {
        "type": "function",
        "function": {"name": tool.name, "description": tool.description, "parameters": tool.parameters},
    }
