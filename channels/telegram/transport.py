"""python-telegram-bot's transport over a pooled aiohttp session.

python-telegram-bot talks to the Bot API through a `BaseRequest`; its default one uses
httpx. Under load (bench/gateway_load.py, py-spy) httpx and httpcore's pool bookkeeping
were most of the Telegram path's CPU, about twice what a whole web turn costs. The
library's documented way out is another `BaseRequest`: this one sends the same requests
with aiohttp, which the gateway already uses for everything else. Errors map to the
library's own exceptions exactly as its httpx transport maps them: `TimedOut` for a
timeout (a subclass of `NetworkError`), `NetworkError` for any other transport failure;
the status codes are judged by `BaseRequest` itself.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from telegram._utils.defaultvalue import DefaultValue
from telegram.error import NetworkError, TimedOut
from telegram.request import BaseRequest, RequestData
from yarl import URL

from gateway.http.proxy import env_proxy


class AiohttpRequest(BaseRequest):
    def __init__(self, *, pool_size: int, read_timeout: float | None = 5.0, write_timeout: float | None = 5.0,
                 connect_timeout: float | None = 5.0, pool_timeout: float | None = 1.0,
                 media_write_timeout: float | None = 20.0, proxy_for: str | None = None) -> None:
        """`proxy_for`: the Bot API's base URL, whose proxy (HTTPS_PROXY / HTTP_PROXY /
        NO_PROXY, as httpx would honour them) is looked up once, off the loop."""
        self._pool_size = pool_size
        self._proxy_for = proxy_for
        self._proxy: tuple[URL | None, aiohttp.BasicAuth | None] = (None, None)
        self._read_timeout = read_timeout
        self._write_timeout = write_timeout
        self._connect_timeout = connect_timeout
        self._pool_timeout = pool_timeout
        self._media_write_timeout = media_write_timeout
        self._session: aiohttp.ClientSession | None = None

    @property
    def read_timeout(self) -> float | None:
        return self._read_timeout

    async def initialize(self) -> None:
        if self._session is None or self._session.closed:
            if self._proxy_for:
                self._proxy = await asyncio.to_thread(env_proxy, URL(self._proxy_for))
            connector = aiohttp.TCPConnector(limit=self._pool_size)
            # No cookie jar: the Bot API sets none, and filtering cookies costs on every call.
            self._session = aiohttp.ClientSession(connector=connector, cookie_jar=aiohttp.DummyCookieJar())

    async def shutdown(self) -> None:
        session, self._session = self._session, None
        if session is not None and not session.closed:
            await session.close()

    async def do_request(
        self,
        url: str,
        method: str,
        request_data: RequestData | None = None,
        read_timeout: Any = BaseRequest.DEFAULT_NONE,
        write_timeout: Any = BaseRequest.DEFAULT_NONE,
        connect_timeout: Any = BaseRequest.DEFAULT_NONE,
        pool_timeout: Any = BaseRequest.DEFAULT_NONE,
    ) -> tuple[int, bytes]:
        session = self._session
        if session is None or session.closed:
            raise RuntimeError("This AiohttpRequest is not initialized!")
        files = request_data.multipart_data if request_data else None
        fields = request_data.json_parameters if request_data else None
        read = _chosen(read_timeout, self._read_timeout)
        write = _chosen(write_timeout, self._media_write_timeout if files else self._write_timeout)
        connect = _chosen(connect_timeout, self._connect_timeout)
        pool = _chosen(pool_timeout, self._pool_timeout)
        # aiohttp's `connect` covers the wait for a pooled connection plus the connect
        # itself; `sock_read` is the longest silence while the answer comes. aiohttp has
        # no separate write timeout: the send is covered by the read timer's start.
        timeout = aiohttp.ClientTimeout(
            total=None,
            connect=None if pool is None or connect is None else pool + connect,
            sock_connect=connect,
            sock_read=None if read is None and write is None else max(read or 0.0, write or 0.0),
        )
        body: aiohttp.FormData | dict[str, str] | None = fields
        if files:
            form = aiohttp.FormData()
            for name, value in (fields or {}).items():
                form.add_field(name, value)
            for name, (filename, content, mime) in files.items():
                form.add_field(name, content, filename=filename, content_type=mime)
            body = form
        proxy, proxy_auth = self._proxy
        try:
            async with session.request(method, url, data=body, timeout=timeout, proxy=proxy, proxy_auth=proxy_auth,
                                       headers={"User-Agent": self.USER_AGENT}) as response:
                return response.status, await response.read()
        except TimeoutError as err:
            raise TimedOut from err
        except (aiohttp.ClientError, OSError) as err:
            raise NetworkError(f"aiohttp.{err.__class__.__name__}: {err}") from err


def _chosen(value: Any, default: float | None) -> float | None:
    """A timeout the caller passed, or this transport's default for it."""
    return default if isinstance(value, DefaultValue) else value

