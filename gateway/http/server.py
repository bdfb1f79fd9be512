"""The one aiohttp server: web chat, /api/chat, webhooks, /healthz, /readyz, /metrics.

Every request from the network is bounded in time (SPEC §9). aiohttp closes idle
keep-alive connections but has no deadline for a request head that arrives byte by byte,
nor for a body announced by Content-Length that never comes. So each connection is
watched (`ConnectionWatch`): a request head must be complete within `header_timeout_s`
of the connection (or of its first byte after a response), an idle connection is closed
after `keepalive_timeout_s`, a body must arrive within `body_timeout_s` (else 408), and
one client address holds at most `max_connections_per_client` connections (more get a
503 and are closed), so a few slow clients cannot use up the file descriptors.

Many addresses together are bounded too: the server holds at most `max_connections`
(`http.max_connections`, else derived from the open-files limit, well below it, so
`accept()` never runs out of descriptors). The last few places are kept for the probes:
a connection that arrives when the rest are taken may ask only for /healthz or /readyz
(anything else gets a 503), is closed after its answer, and when those places are taken
too the one that has waited longest without sending a request (at least a second) gives
its place up. So a crowd of idle connections can neither take the server's descriptors
nor blind its probes. (A flood of new connections is a firewall's or a proxy's to stop.)

Those places can still be outrun: a crowd that reconnects the moment it loses one holds them
too. The robust answer is `http.probe_port`, a listener of its own that serves /healthz and
/readyz only (`build_probe_app`): tiny requests (a 1 KB body cap, GETs), short deadlines,
at most PROBE_PER_CLIENT connections an address, and past PROBE_CONNECTIONS_MAX the
longest idle connection makes way for the newcomer (`ConnectionWatch(..., evict=True)`),
so a crowd there holds nothing for long and the crowd on `http.port` does not reach it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
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

# Connections past the cap: what the probes may still ask, and how many places are theirs.
PROBE_PATHS = frozenset({"/healthz", "/readyz"})
PROBE_PLACES_MAX = 16
PROBE_GRACE_S = 1.0  # a probe's place is never given up sooner: time for its request to arrive
# Descriptors left for everything but the server's admitted connections (refused ones
# reading their 503, the database, MCP servers' pipes, the model's and platforms'
# connections, files): at least this many, or a quarter of the limit; and a cap that no
# derived limit goes past.
FD_HEADROOM_MIN = 320
AUTO_CONNECTIONS_MAX = 16_384
REFUSED_LINGERING_MAX = 128  # refused connections given a moment to read their 503; more are cut at once
# The probes' own listener (`http.probe_port`): a probe's request comes at once and is tiny.
PROBE_CONNECTIONS_MAX = 256
PROBE_PER_CLIENT = 8  # an orchestrator's liveness, readiness and startup probes, with room
PROBE_HEAD_S = 2.0
PROBE_IDLE_S = 5.0
PROBE_BODY_BYTES = 1024


def raise_open_files_limit() -> int:
    """Raise the soft open-files limit to the hard one (the soft default, often 1,024, is
    what a busy server runs out of first); the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20  # Linux refuses "unlimited"
    if soft == resource.RLIM_INFINITY or soft >= target:
        return int(soft) if soft != resource.RLIM_INFINITY else target
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (OSError, ValueError) as err:
        log.warning("could not raise the open-files limit", extra={"soft": soft, "hard": hard, "error": str(err)})
        return int(soft)
    return int(target)


