"""The contract between a platform adapter and the gateway.

An adapter turns platform events into `Inbound` and hands each to `InboundHandler`
(the router: dedup, access, commands, queue). The router answers through `send()`.
Adapters know the platform and nothing about the model.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Protocol, runtime_checkable

from aiohttp import web

from gateway.types import Inbound

# Returns once the event is durably recorded (dedup) and accepted or refused; the
# adapter may acknowledge the platform event after it returns. The result is False for
# an event seen before (nothing more will happen for it), True or None otherwise.
InboundHandler = Callable[[Inbound], Awaitable[bool | None]]
# Whether the router would serve this message (no side effects): files are fetched only then.
AccessCheck = Callable[[Inbound], Awaitable[bool]]


@runtime_checkable
class Channel(Protocol):
    name: str

    async def start(self) -> None:
        """Connect and begin delivering inbound events. Returns once running."""

    async def stop(self) -> None:
        """Stop intake and close connections; idempotent; bounded by a timeout."""

    def is_ready(self) -> bool:
        """True while connected and receiving (for /readyz)."""

    async def send(self, inbound: Inbound, text: str) -> None:
        """Deliver a reply (Markdown) to where `inbound` came from, chunked and formatted
        for the platform; falls back to plain text when formatting is rejected."""

    def typing(self, inbound: Inbound) -> AbstractAsyncContextManager[None]:
        """Show a typing indicator while the body runs."""


@runtime_checkable
class WebhookChannel(Protocol):
    """A channel that receives platform events over the gateway's HTTP server
    (Telegram webhook, Slack HTTP events). The route is registered once by
    gateway/http.py and dispatches to whichever instance is running now, so a channel
    can be restarted alone on a config change."""

    webhook_path: str  # e.g. "/telegram/webhook", "/slack/events"

    async def handle_webhook(self, request: web.Request) -> web.StreamResponse: ...
