"""`memory_search`: full-text search over this scope's long-term memory (MEMORY.md, daily
notes) and this session's earlier turns (SPEC §5)."""

from __future__ import annotations

from typing import Any

from gateway.memory.files import Memory
from gateway.tools.base import ToolContext, ToolError, ToolOutput

MAX_QUERY_CHARS = 400
DEFAULT_LIMIT = 8
MAX_LIMIT = 20


def scope_memory(ctx: ToolContext) -> Memory:
    memory = ctx.memory
    if memory is None:
        raise ToolError("long-term memory is not available in this gateway")
    return memory


PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "query": {"type": "string", "description": "words to look for"},
        "limit": {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT,
                  "description": f"most results (default {DEFAULT_LIMIT})"},
    },
    "required": ["query"],
    "additionalProperties": False,
}


class MemorySearch:
    name = "memory_search"
    description = (
        "Search your long-term memory (MEMORY.md and the daily notes in memory/) and the earlier "
        "turns of this conversation, full text. Returns matches with date, source and a snippet; "
        "open a source with read_file for more. Use a few distinctive words."
    )
    parameters: dict[str, Any]

    def __init__(self) -> None:
        self.parameters = PARAMETERS

    async def run(self, args: dict[str, Any], ctx: ToolContext) -> ToolOutput:
        query = args.get("query")
        if not isinstance(query, str) or not query.strip():
            raise ToolError("query must be a non-empty string")
        query = query.strip()[:MAX_QUERY_CHARS]
        limit = args.get("limit", DEFAULT_LIMIT)
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise ToolError(f"limit must be an integer from 1 to {MAX_LIMIT}")
        limit = min(limit, MAX_LIMIT)
        hits = await scope_memory(ctx).search(ctx.scope, ctx.session_key, query, limit=limit)
        if not hits:
            return ToolOutput(
                f"No results for {query!r} in MEMORY.md, the daily notes or this conversation's "
                "earlier turns."
            )
        lines = [f"{len(hits)} result{'s' if len(hits) != 1 else ''} for {query!r}:"]
        for n, hit in enumerate(hits, start=1):
            lines.append(f"{n}. [{hit.date}] {hit.source}: {hit.snippet}")
        return ToolOutput("\n".join(lines))