def connection_cap(configured: int | None) -> int:
    """`http.max_connections`, or one derived from the open-files limit that leaves the
    rest of the gateway its descriptors."""
    if configured is not None:
        return configured
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = AUTO_CONNECTIONS_MAX * 2 if soft == resource.RLIM_INFINITY else int(soft)
    return max(PROBE_PLACES_MAX + 16, min(AUTO_CONNECTIONS_MAX, limit - max(FD_HEADROOM_MIN, limit // 4)))


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


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _probes(ready: ReadyCheck, ready_details: Callable[[], dict[str, Any]] | None) -> tuple[Handler, Handler]:
    """/healthz and /readyz, the same on the main port and the probes' own."""

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

    return healthz, readyz


def build_probe_app(*, ready: ReadyCheck, ready_details: Callable[[], dict[str, Any]] | None = None) -> web.Application:
    """The probes' own listener (`http.probe_port`): /healthz and /readyz, nothing else."""
    app = web.Application(client_max_size=PROBE_BODY_BYTES)
    healthz, readyz = _probes(ready, ready_details)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    return app


def build_app(*, ready: ReadyCheck, metrics: Callable[[], tuple[bytes, str]],
              channel: ChannelLookup, extra_routes: list[web.RouteDef] | None = None,
              client_max_size: int = 4 * 1024 * 1024,
              ready_details: Callable[[], dict[str, Any]] | None = None) -> web.Application:
    """`ready_details` adds informative entries to /readyz (MCP servers) that never make it fail."""
    app = web.Application(client_max_size=client_max_size)
    healthz, readyz = _probes(ready, ready_details)

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
        self.probe_only = False  # admitted past the cap: /healthz and /readyz only
        self.leaving = False  # made way for a newcomer (the probes' listener), closing
        self.opened_at = 0.0
        self._lingering = False  # refused, given a moment to read its 503

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        peer = transport.get_extra_info("peername")
        self._client = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        self.opened_at = self._now()
        admitted = self._watch.admit(self._client, self)
        if admitted is None:
            if not self._watch.linger_refused():
                transport.abort()  # too many refused at once: no time to say why
                return
            # Answer, stop sending, and read what the client already sent until it hangs
            # up (briefly): closing with its request unread would reset the connection
            # before it could read the 503.
            self._lingering = True
            transport.write(_TOO_MANY)
            if transport.can_write_eof():
                transport.write_eof()
            self._arm(self._now() + min(1.0, self._watch.cfg.header_timeout_s))
            return
        self.probe_only = admitted == "probe"
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
        if self._inner is None:  # refused: never admitted
            if self._lingering:
                self._lingering = False
                self._watch.refused_gone()
            return
        inner, self._inner = self._inner, None
        self._watch.handlers.pop(inner, None)
        self._watch.release(self._client, self)
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

    @property
    def heading(self) -> bool:
        """Bytes of a request head have come (it is not just idle)."""
        return self._heading

    @property
    def waiting(self) -> bool:
        """Admitted and not in a request: an idle or still-arriving head may give its place up."""
        return not self._busy and self._transport is not None and not self._transport.is_closing()

    def give_up_place(self) -> None:
        if self._transport is not None:
            self._cancel()
            self._transport.abort()


_TOO_MANY_TEXT = b"too many connections from your address, or to this server; try again shortly\n"
_TOO_MANY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\n"
             b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(_TOO_MANY_TEXT), _TOO_MANY_TEXT))


class ConnectionWatch:
    """The connections of one server: counts per client address and in all, the probes'
    places past the cap, deadlines per connection."""

    def __init__(self, cfg: HttpConfig, max_connections: int | None = None, *, evict: bool = False) -> None:
        self.cfg = cfg
        self.evict = evict  # when full, the longest idle connection makes way (the probes' listener)
        self.per_client: Counter[str] = Counter()
        self.handlers: dict[asyncio.Protocol, _Watched] = {}  # aiohttp's protocol → its watcher
        self._refusing: set[str] = set()  # addresses at the cap (one warning each time they reach it)
        self.set_cap(max_connections if max_connections is not None else connection_cap(cfg.max_connections))
        self.open = 0  # admitted connections, the probes' included
        self.probes: set[_Watched] = set()  # admitted past the cap
        self.refused = 0  # refused, still reading their 503
        self.full = False  # at the cap (one warning each time it is reached)

    def set_cap(self, max_connections: int) -> None:
        self.max_connections = max_connections
        self.probe_places = max(2, min(PROBE_PLACES_MAX, max_connections // 16))

    def protocol(self, make_inner: Callable[[], asyncio.Protocol]) -> _Watched:
        return _Watched(self, make_inner)

    def admit(self, client: str, conn: _Watched) -> str | None:
        """"open", "probe" (past the cap: the probes' paths only) or None (refused)."""
        if self.per_client[client] >= self.cfg.max_connections_per_client:
            if client not in self._refusing:
                self._refusing.add(client)
                log.warning("refusing connections: too many from one address",
                            extra={"client": client, "limit": self.cfg.max_connections_per_client})
            return None
        kind = "open"
        if self.evict:
            if self.open >= self.max_connections and not self._make_way():
                return None
            self.per_client[client] += 1
            self.open += 1
            return kind
        if self.open - len(self.probes) >= self.max_connections - self.probe_places:
            if not self.full:
                self.full = True
                log.warning("at the connection limit: new connections may only ask /healthz or /readyz",
                            extra={"limit": self.max_connections})
            if len(self.probes) >= self.probe_places and not self._free_a_probe_place():
                return None
            kind = "probe"
            self.probes.add(conn)
        self.per_client[client] += 1
        self.open += 1
        return kind

    def _free_a_probe_place(self) -> bool:
        """The probe place held longest without a request (and for at least PROBE_GRACE_S,
        so a churning crowd cannot push a real probe out before its request arrives) is
        given to a newcomer."""
        now = asyncio.get_running_loop().time()
        waiting = [c for c in self.probes if c.waiting and now - c.opened_at >= PROBE_GRACE_S]
        if not waiting:
            return False
        oldest = min(waiting, key=lambda c: c.opened_at)
        self.probes.discard(oldest)  # its place is taken now; its own release comes when it is gone
        oldest.give_up_place()
        return True

    def _make_way(self) -> bool:
        """The connection that has waited longest without sending a byte (else the one whose
        request head is slowest) is closed for a newcomer; None waiting: no place."""
        waiting = [c for c in self.handlers.values() if c.waiting and not c.leaving]
        if not waiting:
            return False
        longest = min(waiting, key=lambda c: (c.heading, c.opened_at))
        longest.leaving = True  # counted until it is gone (its release), never picked twice
        longest.give_up_place()
        self.open -= 1  # its place is the newcomer's now
        return True

    def release(self, client: str, conn: _Watched) -> None:
        if not (self.evict and conn.leaving):  # a connection that made way gave its place already
            self.open -= 1
        self.probes.discard(conn)
        self.per_client[client] -= 1
        if self.per_client[client] <= 0:
            del self.per_client[client]
        if self.per_client[client] < self.cfg.max_connections_per_client:
            self._refusing.discard(client)
        if self.full and self.open < self.max_connections - self.probe_places:
            self.full = False
            log.info("below the connection limit again", extra={"open": self.open})

    def linger_refused(self) -> bool:
        """Whether a refused connection may stay a moment to read its 503 (else it is cut)."""
        if self.refused >= REFUSED_LINGERING_MAX:
            return False
        self.refused += 1
        return True

    def refused_gone(self) -> None:
        self.refused -= 1

    @web.middleware
    async def middleware(self, request: web.Request,
                         handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        watched = self.handlers.get(request.protocol)
        if watched is not None:
            watched.request_started()
        if watched is not None and watched.probe_only:
            # Past the cap: the probes are answered, and the place is freed right after.
            if request.path in PROBE_PATHS and request.method in ("GET", "HEAD"):
                try:
                    resp = await handler(request)
                finally:
                    watched.request_finished()
                resp.force_close()
                return resp
            watched.request_finished()
            busy = web.json_response({"error": "the server is at its connection limit; try again shortly"},
                                     status=503, headers={"Retry-After": "1"})
            busy.force_close()
            return busy
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
    """The main listener (`http.port`), and the probes' own when `probes` is given
    (`http.probe_port`)."""

    def __init__(self, app: web.Application, cfg: HttpConfig, *, probes: web.Application | None = None) -> None:
        self.app = app
        self.cfg = cfg
        self.host = cfg.host
        self.port = cfg.port
        self.watch = ConnectionWatch(cfg)
        self.probes = probes
        self.probe_port: int | None = cfg.probe_port if probes is not None else None
        # Short deadlines, a few connections an address; when full the longest idle one goes.
        self.probe_watch = ConnectionWatch(
            cfg.model_copy(update={"header_timeout_s": min(cfg.header_timeout_s, PROBE_HEAD_S),
                                   "keepalive_timeout_s": min(cfg.keepalive_timeout_s, PROBE_IDLE_S),
                                   "body_timeout_s": min(cfg.body_timeout_s, PROBE_HEAD_S),
                                   "max_connections_per_client": min(cfg.max_connections_per_client,
                                                                     PROBE_PER_CLIENT)}),
            PROBE_CONNECTIONS_MAX, evict=True)
        self._runner: web.AppRunner | None = None
        self._probe_runner: web.AppRunner | None = None
        self.binding = ("http.port", self.port)  # the key and port being bound (a failed start names them)

    async def start(self) -> None:
        self.app.middlewares.append(self.watch.middleware)
        self._runner = await self._serve(self.app, self.cfg, self.watch)
        site = _WatchedSite(self._runner, self.host, self.port, self.watch)
        try:
            await site.start()
            self.port = site.bound_port or self.port  # the bound port matters when 0 was asked for
            if self.probes is not None and self.probe_port is not None:
                self.binding = ("http.probe_port", self.probe_port)
                await self._start_probes(self.probes, self.probe_port)
        except OSError:
            await self.stop()
            raise
        log.info("http server listening", extra={"host": self.host, "port": self.port,
                                                 "max_connections": self.watch.max_connections,
                                                 "probe_port": self.probe_port})

    async def _start_probes(self, probes: web.Application, port: int) -> None:
        probes.middlewares.append(self.probe_watch.middleware)
        self._probe_runner = await self._serve(probes, self.probe_watch.cfg, self.probe_watch)
        site = _WatchedSite(self._probe_runner, self.host, port, self.probe_watch)
        await site.start()
        self.probe_port = site.bound_port or port

    @staticmethod
    async def _serve(app: web.Application, cfg: HttpConfig, watch: ConnectionWatch) -> web.AppRunner:
        # aiohttp's own idle timer (recent versions also run it before the first request) only
        # as a backstop behind the watch's; lingering (reading what is left of a body after
        # the response) is bounded like the body itself.
        runner = web.AppRunner(app, access_log=None, handle_signals=False,
                               keepalive_timeout=max(cfg.keepalive_timeout_s, cfg.header_timeout_s) + 1,
                               lingering_time=min(2.0, cfg.body_timeout_s), shutdown_timeout=5)
        await runner.setup()
        return runner

    async def stop(self) -> None:
        for name in ("_probe_runner", "_runner"):
            runner = getattr(self, name)
            if runner is not None:
                setattr(self, name, None)
                await runner.cleanup()
