"""A TCP proxy on 127.0.0.1:0 in front of a real server (the test PostgreSQL), that a test
can cut like a network failure: `cut()` drops every open connection at once (both sides
see their socket closed, as when a link or the server goes) and, until `restore()`, a new
connection is closed as soon as it is accepted (the client's handshake never gets an
answer). Bytes pass through untouched otherwise."""

from __future__ import annotations

import asyncio
import contextlib
from urllib.parse import urlsplit, urlunsplit

CHUNK = 65536
CONNECT_TIMEOUT_S = 10.0


class TcpProxy:
    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.port = 0
        self.accepted = 0  # connections let through
        self.refused = 0  # connections closed because the proxy was cut
        self._cut = False
        self._server: asyncio.Server | None = None
        self._open: set[asyncio.StreamWriter] = set()
        self._pipes: set[asyncio.Task[None]] = set()

    @classmethod
    def for_url(cls, url: str) -> TcpProxy:
        parts = urlsplit(url)
        return cls(parts.hostname or "127.0.0.1", parts.port or 5432)

    def url(self, url: str) -> str:
        """`url` pointing at this proxy instead of the server."""
        parts = urlsplit(url)
        user = f"{parts.username}@" if parts.username else ""
        return urlunsplit((parts.scheme, f"{user}127.0.0.1:{self.port}", parts.path, parts.query, parts.fragment))

    async def __aenter__(self) -> TcpProxy:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for pipe in list(self._pipes):
            pipe.cancel()
        await asyncio.gather(*self._pipes, return_exceptions=True)

    def cut(self) -> None:
        self._cut = True
        for writer in list(self._open):
            writer.transport.abort()  # no FIN handshake: the peer sees a reset
        self._open.clear()

    def restore(self) -> None:
        self._cut = False

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._cut:
            self.refused += 1
            writer.transport.abort()
            return
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                up_reader, up_writer = await asyncio.open_connection(*self.target)
        except (OSError, TimeoutError):
            writer.transport.abort()
            return
        self.accepted += 1
        self._open.update((writer, up_writer))
        for src, dst in ((reader, up_writer), (up_reader, writer)):
            pipe = asyncio.ensure_future(self._pipe(src, dst))
            self._pipes.add(pipe)
            pipe.add_done_callback(self._pipes.discard)

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while data := await src.read(CHUNK):
                dst.write(data)
                await dst.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            self._open.discard(dst)
            with contextlib.suppress(OSError, RuntimeError):
                dst.close()
