"""An MCP server (the SDK's FastMCP) whose upstream refuses its key. As it starts it
reports the refusal on stderr with the keys it tried, as real servers do on an auth error:
the configured one (from UPSTREAM_KEY) and a built-in fallback the gateway never saw.
Then it exits before answering the handshake."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from mcp.server.fastmcp import FastMCP

FALLBACK_KEY = "sk-fallback-0123456789abcdef"

log = logging.getLogger("upstream")


@asynccontextmanager
async def upstream_session(_server: FastMCP) -> AsyncIterator[None]:
    key = os.environ.get("UPSTREAM_KEY", "")
    log.error("upstream refused the key %s with HTTP 401; the fallback %s too", key, FALLBACK_KEY)
    logging.shutdown()
    os._exit(1)  # a refused key ends the server at once, as such servers do
    yield  # never reached


def main() -> None:
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    FastMCP("refused", lifespan=upstream_session, log_level="WARNING").run()


if __name__ == "__main__":
    main()
