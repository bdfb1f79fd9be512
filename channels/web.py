"""The local web chat: a small page and `POST /api/chat` on the gateway's HTTP server.

`{"session": "alice", "text": "hi"}` → `{"reply": "..."}`. A bearer token is required
whenever one is configured (and config validation demands one off loopback). Without one
(loopback), a browser is the risk: any site the person visits may POST here, and DNS
rebinding lets it read the answer. So tokenless requests to /api/* must name this server
in `Host`, must not come from another origin, and must be JSON (a cross-site form or
text/plain POST needs no CORS preflight; `application/json` does, which we never grant)."""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import re
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib import resources
from typing import Any

from aiohttp import hdrs, web

from channels.base import InboundHandler
from gateway.http import JsonBodyError, parse_json_body
from gateway.types import Inbound

log = logging.getLogger("channels.web")

SESSION_NAME = re.compile(r"[A-Za-z0-9_.@-]{1,64}")  # fullmatch: `$` would let "alice\n" through
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")


class WebChannel:
    name = "web"

    def __init__(self, handler: InboundHandler, *, token: str | None, max_chars: int,
                 reply_timeout_s: float, http_host: str = "127.0.0.1") -> None:
        self.handler = handler
        self.token = token
        # Host names this server answers to without a token: the configured one and loopback's.
        configured = f"[{http_host}]" if ":" in http_host else http_host
        self._names = frozenset(name.lower() for name in (configured, *LOOPBACK_NAMES))
        self.max_chars = max_chars
        self.reply_timeout_s = reply_timeout_s
        self._waiters: dict[str, asyncio.Future[str]] = {}
        self._running = False
        # Event ids for requests without one: unique across restarts (dedup keys persist).
        self._id_prefix = uuid.uuid4().hex[:16]
        self._ids = itertools.count(1)

    def routes(self) -> list[web.RouteDef]:
        return [web.get("/", self.page), web.post("/api/chat", self.api_chat)]

    async def start(self) -> None:
        self._running = True

    async def stop(self) -> None:
        self._running = False
        for fut in self._waiters.values():
            if not fut.done():
                fut.set_exception(ConnectionAbortedError("the gateway is shutting down"))
        self._waiters.clear()

    def is_ready(self) -> bool:
        return self._running

    @asynccontextmanager
    async def typing(self, inbound: Inbound) -> AsyncIterator[None]:
        yield  # the page shows its own "thinking…" while the request is open

    async def send(self, inbound: Inbound, text: str) -> None:
        fut = self._waiters.get(inbound.event_id)
        if fut is None or fut.done():
            # No one is waiting (e.g. answered after a restart): the reply stays stored.
            log.info("web reply with no waiting request", extra={"event": inbound.event_id})
            return
        fut.set_result(text)

    async def page(self, _request: web.Request) -> web.Response:
        html = resources.files("channels").joinpath("static/index.html").read_text(encoding="utf-8")
        return web.Response(text=html, content_type="text/html", charset="utf-8")

    def _authorized(self, request: web.Request) -> bool:
        if not self.token:
            return True
        header = request.headers.get("Authorization", "")
        given = header.removeprefix("Bearer ").strip() if header.startswith("Bearer ") else ""
        return hmac.compare_digest(given.encode(), self.token.encode())

    def _cross_site(self, request: web.Request) -> str | None:
        """Why a tokenless request may come from another site (None when it cannot).
        With a token there is nothing to fear: a browser never sends one cross-site."""
        if self.token:
            return None
        host = request.headers.get(hdrs.HOST, "").strip().lower()
        port = _local_port(request)
        allowed = {f"{name}:{port}" for name in self._names}
        if port == 80:
            allowed |= self._names
        if host not in allowed:
            return f"the Host header must name this server (such as 127.0.0.1:{port}); other names are refused"
        origin = request.headers.get(hdrs.ORIGIN)
        if origin is not None and origin.strip().lower() != f"http://{host}":
            return "cross-site requests are refused (Origin is not this server)"
        return None

    async def api_chat(self, request: web.Request) -> web.Response:
        refused = self._cross_site(request)
        if refused is not None:
            log.info("refused a cross-site request", extra={"host": request.headers.get(hdrs.HOST, "")[:100],
                                                             "origin": request.headers.get(hdrs.ORIGIN, "")[:100]})
            return _error(403, refused)
        if not self._authorized(request):
            return _error(401, "a valid bearer token is required (Authorization: Bearer <channels.web.token>)")
        if not self._running:
            return _error(503, "the gateway is not accepting messages right now")
        if request.content_type != "application/json":
            return _error(415, "send the body as JSON with Content-Type: application/json")
        try:
            body: Any = await parse_json_body(await request.read())
        except JsonBodyError as err:
            return _error(400, f"{err}; send {{\"session\": \"name\", \"text\": \"...\"}}")
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object")
        session, text, request_id = body.get("session", "default"), body.get("text"), body.get("id")
        if not isinstance(session, str) or not SESSION_NAME.fullmatch(session):
            return _error(400, "session must be 1-64 characters of letters, digits, _ . @ - "
                               "(no spaces or control characters)")
        if not isinstance(text, str) or not text.strip():
            return _error(400, "text must be a non-empty string")
        if len(text) > self.max_chars:
            return _error(413, f"text is longer than {self.max_chars:,} characters")
        if request_id is not None and (not isinstance(request_id, str) or not 0 < len(request_id) <= 128):
            return _error(400, "id must be a string of at most 128 characters")
        event_id = request_id or f"{self._id_prefix}-{next(self._ids)}"
        inbound = Inbound(channel="web", chat_id=session, user_id=session, text=text, event_id=event_id,
                          message_id=event_id, user_name=session)
        if event_id in self._waiters:
            return _error(409, f"a message with id {event_id!r} is being answered")
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._waiters[event_id] = fut
        try:
            if await self.handler(inbound) is False:
                return _error(409, f"a message with id {event_id!r} was already received")
            async with asyncio.timeout(self.reply_timeout_s):  # shielded: the reply may still come later
                reply = await asyncio.shield(fut)
        except TimeoutError:
            return _error(504, "no reply in time; the message is saved and will be answered")
        except ConnectionAbortedError as err:
            return _error(503, str(err))
        except Exception as err:
            # Typically storage (disk full, read-only database): say so, don't leak a trace.
            log.error("message could not be accepted", extra={"session": session, "error": str(err)[:300]})
            return _error(503, f"the gateway could not save your message ({err}); please try again later")
        finally:
            self._waiters.pop(event_id, None)
        return web.json_response({"reply": reply, "session": session, "id": event_id})


def _local_port(request: web.Request) -> int | None:
    """The port this connection came in on (the configured one may be 0: any free port)."""
    transport = request.transport
    sockname = transport.get_extra_info("sockname") if transport is not None else None
    return int(sockname[1]) if isinstance(sockname, tuple) and len(sockname) >= 2 else None


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)
