"""Discord's REST API and gateway address, through discord.py's own HTTP client.

discord.py builds every REST URL from `discord.http.Route.BASE` and opens the gateway
websocket at `DiscordWebSocket.DEFAULT_GATEWAY`; both are class attributes, so setting
them would point every client of the process at one server. `DiscordHttp` leaves them
alone and moves only its own requests: REST calls to `channels.discord.api_base`, and a
websocket meant for the default gateway to the URL that `GET {api_base}/gateway/bot`
returns (what Discord tells bots to do; for discord.com it is the same address). A
proxy or a test server can so stand in for Discord per channel.

discord.py's HTTP client keeps Discord's rate limits itself: it reads the
X-RateLimit-* headers of every answer, waits before a bucket runs dry, and on a 429
sleeps `retry_after` and sends again (a wait longer than `MAX_RATE_LIMIT_WAIT_S` raises
`discord.RateLimited` instead). `RATE_LIMITED` lets a caller hear of those 429s: the
function it holds in the calling task is called for each one.

`DiscordRest` is what the channel sends with: messages (with a nonce, so a send retried
after a lost answer posts once), edits, deletions, files, typing, DM channels.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import secrets
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import aiohttp
import discord
from discord.gateway import DiscordWebSocket
from discord.http import HTTPClient, Route, handle_message_parameters
from yarl import URL

DEFAULT_API_BASE = "https://discord.com/api/v10"
MAX_RATE_LIMIT_WAIT_S = 30.0  # the least discord.py allows; a longer 429 raises RateLimited
DM_CACHE = 4096  # users whose DM channel id is remembered
EPHEMERAL = 1 << 6  # a message flag: only the person who pressed sees it

# Called (in the task that made the request) for every 429 Discord answers.
RATE_LIMITED: ContextVar[Callable[[], None] | None] = ContextVar("discord_rate_limited", default=None)

# Nobody is pinged by what the model writes (@everyone, roles, users); a reply still
# notifies the person it answers, as Discord's own reply does.
ALLOWED_MENTIONS = discord.AllowedMentions(everyone=False, users=False, roles=False, replied_user=True)


async def _on_request_end(_session: aiohttp.ClientSession, _ctx: Any, params: aiohttp.TraceRequestEndParams) -> None:
    if params.response.status == 429:
        note = RATE_LIMITED.get()
        if note is not None:
            with contextlib.suppress(Exception):
                note()


class DiscordHttp(HTTPClient):
    """discord.py's HTTP client, aimed at `api_base` and at the gateway it names."""

    def __init__(self, api_base: str, *, proxy: str | None = None, proxy_auth: aiohttp.BasicAuth | None = None) -> None:
        trace = aiohttp.TraceConfig()
        trace.on_request_end.append(_on_request_end)
        super().__init__(asyncio.get_running_loop(), proxy=proxy, proxy_auth=proxy_auth, http_trace=trace,
                         max_ratelimit_timeout=MAX_RATE_LIMIT_WAIT_S)
        self.api_base = api_base.rstrip("/")
        self._gateway: URL | None = None

    async def request(self, route: Route, **kwargs: Any) -> Any:
        base = Route.BASE
        if route.url.startswith(base) and self.api_base != base:
            route.url = self.api_base + route.url[len(base):]
        return await super().request(route, **kwargs)

    async def ws_connect(self, url: str, *, compress: int = 0) -> aiohttp.ClientWebSocketResponse:
        target = URL(url)
        if target.host == DiscordWebSocket.DEFAULT_GATEWAY.host:
            # The first connection and one after an invalid session; a resume goes to the
            # `resume_gateway_url` READY gave, which is left as it is.
            target = (await self.gateway_url()).with_query(target.query)
        return await super().ws_connect(str(target), compress=compress)

    async def gateway_url(self) -> URL:
        """The websocket address `GET /gateway/bot` gives (asked once per client)."""
        if self._gateway is None:
            _shards, url, _limits = await self.get_bot_gateway()
            found = URL(url)
            if found.scheme not in ("ws", "wss") or not found.host:
                raise discord.GatewayNotFound()
            self._gateway = found
        return self._gateway


@dataclass(frozen=True, slots=True)
class Upload:
    name: str
    data: bytes


