"""The one aiohttp server: web chat, /api/chat, webhooks, /healthz, /readyz, /metrics.

Every request from the network is bounded in time (SPEC §9). aiohttp closes idle
keep-alive connections but has no deadline for a request head that arrives byte by byte,
nor for a body announced by Content-Length that never comes. So each connection is
watched (`ConnectionWatch`): a request head must be complete within `header_timeout_s`
of the connection (or of its first byte after a response), an idle connection is closed
after `keepalive_timeout_s`, a body must arrive within `body_timeout_s` (else 408), and
one client address holds at most `max_connections_per_client` connections (more get a
503 and are closed), so a few slow clients cannot use up the file descriptors.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from channels.base import WebhookChannel
from gateway.config.schema import HttpConfig

log = logging.getLogger("gateway.http")

# Check name → None when fine, else why not (shown by /readyz).
ReadyCheck = Callable[[], Awaitable[dict[str, str | None]]]
ChannelLookup = Callable[[str], object | None]

WEBHOOK_ROUTES = {"/telegram/webhook": "telegram", "/slack/events": "slack"}
READY_TIMEOUT_S = 10.0
MAX_JSON_DEPTH = 64  # Slack's deepest blocks nest about a dozen levels
JSON_IN_THREAD_BYTES = 64 * 1024  # larger bodies are parsed off the event loop


class JsonBodyError(ValueError):
    """A request body that is not JSON, or nested deeper than MAX_JSON_DEPTH."""


class JsonTooDeep(JsonBodyError):
    """JSON nested deeper than MAX_JSON_DEPTH."""


def loads_bounded(data: bytes | str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """json.loads, refusing nesting deeper than `max_depth` with a clear error (the C
    parser raises RecursionError near the interpreter's limit, code that walks the result
    later might too)."""
    try:
        value = json.loads(data)
    except RecursionError:
        raise JsonTooDeep(f"the JSON is nested too deeply (at most {max_depth} levels)") from None
    except ValueError as err:  # JSONDecodeError and UnicodeDecodeError
        raise JsonBodyError(f"the body is not valid JSON ({err})") from None
    if _deeper_than(value, max_depth):
        raise JsonTooDeep(f"the JSON is nested too deeply (at most {max_depth} levels)")
    return value


async def parse_json_body(data: bytes | str) -> Any:
    """`loads_bounded` for a request body; a large one off the event loop."""
    if len(data) > JSON_IN_THREAD_BYTES:
        return await asyncio.to_thread(loads_bounded, data)
    return loads_bounded(data)


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether containers nest more than `limit` levels (iterative: the depth is untrusted)."""
    stack: list[tuple[dict[str, Any] | list[Any], int]] = [(value, 1)] if isinstance(value, (dict, list)) else []
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        children = item.values() if isinstance(item, dict) else item
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def build_app(*, ready: ReadyCheck, metrics: Callable[[], tuple[bytes, str]],
              channel: ChannelLookup, extra_routes: list[web.RouteDef] | None = None,
              client_max_size: int = 4 * 1024 * 1024,
              ready_details: Callable[[], dict[str, Any]] | None = None) -> web.Application:
    """`ready_details` adds informative entries to /readyz (MCP servers) that never make it fail."""
    app = web.Application(client_max_size=client_max_size)

    async def healthz(_request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(_request: web.Request) -> web.Response:
        try:
            async with asyncio.timeout(READY_TIMEOUT_S):
                checks = await ready()
        except Exception as err:  # never a 500: a probe must learn why
            log.warning("readiness check failed", extra={"error": f"{type(err).__name__}: {err}"[:300]})
            return web.json_response({"ready": False, "checks": {},
                                      "reasons": [f"readiness check failed: {type(err).__name__}: {err}"[:300]]},
                                     status=503)
        reasons = [reason for reason in checks.values() if reason is not None]
        body: dict[str, Any] = {"ready": not reasons,
                                "checks": {name: reason is None for name, reason in checks.items()},
                                "reasons": reasons}
        if ready_details is not None:
            try:
                body |= {k: v for k, v in ready_details().items() if k not in body}
            except Exception as err:
                log.warning("readiness details failed", extra={"error": f"{type(err).__name__}: {err}"[:300]})
        return web.json_response(body, status=503 if reasons else 200)

    async def metrics_view(_request: web.Request) -> web.Response:
        body, content_type = metrics()
        return web.Response(body=body, headers={"Content-Type": content_type})

    def webhook(name: str) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def dispatch(request: web.Request) -> web.StreamResponse:
            # Looked up per request: a channel restarted on reload takes over its route.
            target = channel(name)
            if not isinstance(target, WebhookChannel):
                return web.json_response({"error": f"{name} webhooks are not enabled"}, status=404)
            return await target.handle_webhook(request)
        return dispatch

    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics_view)
    for path, name in WEBHOOK_ROUTES.items():
        app.router.add_post(path, webhook(name))
    if extra_routes:
        app.router.add_routes(extra_routes)
    return app


# ---------------------------------------------------------------------------- connections


