"""The short line a person sees while tools run ("reading notes.md…", SPEC §5.1).

A tool that has its own `status(args)` (MCP tools, web_fetch, web_search) says it
itself; the built-ins are described by the table below; anything else reads "running
<name>…"."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import PurePosixPath
from typing import Any

from gateway.tools.base import Tool, status_line
from gateway.types import ToolCall

MAX_STATUS_CHARS = 120
_MAX_PATH_CHARS = 48


def _reading(args: dict[str, Any]) -> str:
    path = args.get("path")
    if not isinstance(path, str) or not path.strip():
        return "reading a file…"
    shown = path.strip()
    if len(shown) > _MAX_PATH_CHARS:  # the name says enough; a long path would crowd the line
        shown = PurePosixPath(shown).name[-_MAX_PATH_CHARS:] or shown[-_MAX_PATH_CHARS:]
    return f"reading {shown}…"


# Per built-in tool: its arguments (parsed, possibly empty) → the line.
STATUS_LINES: dict[str, Callable[[dict[str, Any]], str]] = {
    "read_file": _reading,
    "memory_search": lambda _args: "searching memory…",
    "memory_write": lambda _args: "writing a note…",
    "current_time": lambda _args: "checking the time…",
}


def _line(call: ToolCall, tool: Tool | None) -> str:
    try:
        parsed = json.loads(call.arguments or "{}")
    except ValueError:
        parsed = {}
    args: dict[str, Any] = parsed if isinstance(parsed, dict) else {}
    if tool is not None and callable(getattr(tool, "status", None)):
        return status_line(tool, args)
    describe = STATUS_LINES.get(call.name)
    return describe(args) if describe is not None else f"running {call.name}…"


def tool_status(calls: Sequence[ToolCall], lookup: Callable[[str], Tool | None] | None = None) -> str:
    """One line for the tool calls of a step: "reading a.md, searching memory…".
    `lookup` finds a call's tool by name (the registry), so its own `status` is used."""
    lines = list(dict.fromkeys(_line(call, lookup(call.name) if lookup else None) for call in calls))
    if not lines:
        return "working…"
    text = lines[0] if len(lines) == 1 else ", ".join(line.rstrip("…") for line in lines) + "…"
    return text if len(text) <= MAX_STATUS_CHARS else text[:MAX_STATUS_CHARS - 1] + "…"