class DiscordRest:
    """The REST calls the channel makes. Ids are Discord's snowflakes as ints."""

    def __init__(self, http: DiscordHttp) -> None:
        self.http = http
        self._dms: OrderedDict[int, int] = OrderedDict()  # user id → DM channel id

    async def login(self, token: str) -> dict[str, Any]:
        """Check the token (`GET /users/@me`); the bot's user. discord.LoginFailure when refused."""
        user: dict[str, Any] = await self.http.static_login(token)
        return user

    async def close(self) -> None:
        await self.http.close()

    async def post(self, channel_id: int, content: str, *, reply_to: int | None = None,
                   components: Sequence[Mapping[str, Any]] | None = None, nonce: str | None = None) -> int:
        """Post a message; returns its id. `components` are Discord message components
        (action rows of buttons) as the API takes them. The nonce makes a retry of the same
        post (same nonce) return the first one instead of posting twice."""
        reference = ({"message_id": reply_to, "channel_id": channel_id, "fail_if_not_exists": False}
                     if reply_to is not None else discord.utils.MISSING)
        params = handle_message_parameters(content=content, allowed_mentions=ALLOWED_MENTIONS,
                                           message_reference=reference, nonce=nonce or new_nonce())
        if components is not None:
            assert params.payload is not None  # no files: the JSON form
            params.payload["components"] = [dict(c) for c in components]
        data = await self.http.send_message(channel_id, params=params)
        return int(data["id"])

    async def edit(self, channel_id: int, message_id: int, content: str, *,
                   components: Sequence[Mapping[str, Any]] | None = None) -> None:
        """Edit a message's text; `components` replace its components ([] removes them)."""
        params = handle_message_parameters(content=content, allowed_mentions=ALLOWED_MENTIONS)
        if components is not None:
            assert params.payload is not None
            params.payload["components"] = [dict(c) for c in components]
        await self.http.edit_message(channel_id, message_id, params=params)

    async def respond(self, interaction_id: int, token: str, notice: str) -> None:
        """Answer an interaction (`POST /interactions/{id}/{token}/callback`, within 3 s of
        it) with a message only the presser sees (type 4, flag 64: ephemeral). discord.py's
        own interaction response goes to discord.com whatever api_base says, so this goes
        through our HTTP client."""
        route = Route("POST", "/interactions/{interaction_id}/{interaction_token}/callback",
                      interaction_id=interaction_id, interaction_token=token)
        await self.http.request(route, json={"type": 4, "data": {
            "content": notice, "flags": EPHEMERAL, "allowed_mentions": {"parse": []}}})

    async def delete(self, channel_id: int, message_id: int) -> None:
        await self.http.delete_message(channel_id, message_id)

    async def typing(self, channel_id: int) -> None:
        await self.http.send_typing(channel_id)

    async def upload(self, channel_id: int, files: Sequence[Upload]) -> None:
        """Post files in one message (at most 10, as Discord takes them)."""
        attachments = [discord.File(io.BytesIO(f.data), filename=f.name) for f in files]
        params = handle_message_parameters(files=attachments, allowed_mentions=ALLOWED_MENTIONS)
        try:
            await self.http.send_message(channel_id, params=params)
        finally:
            for attachment in attachments:
                attachment.close()

    async def channel(self, channel_id: int) -> dict[str, Any]:
        """`GET /channels/{id}`: its type, and a thread's parent."""
        data: dict[str, Any] = await self.http.get_channel(channel_id)
        return data

    async def dm_channel(self, user_id: int) -> int:
        """The DM channel with a person (`POST /users/@me/channels` returns the existing one)."""
        known = self._dms.get(user_id)
        if known is not None:
            self._dms.move_to_end(user_id)
            return known
        data = await self.http.start_private_message(user_id)
        channel_id = int(data["id"])
        self.remember_dm(user_id, channel_id)
        return channel_id

    def known_dm(self, user_id: int) -> int | None:
        return self._dms.get(user_id)

    def remember_dm(self, user_id: int, channel_id: int) -> None:
        self._dms[user_id] = channel_id
        self._dms.move_to_end(user_id)
        while len(self._dms) > DM_CACHE:
            self._dms.popitem(last=False)


def new_nonce() -> str:
    return secrets.token_hex(12)  # Discord takes up to 25 characters
