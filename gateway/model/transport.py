"""The chat-completions endpoint over one pooled aiohttp session.

Why not the openai SDK: measured under load (bench/gateway_load.py, py-spy), the SDK's
request building, httpx layer and response model construction were about half of the
gateway's CPU per turn, more than everything else a turn does. Streamed, it costs about
70 µs per chunk (a typed object per chunk), over 10 ms for a 200-chunk reply where plain
JSON parsing of the same events costs a few. So a completion is one JSON POST here, its
answer one JSON body or a stream of Server-Sent Events (`SseReader`). This module only
moves bytes: it raises the transport's own exceptions and returns status, headers and
bodies or events, and `gateway.model` turns them into replies and error kinds with the
same meanings the SDK's exceptions had.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import ssl
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from yarl import URL

from gateway.http.proxy import env_proxy

DEFAULT_BASE_URL = "https://api.openai.com/v1"
# Connections to the provider are not capped here: limits.max_concurrent_model_calls caps
# the calls (gateway/model/slots.py), and a streamed reply holds its connection for as long as
# the model writes, so a lower cap here would hold streams back behind whole replies.
POOL_SIZE = 0  # aiohttp: no limit
USER_AGENT = "chat-gateway"
MAX_EVENT_BYTES = 64 * 1024 * 1024  # one Server-Sent Event; a tool call's arguments can be large
DRAIN_TIMEOUT_S = 1.0  # after `[DONE]`, how long the end of the response may take to arrive


@dataclass(frozen=True, slots=True)
class RawResponse:
    status: int
    headers: Mapping[str, str]
    body: bytes


def completions_url(base_url: str | None) -> URL:
    """`{base_url}/chat/completions`, with the SDK's defaults (OPENAI_BASE_URL, then OpenAI).
    Raises ValueError for a base URL that is not http(s)."""
    base = base_url or os.environ.get("OPENAI_BASE_URL") or DEFAULT_BASE_URL
    url = URL(base.rstrip("/") + "/chat/completions")
    if url.scheme not in ("http", "https") or not url.host:
        raise ValueError(f"{base!r} is not an http(s) URL")
    if "?" in base or "#" in base:
        # The path is appended to the base (here and in the SDK), so a query string or a
        # fragment would end up in the middle of the URL: refuse it rather than mangle it.
        raise ValueError(f"{base!r} has a query string or fragment; give the plain base URL")
    return url


def transcriptions_url(base_url: str | None) -> URL:
    """`{base_url}/audio/transcriptions` (SPEC §5.4), with the same defaults and checks as
    `completions_url`."""
    chat = completions_url(base_url)
    return chat.with_path(chat.path.removesuffix("/chat/completions") + "/audio/transcriptions")


def _ssl_context() -> ssl.SSLContext:
    """The CA bundle the SDK would use (certifi comes with it), else the system's."""
    try:
        import certifi
    except ImportError:  # pragma: no cover - certifi ships with the openai SDK
        return ssl.create_default_context()
    return ssl.create_default_context(cafile=certifi.where())


