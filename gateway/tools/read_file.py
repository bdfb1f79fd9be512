"""`read_file`: a workspace file from a line or a character offset (SPEC §4.1, §5).

Results are cut by stage 1 like any tool result, but the notice points at the file
itself (no copy is saved), so every notice can be followed with another read_file call.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from context.truncate import read_window
from gateway.tools.base import FileRef, ToolArgumentError, ToolContext, ToolError, ToolOutput, check_arguments, shown
from gateway.workspace import PathNotAllowed, resolve_in_workspace

MAX_FILE_BYTES = 50 * 1024 * 1024
MAX_PATH_CHARS = 1024  # far beyond any real workspace path, well under the system's limit


def _read(path: Path, rel: str) -> str:
    try:
        if path.is_dir():
            raise ToolError(f"{shown(rel)} is a directory, not a file")
        if not path.is_file():
            raise ToolError("no such file (paths are relative to your workspace)")
        if path.stat().st_size > MAX_FILE_BYTES:
            raise ToolError(f"the file is larger than {MAX_FILE_BYTES // (1024 * 1024)} MB")
        # newline="" keeps CRLF as it is, so offsets match the bytes on disk.
        with path.open("r", encoding="utf-8", errors="replace", newline="") as fh:
            return fh.read()
    except OSError as err:
        # A name too long for the file system, a permission: the model's path, not our bug.
        raise ToolError(f"cannot read the path {shown(rel)}: {err.strerror or type(err).__name__}") from None


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
        check_arguments(self.parameters, args)
        rel: str = args["path"]
        offset, start_line = args.get("offset"), args.get("start_line")
        if offset is not None and start_line is not None:
            raise ToolArgumentError("give either offset or start_line, not both")
        if len(rel) > MAX_PATH_CHARS:
            raise ToolArgumentError(f"the path is {len(rel):,} characters long; paths in the workspace "
                                    f"are at most {MAX_PATH_CHARS:,}")
        try:
            target = resolve_in_workspace(ctx.workspace, rel)
        except PathNotAllowed as err:
            raise ToolError(str(err)) from None
        text = await asyncio.to_thread(_read, target, rel)
        window, start_offset, first_line = read_window(text, offset=offset, start_line=start_line)
        root = await asyncio.to_thread(Path(ctx.workspace).resolve)
        rel_path = target.relative_to(root).as_posix()
        ref = FileRef(path=rel_path, start_offset=start_offset, start_line=first_line,
                      protected=rel_path.lower().endswith(".md"))
        return ToolOutput(window, file_ref=ref)
