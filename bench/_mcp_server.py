"""The MCP server of `bench/tools.py`, written with the SDK's FastMCP.

    python bench/_mcp_server.py [--results FILE] [--http PORT]

Over stdio by default, over streamable HTTP on 127.0.0.1:PORT with `--http`. Tools:

- `echo(text)`: the text back (the round-trip measurement's small call);
- `memory_search(query, call)` and `read_file(path, call)`: the workload's recorded
  result of tool call `call` (an id `<turn>_<index>`), read from `--results` (JSON:
  id → {"tool", "args", "result"}). A call whose tool or arguments are not the recorded
  ones is an error, so a replay that drifted from the workload shows up as errors.

Imports nothing from the repository: it starts as fast as any FastMCP server.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from mcp.server.fastmcp import FastMCP


def build(results: dict[str, dict[str, Any]], port: int) -> FastMCP:
    server = FastMCP("bench", host="127.0.0.1", port=port, log_level="WARNING")

    def recorded(tool: str, call: str, args: dict[str, Any]) -> str:
        record = results.get(call)
        if record is None:
            raise ValueError(f"no recorded tool call {call!r}")
        if record["tool"] != tool or record["args"] != args:
            raise ValueError(f"call {call} was {record['tool']}({record['args']}), not {tool}({args})")
        return str(record["result"])

    # Plain text content only (no structured copy of the same text): the client reads the text.
    @server.tool(structured_output=False)
    def echo(text: str) -> str:
        """Repeat the text back."""
        return text

    @server.tool(structured_output=False)
    def memory_search(query: str, call: str) -> str:
        """Search long-term memory and this chat's history (the recorded answer of `call`)."""
        return recorded("memory_search", call, {"query": query})

    @server.tool(structured_output=False)
    def read_file(path: str, call: str) -> str:
        """Read a workspace file (the recorded answer of `call`)."""
        return recorded("read_file", call, {"path": path})

    return server


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--results", type=Path, default=None, help="recorded tool results (JSON)")
    parser.add_argument("--http", type=int, default=None, help="serve streamable HTTP on this port")
    args = parser.parse_args()
    results = json.loads(args.results.read_text(encoding="utf-8")) if args.results else {}
    server = build(results, args.http or 8000)
    server.run("streamable-http" if args.http else "stdio")


if __name__ == "__main__":
    main()
