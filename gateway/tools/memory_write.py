"""`memory_write`: keep a fact in today's daily note or in MEMORY.md (SPEC §4.6, §5)."""

from __future__ import annotations

from typing import Any

from gateway.memory.files import MEMORY_FILE, NOTES_DIR
from gateway.tools.base import ToolContext, ToolError, ToolOutput
from gateway.tools.memory_search import scope_memory
from gateway.workspace import PathNotAllowed

MAX_TEXT_CHARS = 4000
TARGETS = ("daily", "memory")


PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "text": {"type": "string", "description": f"what to keep (at most {MAX_TEXT_CHARS} characters)"},
        "target": {"type": "string", "enum": list(TARGETS)},
    },
    "required": ["text", "target"],
    "additionalProperties": False,
}


class MemoryWrite:
    name = "memory_write"
    description = (
        "Keep something for later: target 'daily' appends to today's note (memory/YYYY-MM-DD.md, "
        "merged into MEMORY.md every night); target 'memory' appends to MEMORY.md, which is shown "
        "to you in every conversation, so keep it for lasting facts and preferences."
    )
    parameters: dict[str, Any]

    def __init__(self) -> None:
        self.parameters = PARAMETERS

    async def run(self, args: dict[str, Any], ctx: ToolContext) -> ToolOutput:
        text, target = args.get("text"), args.get("target")
        if not isinstance(text, str) or not text.strip():
            raise ToolError("text must be a non-empty string")
        if len(text) > MAX_TEXT_CHARS:
            raise ToolError(f"text is {len(text)} characters; keep it under {MAX_TEXT_CHARS}")
        if target not in TARGETS:
            raise ToolError("target must be 'daily' or 'memory'")
        memory = scope_memory(ctx)
        try:
            if target == "daily":
                path = await memory.append_daily(ctx.scope, text)
                where = f"{NOTES_DIR}/{path.name}"
            else:
                await memory.append_memory_md(ctx.scope, text)
                where = MEMORY_FILE
        except PathNotAllowed as err:
            raise ToolError(f"cannot write memory: {err}") from None
        except (NotADirectoryError, IsADirectoryError) as err:  # memory/ or the note made something else
            raise ToolError(f"cannot write memory: {err.filename or 'the note'} is in the way "
                            f"({err.strerror})") from None
        return ToolOutput(f"Saved to {where}.")
