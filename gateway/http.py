"""The one aiohttp server: web chat, /api/chat, webhooks, /healthz, /readyz, /metrics."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from channels.base import WebhookChannel

log = logging.getLogger("gateway.http")

ReadyCheck = Callable[[], Awaitable[dict[str, bool]]]
ChannelLookup = Callable[[str], object | None]

WEBHOOK_ROUTES = {"/telegram/webhook": "telegram", "/slack/events": "slack"}


def build_app(*, ready: ReadyCheck, metrics: Callable[[], tuple[bytes, str]],
              channel: ChannelLookup, extra_routes: list[web.RouteDef] | None = None,
              client_max_size: int = 4 * 1024 * 1024) -> web.Application:
    app = web.Application(client_max_size=client_max_size)

    async def healthz(_request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(_request: web.Request) -> web.Response:
        checks = await ready()
        ok = all(checks.values())
        return web.json_response({"ready": ok, "checks": checks}, status=200 if ok else 503)

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


class HttpServer:
    def __init__(self, app: web.Application, host: str, port: int) -> None:
        self.app = app
        self.host = host
        self.port = port
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, shutdown_timeout=5)
        await site.start()
        server = site._server  # the bound port matters when 0 was asked for
        if server is not None and server.sockets:  # type: ignore[union-attr]
            self.port = server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        log.info("http server listening", extra={"host": self.host, "port": self.port})

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
