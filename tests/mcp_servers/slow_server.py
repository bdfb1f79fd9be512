"""A real MCP server (stdio, the SDK's FastMCP) whose one tool takes its time, and writes
down what happened to each call, so a test sees a cancellation on the server's side.

Run as `python slow_server.py NOTES`: the tool `wait(seconds)` appends "started" to the
file NOTES, then "finished" when its time is up, or "cancelled" when the client cancelled
the call (MCP's `notifications/cancelled`)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from mcp.server.fastmcp import FastMCP


def build(notes: Path) -> FastMCP:
    server = FastMCP("slow", log_level="WARNING")

    def note(line: str) -> None:
        with notes.open("a", encoding="utf-8") as f:
            f.write(line + "\n")

    @server.tool()
    async def wait(seconds: float) -> str:
        """Answers after `seconds`."""
        note("started")
        try:
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            note("cancelled")
            raise
        note("finished")
        return "waited"

    return server


if __name__ == "__main__":
    build(Path(sys.argv[1])).run("stdio")
