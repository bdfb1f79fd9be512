"""A local web site for web_fetch: pages are added by the test, every request is recorded.

Binds 127.0.0.1 only; a slow page waits at most its `delay` (or until the site stops), an
endless page streams until the client hangs up or `ENDLESS_CAP` bytes went out.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest_asyncio
from aiohttp import web

ENDLESS_CAP = 64 * 1024 * 1024
ENDLESS_CHUNK = 64 * 1024


@dataclass
class Page:
    body: bytes = b""
    content_type: str | None = "text/html; charset=utf-8"
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    delay: float = 0.0
    endless: bool = False  # stream `body` over and over: a body with no end


@dataclass
class Seen:
    path: str
    host: str
    headers: dict[str, str]


class FakeWeb:
    def __init__(self) -> None:
        self.pages: dict[str, Page] = {}
        self.seen: list[Seen] = []
        self.sent_bytes: dict[str, int] = {}  # path → body bytes written (endless pages)
        self.base_url = ""  # http://127.0.0.1:PORT
        self.port = 0
        self._stopping = asyncio.Event()
        self._runner: web.AppRunner | None = None

    def page(self, path: str, body: str | bytes = b"", content_type: str | None = "text/html; charset=utf-8",
             **options: object) -> str:
        """Serve `body` at `path`; returns the page's URL."""
        data = body.encode() if isinstance(body, str) else body
        self.pages[path] = Page(body=data, content_type=content_type, **options)  # type: ignore[arg-type]
        return self.base_url + path

    def redirect(self, path: str, location: str, status: int = 302) -> str:
        return self.page(path, b"", content_type=None, status=status, headers={"Location": location})

    def paths(self) -> list[str]:
        return [s.path for s in self.seen]

    async def start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._serve)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]
        self.base_url = f"http://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        self._stopping.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _serve(self, request: web.Request) -> web.StreamResponse:
        self.seen.append(Seen(request.path, request.host, dict(request.headers)))
        page = self.pages.get(request.path)
        if page is None:
            return web.Response(status=404, text="not found")
        if page.delay:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), page.delay)
        headers = dict(page.headers)
        if page.content_type is not None:
            headers["Content-Type"] = page.content_type
        if not page.endless:
            response = web.Response(status=page.status, body=page.body, headers=headers)
            if page.content_type is None:
                response.headers.popall("Content-Type", None)
            return response
        stream = web.StreamResponse(status=page.status, headers=headers)
        await stream.prepare(request)
        chunk = (page.body or b"x") * max(1, ENDLESS_CHUNK // max(1, len(page.body or b"x")))
        sent = 0
        try:
            while sent < ENDLESS_CAP and not self._stopping.is_set():
                await stream.write(chunk)
                sent += len(chunk)
                self.sent_bytes[request.path] = sent
        except (ConnectionError, RuntimeError):  # the client hung up: what web_fetch should do
            pass
        return stream


@pytest_asyncio.fixture
async def fake_web() -> AsyncIterator[FakeWeb]:
    site = FakeWeb()
    await site.start()
    yield site
    await site.stop()