class CompletionsEndpoint:
    """POSTs completion requests; open() once on the loop, close() when done."""

    def __init__(self, base_url: str | None, api_key: str | None, timeout_s: float) -> None:
        """`api_key` None: requests carry no Authorization (a server that takes no key)."""
        self.url = completions_url(base_url)
        self._headers = {
            "Content-Type": "application/json",
            "Accept": "application/json",
            "User-Agent": USER_AGENT,
        }
        if api_key is not None:
            self._headers["Authorization"] = f"Bearer {api_key}"
        # The SDK's other environment settings, so switching transports changes nothing.
        for env, header in (("OPENAI_ORG_ID", "OpenAI-Organization"), ("OPENAI_PROJECT_ID", "OpenAI-Project")):
            if os.environ.get(env):
                self._headers[header] = os.environ[env]
        self._timeout = aiohttp.ClientTimeout(total=None, connect=timeout_s, sock_read=timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._proxy: tuple[URL | None, aiohttp.BasicAuth | None] = (None, None)
        self._lock = asyncio.Lock()
        self._closed = False
        self._tools_json: tuple[object, bytes] | None = None  # the registry's schema list, by identity
        self._messages = MessageJson()

    async def open(self) -> None:
        """Idempotent; concurrent callers (the warm-up and the first turns) share one session."""
        async with self._lock:
            if self._session is not None:
                return
            if self._closed:
                raise aiohttp.ClientConnectionError("the model endpoint was closed")
            # CA certificates and proxy settings come from files and the environment: read them
            # once, off the loop (aiohttp's trust_env would look the proxy up on every request).
            context = await asyncio.to_thread(_ssl_context) if self.url.scheme == "https" else None
            self._proxy = await asyncio.to_thread(env_proxy, self.url)
            connector = aiohttp.TCPConnector(limit=POOL_SIZE, ssl=context if context is not None else True)
            self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout)

    async def close(self) -> None:
        """Close the pool; a call after this fails as a connection error (never reopens)."""
        self._closed = True
        async with self._lock:
            if self._session is not None:
                session, self._session = self._session, None
                await session.close()

    async def _opened(self) -> aiohttp.ClientSession:
        session = self._session
        if session is None:
            await self.open()
            session = self._session
            assert session is not None
        return session

    async def post(self, body: dict[str, Any]) -> RawResponse:
        """One attempt. Raises aiohttp.ClientError, OSError or TimeoutError when no
        complete HTTP response arrives."""
        session = await self._opened()
        payload = self._encode(body)
        proxy, proxy_auth = self._proxy
        async with session.post(self.url, data=payload, headers=self._headers, proxy=proxy,
                                      proxy_auth=proxy_auth) as response:
            data = await response.read()
            return RawResponse(status=response.status, headers=response.headers, body=data)

    @contextlib.asynccontextmanager
    async def stream(self, body: dict[str, Any]) -> AsyncIterator[aiohttp.ClientResponse]:
        """One streamed attempt (`body` asks for `"stream": true`): the response once its
        headers are in; read its events with `SseReader(response.content)`. Left early
        (an error, a cancelled turn), the connection is closed rather than reused."""
        session = await self._opened()
        payload = self._encode(body)
        proxy, proxy_auth = self._proxy
        async with session.post(self.url, data=payload, headers=self._stream_headers, proxy=proxy,
                                proxy_auth=proxy_auth) as response:
            try:
                yield response
            except BaseException:
                response.close()
                raise
            if not response.content.at_eof():
                # After `[DONE]` only the end of the body should follow; read it so the
                # connection can be reused, but never wait on a server that keeps it open.
                try:
                    async with asyncio.timeout(DRAIN_TIMEOUT_S):
                        while await response.content.readany():
                            pass
                except (aiohttp.ClientError, OSError, TimeoutError):
                    response.close()

    @property
    def _stream_headers(self) -> dict[str, str]:
        return {**self._headers, "Accept": "text/event-stream"}

    def _encode(self, body: dict[str, Any]) -> bytes:
        """The request as JSON bytes. The tool schemas are the registry's one list, the same
        on every call: their JSON is made once and spliced in. So are the messages: the
        context engine hands the same dict for a message request after request (a turn's
        rendering is cached), so each one's JSON is made once (`MessageJson`). ASCII escapes
        keep a lone surrogate valid JSON."""
        tools = body.get("tools")
        messages = body.get("messages")
        rest = json.dumps({k: v for k, v in body.items() if k not in ("tools", "messages")}).encode()
        pieces = [rest[:-1]]
        if isinstance(messages, list):
            pieces += [b', "messages": ', self._messages.encode(messages)]
        if tools:
            if self._tools_json is None or self._tools_json[0] is not tools:
                self._tools_json = (tools, json.dumps(tools).encode())
            pieces += [b', "tools": ', self._tools_json[1]]
        pieces.append(b"}")
        return b"".join(pieces)


class MessageJson:
    """The JSON of request messages, remembered by object: a dict seen before (the same
    object, which the caller never changes once sent) is not encoded again.

    Two generations bound it: lookups promote from the older one, and the newer one is
    retired once it holds `limit` entries or `max_bytes` of JSON, so at most about twice
    that is held. A message larger than `max_item_bytes` is encoded every time. Each entry
    holds its dict, so an id is never reused while it is remembered."""

    # Sized for about 100 sessions answering at once (a request re-sends its session's
    # ~40 recent messages): a quarter of it cost 5 % more CPU per turn at 100 sessions.
    # Process-wide and bounded (~2 MB of JSON and the dicts it holds).
    def __init__(self, limit: int = 4096, max_bytes: int = 1 << 20, max_item_bytes: int = 16384) -> None:
        self._limit = limit
        self._max_bytes = max_bytes
        self._max_item = max_item_bytes
        self._new: dict[int, tuple[dict[str, Any], bytes]] = {}
        self._old: dict[int, tuple[dict[str, Any], bytes]] = {}
        self._new_bytes = 0

    def encode(self, messages: list[dict[str, Any]]) -> bytes:
        return b"[" + b", ".join([self._one(m) for m in messages]) + b"]"

    def _one(self, message: dict[str, Any]) -> bytes:
        key = id(message)
        hit = self._new.get(key)
        if hit is not None and hit[0] is message:
            return hit[1]
        hit = self._old.get(key)
        if hit is None or hit[0] is not message:
            hit = (message, json.dumps(message).encode())
            if len(hit[1]) > self._max_item:
                return hit[1]
        if len(self._new) >= self._limit or self._new_bytes >= self._max_bytes:
            self._old, self._new, self._new_bytes = self._new, {}, 0
        self._new[key] = hit
        self._new_bytes += len(hit[1])
        return hit[1]