class _Watched(asyncio.Protocol):
    """One connection: aiohttp's protocol inside, with a deadline while no request runs."""

    def __init__(self, watch: ConnectionWatch, make_inner: Callable[[], asyncio.Protocol]) -> None:
        self._watch = watch
        self._make_inner = make_inner
        self._inner: asyncio.Protocol | None = None
        self._transport: asyncio.Transport | None = None
        self._client = ""
        self._timer: asyncio.TimerHandle | None = None
        self._deadline = 0.0
        self._busy = False  # a request is being handled (its body has its own deadline)
        self._heading = False  # bytes of the next request head have arrived

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        peer = transport.get_extra_info("peername")
        self._client = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        if not self._watch.admit(self._client):
            # Answer, stop sending, and read what the client already sent until it hangs
            # up (briefly): closing with its request unread would reset the connection
            # before it could read the 503.
            transport.write(_TOO_MANY)
            if transport.can_write_eof():
                transport.write_eof()
            self._arm(self._now() + min(1.0, self._watch.cfg.header_timeout_s))
            return
        self._inner = self._make_inner()
        self._watch.handlers[self._inner] = self
        self._inner.connection_made(transport)
        self._wait(self._watch.cfg.header_timeout_s)

    def data_received(self, data: bytes) -> None:
        if self._inner is None:
            return
        if not self._busy and not self._heading:
            # A request begins: its head must be complete soon, however slowly it trickles.
            self._heading = True
            self._arm(min(self._deadline, self._now() + self._watch.cfg.header_timeout_s))
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._inner is not None else None  # None: close

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        if self._inner is None:  # refused: never counted
            return
        inner, self._inner = self._inner, None
        self._watch.handlers.pop(inner, None)
        self._watch.release(self._client)
        inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()

    # request boundaries (from the middleware)

    def request_started(self) -> None:
        self._busy, self._heading = True, False
        self._cancel()

    def request_finished(self) -> None:
        self._busy = False
        self._wait(self._watch.cfg.keepalive_timeout_s)

    # deadline

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    def _wait(self, seconds: float) -> None:
        self._heading = False
        self._arm(self._now() + seconds)

    def _arm(self, at: float) -> None:
        self._cancel()
        self._deadline = at
        self._timer = asyncio.get_running_loop().call_at(at, self._expired)

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self) -> None:
        self._timer = None
        if self._busy or self._transport is None or self._transport.is_closing():
            return
        log.debug("closing a slow or idle connection", extra={"client": self._client, "heading": self._heading})
        self._transport.close()


_TOO_MANY_TEXT = b"too many connections from your address; close some and try again\n"
_TOO_MANY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\n"
             b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(_TOO_MANY_TEXT), _TOO_MANY_TEXT))


class ConnectionWatch:
    """The connections of one server: counts per client address, deadlines per connection."""

    def __init__(self, cfg: HttpConfig) -> None:
        self.cfg = cfg
        self.per_client: Counter[str] = Counter()
        self.handlers: dict[asyncio.Protocol, _Watched] = {}  # aiohttp's protocol → its watcher
        self._refusing: set[str] = set()  # addresses at the cap (one warning each time they reach it)

    def protocol(self, make_inner: Callable[[], asyncio.Protocol]) -> _Watched:
        return _Watched(self, make_inner)

    def admit(self, client: str) -> bool:
        if self.per_client[client] >= self.cfg.max_connections_per_client:
            if client not in self._refusing:
                self._refusing.add(client)
                log.warning("refusing connections: too many from one address",
                            extra={"client": client, "limit": self.cfg.max_connections_per_client})
            return False
        self.per_client[client] += 1
        return True

    def release(self, client: str) -> None:
        self.per_client[client] -= 1
        if self.per_client[client] <= 0:
            del self.per_client[client]
        if self.per_client[client] < self.cfg.max_connections_per_client:
            self._refusing.discard(client)

    @web.middleware
    async def middleware(self, request: web.Request,
                         handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        watched = self.handlers.get(request.protocol)
        if watched is not None:
            watched.request_started()
        try:
            if request.body_exists:
                try:
                    async with asyncio.timeout(self.cfg.body_timeout_s):
                        await request.read()  # kept by aiohttp: handlers read it from memory
                except TimeoutError:
                    log.info("request body too slow", extra={"client": request.remote, "path": request.path})
                    resp = web.json_response(
                        {"error": f"the request body did not arrive within {self.cfg.body_timeout_s:g} s"},
                        status=408)
                    resp.force_close()
                    return resp
            return await handler(request)
        finally:
            if watched is not None:
                watched.request_finished()


class _WatchedSite(web.BaseSite):
    """A TCP site whose connections go through a `ConnectionWatch`."""

    def __init__(self, runner: web.AppRunner, host: str, port: int, watch: ConnectionWatch) -> None:
        super().__init__(runner)
        self._host, self._port, self._watch = host, port, watch

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        self._server = await asyncio.get_running_loop().create_server(
            lambda: self._watch.protocol(server), self._host, self._port, reuse_address=True)

    @property
    def bound_port(self) -> int | None:
        sockets = getattr(self._server, "sockets", None)
        return int(sockets[0].getsockname()[1]) if sockets else None


class HttpServer:
    def __init__(self, app: web.Application, cfg: HttpConfig) -> None:
        self.app = app
        self.cfg = cfg
        self.host = cfg.host
        self.port = cfg.port
        self.watch = ConnectionWatch(cfg)
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        self.app.middlewares.append(self.watch.middleware)
        # aiohttp's own idle timer (recent versions also run it before the first request) only
        # as a backstop behind the watch's; lingering (reading what is left of a body after
        # the response) is bounded like the body itself.
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False,
                                     keepalive_timeout=max(self.cfg.keepalive_timeout_s,
                                                           self.cfg.header_timeout_s) + 1,
                                     lingering_time=min(2.0, self.cfg.body_timeout_s),
                                     shutdown_timeout=5)
        await self._runner.setup()
        site = _WatchedSite(self._runner, self.host, self.port, self.watch)
        try:
            await site.start()
        except OSError:
            await self._runner.cleanup()
            self._runner = None
            raise
        self.port = site.bound_port or self.port  # the bound port matters when 0 was asked for
        log.info("http server listening", extra={"host": self.host, "port": self.port})

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
