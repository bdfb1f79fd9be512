"""`read_file`: a workspace file from a line or a character offset (SPEC §4.1, §5).

Results are cut by stage 1 like any tool result, but the notice points at the file
itself (no copy is saved), so every notice can be followed with another read_file call.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from context.truncate import read_window
from gateway.tools.base import FileRef, ToolContext, ToolError, ToolOutput
from gateway.workspace import PathNotAllowed, resolve_in_workspace

MAX_FILE_BYTES = 50 * 1024 * 1024


def _read(path: Path) -> str:
    if not path.is_file():
        raise ToolError("no such file (paths are relative to your workspace)")
    if path.stat().st_size > MAX_FILE_BYTES:
        raise ToolError(f"the file is larger than {MAX_FILE_BYTES // (1024 * 1024)} MB")
    # newline="" keeps CRLF as it is, so offsets match the bytes on disk.
    with path.open("r", encoding="utf-8", errors="replace", newline="") as fh:
        return fh.read()


class ReadFile:
    name = "read_file"
    description = (
        "Read a text file in your workspace (saved tool results in tool_results/, notes in memory/, "
        "archived conversation in dialog/, files people sent in files/). Long results are cut with a "
        "notice that gives the exact read_file call to continue. Use start_line (1-based) or offset "
        "(character offset) to continue."
    )
    parameters: dict[str, Any] = {
        "type": "object",
        "properties": {
            "path": {"type": "string", "description": "path relative to the workspace"},
            "start_line": {"type": "integer", "minimum": 1},
            "offset": {"type": "integer", "minimum": 0},
        },
        "required": ["path"],
        "additionalProperties": False,
    }

    async def run(self, args: dict[str, Any], ctx: ToolContext) -> ToolOutput:
        rel = args.get("path")
        offset, start_line = args.get("offset"), args.get("start_line")
        for name, value in (("offset", offset), ("start_line", start_line)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ToolError(f"{name} must be a non-negative integer")
        try:
            target = resolve_in_workspace(ctx.workspace, rel if isinstance(rel, str) else "")
        except PathNotAllowed as err:
            raise ToolError(str(err)) from None
        text = await asyncio.to_thread(_read, target)
        window, start_offset, first_line = read_window(text, offset=offset, start_line=start_line)
        root = await asyncio.to_thread(Path(ctx.workspace).resolve)
        rel_path = target.relative_to(root).as_posix()
        ref = FileRef(path=rel_path, start_offset=start_offset, start_line=first_line,
                      protected=rel_path.lower().endswith(".md"))
        return ToolOutput(window, file_ref=ref)