class SseReader:
    """Server-Sent Events from a response body, as `(event name or "", data)`.

    Lines end in LF or CRLF; `:` comments (keep-alives such as OpenRouter's
    ": OPENROUTER PROCESSING") are skipped; several `data:` lines of one event are joined
    with newlines. Raises ValueError for an event larger than MAX_EVENT_BYTES, and the
    transport's exceptions as they come."""

    def __init__(self, content: aiohttp.StreamReader) -> None:
        self._content = content
        self._buffer = b""
        self._lines: list[bytes] = []
        self._data: list[bytes] = []
        self._event = b""
        self._eof = False

    def __aiter__(self) -> SseReader:
        return self

    async def __anext__(self) -> tuple[str, str]:
        while True:
            while self._lines:
                line = self._lines.pop()
                if line.endswith(b"\r"):
                    line = line[:-1]
                if not line:
                    if self._data:
                        return self._dispatch()
                    self._event = b""
                    continue
                if line.startswith(b":"):
                    continue
                name, _, value = line.partition(b":")
                if value.startswith(b" "):
                    value = value[1:]
                if name == b"data":
                    self._data.append(value)
                elif name == b"event":
                    self._event = value
            if self._eof:
                if self._data:  # a last event without its blank line
                    return self._dispatch()
                raise StopAsyncIteration
            chunk = await self._content.readany()
            if not chunk:
                self._eof = True
                if self._buffer:
                    self._lines.append(self._buffer)
                    self._buffer = b""
                continue
            lines = (self._buffer + chunk).split(b"\n")
            self._buffer = lines.pop()
            if len(self._buffer) > MAX_EVENT_BYTES:
                raise ValueError(f"a streamed event is larger than {MAX_EVENT_BYTES:,} bytes")
            lines.reverse()  # popped from the end: oldest last
            self._lines = lines

    def _dispatch(self) -> tuple[str, str]:
        data = b"\n".join(self._data).decode("utf-8", errors="replace")
        event = self._event.decode("utf-8", errors="replace")
        self._data, self._event = [], b""
        return event, data


class TranscriptionEndpoint:
    """POSTs audio to `/audio/transcriptions` as multipart form data (OpenAI's shape:
    `file`, `model`, `response_format`); open() once on the loop, close() when done."""

    def __init__(self, base_url: str | None, api_key: str, timeout_s: float) -> None:
        self.url = transcriptions_url(base_url)
        self._headers = {"Authorization": f"Bearer {api_key}", "Accept": "application/json",
                         "User-Agent": USER_AGENT}
        # An upload takes a while to send; the answer comes when the audio is transcribed.
        self._timeout = aiohttp.ClientTimeout(total=timeout_s, connect=min(timeout_s, 30.0))
        self._session: aiohttp.ClientSession | None = None
        self._proxy: tuple[URL | None, aiohttp.BasicAuth | None] = (None, None)
        self._lock = asyncio.Lock()

    async def _opened(self) -> aiohttp.ClientSession:
        async with self._lock:
            if self._session is None:
                context = await asyncio.to_thread(_ssl_context) if self.url.scheme == "https" else None
                self._proxy = await asyncio.to_thread(env_proxy, self.url)
                connector = aiohttp.TCPConnector(limit=8, ssl=context if context is not None else True)
                self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout)
            return self._session

    async def close(self) -> None:
        async with self._lock:
            if self._session is not None:
                session, self._session = self._session, None
                await session.close()

    async def post(self, audio: bytes, *, filename: str, mime: str, model: str) -> RawResponse:
        """One attempt. Raises aiohttp.ClientError, OSError or TimeoutError when no complete
        HTTP response arrives within the timeout."""
        session = await self._opened()
        form = aiohttp.FormData()
        form.add_field("model", model)
        form.add_field("response_format", "json")
        form.add_field("file", audio, filename=filename, content_type=mime)
        proxy, proxy_auth = self._proxy
        async with session.post(self.url, data=form, headers=self._headers, proxy=proxy,
                                proxy_auth=proxy_auth) as response:
            data = await response.read()
            return RawResponse(status=response.status, headers=response.headers, body=data)
