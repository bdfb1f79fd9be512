"""A real MCP server for the tests, written with the SDK's FastMCP.

Run as `python echo_server.py` (stdio) or `python echo_server.py --http PORT` (streamable
HTTP on 127.0.0.1). `--extra` adds one more tool, so a test can change what a server offers."""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
from typing import Any

from mcp.server.fastmcp import Context, FastMCP, Image
from mcp.types import EmbeddedResource, TextResourceContents

# A 1x1 PNG: the image tool returns real image content.
PNG = base64.b64decode("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8DwHwAFBQIAX8jx0g"
                       "AAAABJRU5ErkJggg==")


def big_text(chars: int) -> str:
    """`chars` characters in numbered lines, with some non-ASCII text so byte offsets matter."""
    lines: list[str] = []
    total, n = 0, 0
    while total < chars:
        line = f"line {n:06d} — données ✓ {'x' * (n % 37)}\n"
        lines.append(line)
        total += len(line)
        n += 1
    return "".join(lines)[:chars]


def build(name: str, *, extra: bool, port: int = 8000) -> FastMCP:
    server = FastMCP(name, port=port, log_level="WARNING")

    @server.tool()
    def echo(text: str) -> str:
        """Repeat the text back."""
        return f"echo: {text}"

    @server.tool()
    def pid() -> str:
        """The server's process id."""
        return str(os.getpid())

    @server.tool()
    def big(chars: int) -> str:
        """A long text of `chars` characters."""
        return big_text(chars)

    @server.tool()
    def fail(message: str) -> str:
        """Always fails with the message."""
        raise ValueError(message)

    @server.tool()
    async def slow(seconds: float) -> str:
        """Answers after `seconds`."""
        await asyncio.sleep(seconds)
        return "finally"

    @server.tool()
    def crash() -> str:
        """The server process exits at once (a dying server)."""
        os._exit(3)

    @server.tool()
    def getenv(variable: str) -> str:
        """A variable of the server's environment, or <unset>."""
        return os.environ.get(variable, "<unset>")

    @server.tool()
    def header(header_name: str, ctx: Context[Any, Any, Any]) -> str:
        """A header of the HTTP request that called this tool (HTTP servers only)."""
        request = ctx.request_context.request
        headers = getattr(request, "headers", None)
        return str(headers.get(header_name, "<missing>")) if headers is not None else "<no request>"

    @server.tool()
    def picture() -> Image:
        """A tiny PNG."""
        return Image(data=PNG, format="png")

    @server.tool()
    def record(city: str) -> dict[str, Any]:
        """Structured output: a record about a city."""
        return {"city": city, "population": 1234, "tags": ["a", "b"]}

    @server.tool()
    def document() -> EmbeddedResource:
        """An embedded text resource."""
        return EmbeddedResource(type="resource", resource=TextResourceContents(
            uri="file:///notes/readme.txt", mimeType="text/plain", text="the resource's text"))

    @server.tool(name="odd.name/with spaces")
    def odd() -> str:
        """A tool whose name providers would refuse."""
        return "odd"

    def added() -> str:
        """Only offered with --extra, or after announce(add=True)."""
        return "added"

    if extra:
        server.add_tool(added)

    @server.tool()
    async def announce(add: bool, ctx: Context[Any, Any, Any]) -> str:
        """Tell the client the tool list changed (adding `added` first when `add`)."""
        if add:
            server.add_tool(added)
        await ctx.session.send_tool_list_changed()
        return "announced"

    return server


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--http", type=int, default=None, help="serve streamable HTTP on this port")
    parser.add_argument("--name", default="echo")
    parser.add_argument("--extra", action="store_true")
    args = parser.parse_args()
    server = build(args.name, extra=args.extra, port=args.http or 8000)
    server.run("streamable-http" if args.http else "stdio")


if __name__ == "__main__":
    main()
