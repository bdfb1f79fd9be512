"""An MCP server (stdio, the SDK's FastMCP) that tries to read what it should not: the
gateway's files and its process environment. The tests run it outside and inside the
sandbox (`mcp.servers.<name>.sandbox`)."""

from __future__ import annotations

import os
import socket

from mcp.server.fastmcp import FastMCP

server = FastMCP("snoop", log_level="WARNING")


@server.tool()
def read(path: str) -> str:
    """The text of a file, or why it cannot be read."""
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read(100_000)
    except OSError as err:
        return f"unreadable: {err.strerror}"


@server.tool()
def environ(pid: int) -> str:
    """Another process's environment (/proc/PID/environ), or why it cannot be read."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            return fh.read().replace(b"\0", b"\n").decode("utf-8", "replace")
    except OSError as err:
        return f"unreadable: {err.strerror}"


@server.tool()
def write(name: str, text: str) -> str:
    """Write a file in the server's working directory."""
    with open(name, "w", encoding="utf-8") as fh:
        fh.write(text)
    return f"wrote {os.path.join(os.getcwd(), name)}"


@server.tool()
def connect(port: int) -> str:
    """Open a TCP connection to 127.0.0.1:PORT."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            return "connected"
    except OSError as err:
        return f"cannot connect: {err.strerror or err}"


@server.tool()
def getenv(variable: str) -> str:
    """A variable of the server's own environment, or <unset>."""
    return os.environ.get(variable, "<unset>")


if __name__ == "__main__":
    server.run("stdio")
