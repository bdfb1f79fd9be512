"""The short line a person sees while tools run ("reading notes.md…", SPEC §5.1)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import PurePosixPath
from typing import Any

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


# Per tool: its arguments (parsed, possibly empty) → the line. Tools not listed (MCP
# tools, tools added later) get "running <name>…".
STATUS_LINES: dict[str, Callable[[dict[str, Any]], str]] = {
    "read_file": _reading,
    "memory_search": lambda _args: "searching memory…",
    "memory_write": lambda _args: "writing a note…",
    "current_time": lambda _args: "checking the time…",
}


def _line(call: ToolCall) -> str:
    describe = STATUS_LINES.get(call.name)
    if describe is None:
        return f"running {call.name}…"
    try:
        args = json.loads(call.arguments or "{}")
    except ValueError:
        args = {}
    return describe(args if isinstance(args, dict) else {})


def tool_status(calls: Sequence[ToolCall]) -> str:
    """One line for the tool calls of a step: "reading a.md, searching memory…"."""
    lines = list(dict.fromkeys(_line(call) for call in calls))  # in order, without repeats
    if not lines:
        return "working…"
    text = lines[0] if len(lines) == 1 else ", ".join(line.rstrip("…") for line in lines) + "…"
    return text if len(text) <= MAX_STATUS_CHARS else text[:MAX_STATUS_CHARS - 1] + "…"
