"""A fake Discord for tests: discord.py itself signs in to it, opens its gateway websocket
and sends to its REST API, over HTTP on 127.0.0.1; no network, no mocks.

REST (aiohttp, under `/api/v10`, `Authorization: Bot <token>` or 401):
`GET /gateway/bot` (the websocket address below), `GET /users/@me`,
`GET /oauth2/applications/@me`, `POST /channels/{id}/messages` (JSON, or multipart with
`payload_json` and `files[n]`), `PATCH` and `DELETE /channels/{id}/messages/{mid}`,
`POST /channels/{id}/typing`, `GET /channels/{id}`, `POST /users/@me/channels` (a DM),
and attachments served from a CDN path, `GET /attachments/{channel}/{id}/{name}`.

The gateway (`/gateway`, JSON text frames): HELLO (op 10) → IDENTIFY (op 2) → READY and
a GUILD_CREATE for each guild; heartbeats (op 1) are acknowledged (op 11); RESUME (op 6)
of a known session replays the dispatches it missed (sequence numbers above the one it
sends), then RESUMED; an unknown session gets INVALID_SESSION (op 9). A session lives on
after its websocket drops (its dispatches wait for a RESUME), and ends when the client
closes it with 1000/1001, as Discord does. A bad token closes the websocket with 4004,
privileged intents the app was not granted with 4014.

Discord's limits, as Discord applies them:
- content over 2,000 characters → 400 (code 50035, Invalid Form Body); an empty message
  → 400 (50006); a file over 10 MiB → 413 (40005); an unknown channel or message → 404
  (10003 / 10008); editing someone else's message → 403 (50005).
- per-route rate limits per channel (`limits`, default 5 per 5 s for posts and edits, as
  Discord's message routes): every answer carries `X-RateLimit-Limit/-Remaining/-Reset/
  -Reset-After/-Bucket`; a call over the limit gets 429 with `retry_after` in the JSON
  body, `Retry-After` and `X-RateLimit-Scope` headers (and `Via`, which Discord's edge
  adds and discord.py looks for). A call made before a 429's wait ran out is refused
  again. Every 429 the fake decided itself is listed in `rate_limited` (a client that
  honours the headers and retry_after never gets one); scripted ones (`rate_limit_next`)
  are not.
- a post repeated with the same `nonce` and `enforce_nonce` returns the first message.

Every message the bot posts is dispatched back over the gateway (MESSAGE_CREATE), its
edits and deletions too (MESSAGE_UPDATE, MESSAGE_DELETE), as Discord does.

Components (buttons), as Discord checks them: at most 5 action rows (type 1) of 1-5
buttons (type 2) with a style 1-5, a label of at most 80 characters and, except link
buttons, a custom_id of 1-100 characters unique in the message; else 400 (50035). An
edit's `components` replace the message's ([] removes them). `push_click(...)` is a person
pressing a button: only a button the message shows now (unless `stale`, a client that has
not seen the latest edit), dispatched as INTERACTION_CREATE (type 3) with a token. The
app must answer it once with `POST /interactions/{id}/{token}/callback` within
`interaction_deadline_s` (3 s), else 404 "Unknown interaction" (10062); a second answer
gets 400 (40060). Answers are kept in `interaction_responses`, by interaction id.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import math
import secrets
import time
from collections import defaultdict, deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import pytest
from aiohttp import WSMsgType, web

DEFAULT_TOKEN = "fake-discord-bot-token.0123456789"
TEXT_LIMIT = 2000
UPLOAD_LIMIT = 10 * 1024 * 1024
DISCORD_EPOCH_MS = 1_420_070_400_000
MESSAGE_CONTENT_INTENT = 1 << 15
PRIVILEGED_INTENTS = (1 << 1) | (1 << 8) | MESSAGE_CONTENT_INTENT  # members, presences, message content
RESUMABLE_FOR_S = 120.0

# Route names → (limit, window seconds); a bucket per route and channel.
DEFAULT_LIMITS: dict[str, tuple[int, float]] = {
    "post": (5, 5.0),
    "edit": (5, 5.0),
    "delete": (5, 1.0),
    "typing": (5, 5.0),
}


def _json(data: Any, status: int = 200) -> web.Response:
    """A JSON answer with Discord's exact Content-Type (discord.py compares it verbatim)."""
    return web.Response(body=json.dumps(data).encode(), status=status, headers={"Content-Type": "application/json"})


def now_iso() -> str:
    return datetime.now(UTC).isoformat()


@dataclass
class _Bucket:
    limit: int
    window: float
    count: int = 0
    reset_at: float = 0.0  # monotonic
    blocked_until: float = 0.0  # end of a 429's retry_after

    def take(self, now: float) -> float | None:
        """None when the call may go; else the seconds it must wait."""
        if now < self.blocked_until:
            return self.blocked_until - now
        if now >= self.reset_at:
            self.count, self.reset_at = 0, now + self.window
        if self.count >= self.limit:
            return self.reset_at - now
        self.count += 1
        return None


@dataclass
class _Session:
    id: str
    intents: int
    seq: int = 0
    log: list[dict[str, Any]] = field(default_factory=list)  # every dispatch, in order
    ws: web.WebSocketResponse | None = None
    request: web.Request | None = None
    outbox: asyncio.Queue[str] | None = None  # the attached connection's frames, in order
    closed_at: float | None = None
    invalid: bool = False


class FakeDiscord:
    """The fake server. Start with `await start()` (or the `fake_discord` fixture)."""

    def __init__(self, token: str = DEFAULT_TOKEN, *, bot_id: int = 900_000_000_000_000_001,
                 bot_name: str = "gateway-bot", granted_intents: int = PRIVILEGED_INTENTS,
                 limits: dict[str, tuple[int, float]] | None = None, interaction_deadline_s: float = 3.0) -> None:
        self.token = token
        self.interaction_deadline_s = interaction_deadline_s
        self._interactions: dict[int, tuple[str, float]] = {}  # id → (token, monotonic time dispatched)
        self.interaction_responses: dict[int, dict[str, Any]] = {}  # id → the callback's body
        self.late_responses: list[int] = []  # interactions answered after the deadline
        self.bot_id = bot_id
        self.bot_name = bot_name
        self.granted_intents = granted_intents  # the privileged intents the portal allows
        self.limits = {**DEFAULT_LIMITS, **(limits or {})}
        self.port = 0
        self.guild_id = self._snowflake()
        self.role_id = self._snowflake()  # the bot's managed role
        self.channel_id = self._snowflake()  # the guild's text channel, #general
        self.channels: dict[int, dict[str, Any]] = {
            self.channel_id: {"id": str(self.channel_id), "type": 0, "guild_id": str(self.guild_id),
                              "name": "general", "position": 0, "permission_overwrites": [], "nsfw": False,
                              "parent_id": None, "last_message_id": None},
        }
        self.messages: dict[int, dict[str, Any]] = {}  # every message, by id, as it is now
        self.deleted: list[int] = []
        self.calls: list[tuple[str, str]] = []  # (method, path) of every REST call
        self.sent: list[dict[str, Any]] = []  # messages the bot posted, as created
        self.edits: list[dict[str, Any]] = []  # successful edits: channel, id, content
        self.uploads: list[tuple[int, str, bytes]] = []  # (channel, file name, bytes)
        self.typing: list[int] = []
        self.rate_limited: list[str] = []  # routes of the 429s the fake decided itself
        self.scripted_429s: list[str] = []
        self.identifies: list[dict[str, Any]] = []
        self.resumes: list[dict[str, Any]] = []
        self.downloads: list[str] = []
        # Set (to a cleared event) by `hold_downloads`: each CDN download sends its first
        # bytes, then waits for it (a large file on a slow link, deterministically).
        self._held: asyncio.Event | None = None
        self.downloads_held = 0  # downloads waiting on the hold now
        # What happened to the bot's messages, in order: (what, channel, id, content).
        self.history: list[tuple[str, int, int, str]] = []
        self._sessions: dict[str, _Session] = {}
        self._buckets: dict[tuple[str, int], _Bucket] = {}
        self._forced: dict[str, deque[float]] = defaultdict(deque)
        self._nonces: dict[tuple[int, str], int] = {}
        self._dms: dict[int, int] = {}  # user → DM channel
        self._files: dict[str, tuple[bytes, str]] = {}  # CDN path → (bytes, content type)
        self._changed = asyncio.Event()
        self._gateway_open = asyncio.Event()  # cleared: new websockets wait (an outage)
        self._gateway_open.set()
        self._runner: web.AppRunner | None = None

    # ---------------------------------------------------------------- lifecycle

    @property
    def api_base(self) -> str:
        return f"http://127.0.0.1:{self.port}/api/v10"

    @property
    def gateway_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/gateway"

    async def start(self) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_get("/gateway", self._on_gateway)
        app.router.add_get("/attachments/{channel}/{id}/{name}", self._on_cdn)
        app.router.add_route("*", "/api/v10/{path:.*}", self._on_rest)
        self._runner = web.AppRunner(app, shutdown_timeout=1)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        for session in self._sessions.values():
            if session.ws is not None:
                with contextlib.suppress(Exception):
                    await session.ws.close(code=1001)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ---------------------------------------------------------------- test API: the world

    def add_thread(self, parent_id: int | None = None, *, name: str = "a thread", announce: bool = True) -> int:
        """A public thread in a channel; `announce` dispatches THREAD_CREATE (a thread the
        connected client has not heard of is learnt with `GET /channels/{id}`)."""
        thread_id = self._snowflake()
        parent = parent_id or self.channel_id
        self.channels[thread_id] = {
            "id": str(thread_id), "type": 11, "guild_id": str(self.guild_id), "parent_id": str(parent),
            "owner_id": "1", "name": name, "message_count": 0, "member_count": 1, "last_message_id": None,
            "thread_metadata": {"archived": False, "auto_archive_duration": 1440, "archive_timestamp": now_iso(),
                                "locked": False},
        }
        if announce:
            self._dispatch("THREAD_CREATE", {**self.channels[thread_id], "newly_created": True})
        return thread_id

    def dm_channel(self, user_id: int) -> int:
        channel_id = self._dms.get(user_id)
        if channel_id is None:
            channel_id = self._dms[user_id] = self._snowflake()
            self.channels[channel_id] = {"id": str(channel_id), "type": 1, "last_message_id": None,
                                         "recipients": [self.user(user_id)]}
        return channel_id

    def add_file(self, name: str, data: bytes, content_type: str, **extra: Any) -> dict[str, Any]:
        """An attachment served by the CDN, as a message carries it (`extra`: width,
        height, duration_secs, waveform …)."""
        attachment_id = self._snowflake()
        path = f"/attachments/{self.channel_id}/{attachment_id}/{name}"
        self._files[path] = (data, content_type)
        url = f"http://127.0.0.1:{self.port}{path}?ex=1&is=2&hm=signed"
        return {"id": str(attachment_id), "filename": name, "size": len(data), "url": url, "proxy_url": url,
                "content_type": content_type, **extra}

    def user(self, user_id: int, *, bot: bool = False) -> dict[str, Any]:
        return {"id": str(user_id), "username": f"user{user_id}", "discriminator": "0",
                "global_name": f"User {user_id}", "avatar": None, "bot": bot}

    @property
    def me(self) -> dict[str, Any]:
        return {**self.user(self.bot_id, bot=True), "username": self.bot_name, "global_name": None,
                "verified": True, "flags": 0, "mfa_enabled": False}

    # ---------------------------------------------------------------- test API: people

    def push_message(self, *, user_id: int, content: str = "", channel_id: int | None = None, dm: bool = False,
                     mentions: tuple[int, ...] = (), reply_to: int | None = None,
                     attachments: list[dict[str, Any]] | None = None, bot: bool = False, flags: int = 0,
                     role_mentions: tuple[int, ...] = ()) -> int:
        """A person's (or `bot`'s) new message, dispatched as MESSAGE_CREATE; its id. In a
        DM when `dm`, else in `channel_id` (default #general; a thread id for a thread)."""
        message_id = self._snowflake()
        channel = self.dm_channel(user_id) if dm else (channel_id or self.channel_id)
        message: dict[str, Any] = {
            "id": str(message_id), "channel_id": str(channel), "author": self.user(user_id, bot=bot),
            "content": content, "timestamp": now_iso(), "edited_timestamp": None, "tts": False,
            "mention_everyone": False, "mentions": [self.me if m == self.bot_id else self.user(m) for m in mentions],
            "mention_roles": [str(r) for r in role_mentions], "attachments": attachments or [], "embeds": [],
            "pinned": False, "type": 0, "flags": flags, "components": [],
        }
        if not dm:
            message["guild_id"] = str(self.guild_id)
            message["member"] = {"roles": [], "joined_at": now_iso(), "deaf": False, "mute": False, "flags": 0}
        if reply_to is not None:
            message["type"] = 19
            message["message_reference"] = {"message_id": str(reply_to), "channel_id": str(channel),
                                            **({} if dm else {"guild_id": str(self.guild_id)})}
            message["referenced_message"] = self.messages.get(reply_to)
        self.messages[message_id] = message
        self._dispatch("MESSAGE_CREATE", message)
        return message_id

    def push_click(self, *, user_id: int, message_id: int, custom_id: str, stale: bool = False) -> int:
        """A person presses the button `custom_id` of the bot's message `message_id`, in the
        message's channel (a DM, a guild channel or a thread); returns the interaction id."""
        message = self.messages.get(message_id)
        if message is None or message_id in self.deleted:
            raise AssertionError(f"no message {message_id}")
        shown = [c for row in message.get("components") or [] for c in row.get("components", [])]
        if not stale and not any(c.get("custom_id") == custom_id for c in shown):
            raise AssertionError(f"message {message_id} shows no button {custom_id!r}")
        channel_id = int(message["channel_id"])
        channel = self.channels[channel_id]
        interaction_id = self._snowflake()
        token = "itoken-" + secrets.token_hex(16)
        data: dict[str, Any] = {
            "id": str(interaction_id), "application_id": str(self.bot_id), "type": 3, "token": token, "version": 1,
            "data": {"custom_id": custom_id, "component_type": 2}, "channel_id": str(channel_id),
            "channel": channel, "message": message, "locale": "en-US", "app_permissions": "0",
            "attachment_size_limit": UPLOAD_LIMIT, "entitlements": [], "authorizing_integration_owners": {},
        }
        if "guild_id" in channel:
            data["guild_id"] = channel["guild_id"]
            data["guild_locale"] = "en-US"
            data["member"] = {"user": self.user(user_id), "roles": [], "joined_at": now_iso(), "deaf": False,
                              "mute": False, "flags": 0, "permissions": "0"}
            data["context"] = 0
        else:
            data["user"] = self.user(user_id)
            data["context"] = 1
        self._interactions[interaction_id] = (token, time.monotonic())
        self._dispatch("INTERACTION_CREATE", data)
        return interaction_id

    async def wait_response(self, interaction_id: int, timeout: float = 10) -> dict[str, Any]:
        """The callback that answered the interaction."""
        await self.wait_for(lambda: interaction_id in self.interaction_responses, timeout)
        return self.interaction_responses[interaction_id]

    def components(self, message_id: int) -> list[dict[str, Any]]:
        """The buttons message `message_id` shows now."""
        return [c for row in self.messages[message_id].get("components") or [] for c in row.get("components", [])]

    def redeliver(self, message_id: int) -> None:
        """Dispatch an earlier MESSAGE_CREATE again (a new sequence number, the same message)."""
        self._dispatch("MESSAGE_CREATE", self.messages[message_id])

    def rate_limit_next(self, route: str, retry_after: float) -> None:
        """The next call of `route` ("post", "edit", "delete", "typing") gets a 429."""
        self._forced[route].append(retry_after)

    def close_gateway(self) -> None:
        """An outage: new gateway websockets wait (unanswered) until `open_gateway`."""
        self._gateway_open.clear()

    def open_gateway(self) -> None:
        self._gateway_open.set()

    async def drop_connections(self) -> None:
        """Cut every gateway websocket as a network failure does (no close frame); the
        sessions stay resumable."""
        for session in self._sessions.values():
            if session.request is not None and session.request.transport is not None:
                session.request.transport.abort()
        await self.wait_for(lambda: not any(s.ws is not None for s in self._sessions.values()))

    # ---------------------------------------------------------------- test API: looking

    def connected(self) -> int:
        """Sessions with a websocket attached now."""
        return sum(1 for s in self._sessions.values() if s.ws is not None and not s.invalid)

    def visible(self, channel_id: int) -> list[str]:
        """What the bot shows in a channel now, oldest first (edits applied, deletions gone)."""
        return [m["content"] for m in self.messages.values()
                if int(m["channel_id"]) == channel_id and int(m["author"]["id"]) == self.bot_id
                and int(m["id"]) not in self.deleted]

    def bot_messages(self, channel_id: int) -> list[dict[str, Any]]:
        return [m for m in self.messages.values()
                if int(m["channel_id"]) == channel_id and int(m["author"]["id"]) == self.bot_id
                and int(m["id"]) not in self.deleted]

    async def wait_for(self, predicate: Callable[[], Any], timeout: float = 10) -> Any:
        async with asyncio.timeout(timeout):
            while True:
                self._changed.clear()
                value = predicate()
                if value:
                    return value
                await self._changed.wait()

    async def wait_visible(self, channel_id: int, predicate: Callable[[list[str]], bool],
                           timeout: float = 10) -> list[str]:
        await self.wait_for(lambda: predicate(self.visible(channel_id)), timeout)
        return self.visible(channel_id)

    async def wait_connected(self, sessions: int = 1, timeout: float = 10) -> None:
        await self.wait_for(lambda: self.connected() >= sessions, timeout)

    # ---------------------------------------------------------------- REST

    def _snowflake(self) -> int:
        stamp = int(time.time() * 1000) - DISCORD_EPOCH_MS
        last = getattr(self, "_last_snowflake", 0)
        value = max(stamp << 22, last + 1)
        self._last_snowflake = value
        return value

    def _notify(self) -> None:
        self._changed.set()

    @staticmethod
    def _error(status: int, code: int, message: str, **extra: Any) -> web.Response:
        return _json({"code": code, "message": message, **extra}, status=status)

    async def _on_rest(self, request: web.Request) -> web.StreamResponse:
        path = "/" + request.match_info["path"]
        self.calls.append((request.method, path))
        self._notify()
        parts = path.strip("/").split("/")
        if request.method == "POST" and len(parts) == 4 and parts[0] == "interactions" and parts[3] == "callback":
            return await self._interaction_callback(parts[1], parts[2], request)  # the token is the credential
        if request.headers.get("Authorization") != f"Bot {self.token}":
            return self._error(401, 0, "401: Unauthorized")
        parts = path.strip("/").split("/")
        method = request.method
        if method == "GET" and path == "/gateway/bot":
            return _json({"url": self.gateway_url, "shards": 1, "session_start_limit": {
                "total": 1000, "remaining": 999, "reset_after": 86_400_000, "max_concurrency": 1}})
        if method == "GET" and path == "/users/@me":
            return _json(self.me)
        if method == "GET" and path == "/oauth2/applications/@me":
            return _json({"id": str(self.bot_id), "name": self.bot_name, "description": "",
                                      "icon": None, "bot_public": False, "bot_require_code_grant": False,
                                      "owner": self.user(1), "verify_key": "00", "flags": 0})
        if method == "POST" and path == "/users/@me/channels":
            body = await request.json()
            recipient = int(body["recipient_id"])
            return _json(self.channels[self.dm_channel(recipient)])
        if parts[0] != "channels" or len(parts) < 2 or not parts[1].isdigit():
            return self._error(404, 0, "404: Not Found")
        channel_id = int(parts[1])
        if channel_id not in self.channels:
            return self._error(404, 10003, "Unknown Channel")
        if method == "GET" and len(parts) == 2:
            return _json(self.channels[channel_id])
        if method == "POST" and parts[2:] == ["typing"]:
            return await self._limited("typing", channel_id, lambda: self._typing(channel_id))
        if method == "POST" and parts[2:] == ["messages"]:
            payload, files = await self._read_message_body(request)
            return await self._limited("post", channel_id, lambda: self._create(channel_id, payload, files))
        if len(parts) == 4 and parts[2] == "messages" and parts[3].isdigit():
            message_id = int(parts[3])
            if method == "PATCH":
                payload, _ = await self._read_message_body(request)
                return await self._limited("edit", channel_id, lambda: self._edit(channel_id, message_id, payload))
            if method == "DELETE":
                return await self._limited("delete", channel_id, lambda: self._delete(channel_id, message_id))
        return self._error(405, 0, "405: Method Not Allowed")

    async def _read_message_body(self, request: web.Request) -> tuple[dict[str, Any], list[tuple[str, bytes]]]:
        if request.content_type.startswith("multipart/"):
            form = await request.post()
            payload = json.loads(str(form.get("payload_json") or "{}"))
            files = [(value.filename, value.file.read()) for key, value in form.items()
                     if key.startswith("files[") and isinstance(value, web.FileField)]
            return payload, files
        return await request.json(), []

    async def _limited(self, route: str, channel_id: int, answer: Callable[[], web.Response]) -> web.Response:
        limit, window = self.limits[route]
        bucket = self._buckets.setdefault((route, channel_id), _Bucket(limit, window))
        now = time.monotonic()
        forced = self._forced[route].popleft() if self._forced[route] else None
        wait = None if forced is not None else bucket.take(now)
        if forced is not None or wait is not None:
            retry_after = forced if forced is not None else float(wait or 0)
            if forced is not None:
                self.scripted_429s.append(route)
            else:
                self.rate_limited.append(route)
            bucket.blocked_until = max(bucket.blocked_until, now + retry_after)
            self._notify()
            response = _json({"message": "You are being rate limited.", "retry_after": retry_after,
                                          "global": False, "code": 0}, status=429)
            response.headers.update({"Retry-After": str(math.ceil(retry_after)), "X-RateLimit-Scope": "user",
                                     "Via": "1.1 google"})
            self._rate_headers(response, route, bucket, now, remaining=0)
            return response
        response = answer()
        self._rate_headers(response, route, bucket, now, remaining=max(bucket.limit - bucket.count, 0))
        self._notify()
        return response

    @staticmethod
    def _rate_headers(response: web.Response, route: str, bucket: _Bucket, now: float, remaining: int) -> None:
        reset_after = max(bucket.reset_at, bucket.blocked_until) - now
        response.headers.update({
            "X-RateLimit-Limit": str(bucket.limit),
            "X-RateLimit-Remaining": str(remaining),
            "X-RateLimit-Reset": f"{time.time() + reset_after:.3f}",
            "X-RateLimit-Reset-After": f"{max(reset_after, 0.0):.3f}",
            "X-RateLimit-Bucket": hashlib.sha256(route.encode()).hexdigest()[:16],
        })

    def _typing(self, channel_id: int) -> web.Response:
        self.typing.append(channel_id)
        return web.Response(status=204)

    async def _interaction_callback(self, raw_id: str, token: str, request: web.Request) -> web.Response:
        known = self._interactions.get(int(raw_id)) if raw_id.isdigit() else None
        if known is None or not secrets.compare_digest(known[0], token):
            return self._error(404, 10062, "Unknown interaction")
        interaction_id = int(raw_id)
        if interaction_id in self.interaction_responses:
            return self._error(400, 40060, "Interaction has already been acknowledged.")
        if time.monotonic() - known[1] > self.interaction_deadline_s:
            self.late_responses.append(interaction_id)
            self._notify()
            return self._error(404, 10062, "Unknown interaction")
        body = await request.json()
        kind = body.get("type") if isinstance(body, dict) else None
        if kind not in (1, 4, 5, 6, 7, 9, 10, 12):
            return self._error(400, 50035, "Invalid Form Body")
        data = body.get("data") or {}
        if kind == 4:
            problem = self._content_problem(data)
            if problem is not None:
                return problem
            if not (data.get("content") or data.get("embeds") or data.get("components")):
                return self._error(400, 50006, "Cannot send an empty message")
        self.interaction_responses[interaction_id] = body
        self._notify()
        return web.Response(status=204)

    def _content_problem(self, payload: dict[str, Any]) -> web.Response | None:
        content = payload.get("content")
        if content is not None and not isinstance(content, str):
            return self._error(400, 50035, "Invalid Form Body")
        if isinstance(content, str) and len(content) > TEXT_LIMIT:
            return self._error(400, 50035, "Invalid Form Body", errors={"content": {"_errors": [
                {"code": "BASE_TYPE_MAX_LENGTH", "message": f"Must be {TEXT_LIMIT} or fewer in length."}]}})
        problem = _components_problem(payload.get("components"))
        if problem is not None:
            return self._error(400, 50035, "Invalid Form Body", errors={"components": {"_errors": [
                {"code": "COMPONENT_INVALID", "message": problem}]}})
        return None

    def _create(self, channel_id: int, payload: dict[str, Any], files: list[tuple[str, bytes]]) -> web.Response:
        problem = self._content_problem(payload)
        if problem is not None:
            return problem
        content = payload.get("content") or ""
        if not content.strip() and not files and not payload.get("components"):
            return self._error(400, 50006, "Cannot send an empty message")
        if any(len(data) > UPLOAD_LIMIT for _, data in files):
            return self._error(413, 40005, "Request entity too large")
        nonce = payload.get("nonce")
        if nonce is not None and payload.get("enforce_nonce"):
            earlier = self._nonces.get((channel_id, str(nonce)))
            if earlier is not None:
                return _json(self.messages[earlier])
        message_id = self._snowflake()
        channel = self.channels[channel_id]
        attachments = []
        for name, data in files:
            self.uploads.append((channel_id, name, data))
            attachments.append({"id": str(self._snowflake()), "filename": name, "size": len(data),
                                "url": "", "proxy_url": ""})
        message: dict[str, Any] = {
            "id": str(message_id), "channel_id": str(channel_id), "author": self.me, "content": content,
            "timestamp": now_iso(), "edited_timestamp": None, "tts": False, "mention_everyone": False,
            "mentions": [], "mention_roles": [], "attachments": attachments, "embeds": [], "pinned": False,
            "type": 0, "flags": 0, "components": payload.get("components") or [],
            "allowed_mentions": payload.get("allowed_mentions"),
        }
        if "guild_id" in channel:
            message["guild_id"] = channel["guild_id"]
        reference = payload.get("message_reference")
        if isinstance(reference, dict) and reference.get("message_id"):
            referenced = self.messages.get(int(reference["message_id"]))
            if referenced is None and reference.get("fail_if_not_exists", True):
                return self._error(400, 50035, "Invalid Form Body")
            if referenced is not None:
                message["type"] = 19
                message["message_reference"] = {"message_id": referenced["id"], "channel_id": str(channel_id)}
                message["referenced_message"] = referenced
        if nonce is not None:
            message["nonce"] = nonce
            if payload.get("enforce_nonce"):
                self._nonces[(channel_id, str(nonce))] = message_id
        self.messages[message_id] = message
        self.sent.append(message)
        self.history.append(("post", channel_id, message_id, content))
        self._dispatch("MESSAGE_CREATE", message)
        return _json(message)

    def _edit(self, channel_id: int, message_id: int, payload: dict[str, Any]) -> web.Response:
        message = self.messages.get(message_id)
        if message is None or message_id in self.deleted or int(message["channel_id"]) != channel_id:
            return self._error(404, 10008, "Unknown Message")
        if int(message["author"]["id"]) != self.bot_id:
            return self._error(403, 50005, "Cannot edit a message authored by another user")
        problem = self._content_problem(payload)
        if problem is not None:
            return problem
        if "content" in payload:
            message["content"] = payload["content"] or ""
            message["edited_timestamp"] = now_iso()
        if "components" in payload:
            message["components"] = payload["components"] or []
        self.edits.append({"channel_id": channel_id, "id": message_id, "content": message["content"]})
        self.history.append(("edit", channel_id, message_id, message["content"]))
        self._dispatch("MESSAGE_UPDATE", message)
        return _json(message)

    def _delete(self, channel_id: int, message_id: int) -> web.Response:
        message = self.messages.get(message_id)
        if message is None or message_id in self.deleted or int(message["channel_id"]) != channel_id:
            return self._error(404, 10008, "Unknown Message")
        self.deleted.append(message_id)
        self.history.append(("delete", channel_id, message_id, ""))
        self._dispatch("MESSAGE_DELETE", {"id": str(message_id), "channel_id": str(channel_id),
                                          **({"guild_id": message["guild_id"]} if "guild_id" in message else {})})
        return web.Response(status=204)

    def delete_by_someone(self, message_id: int) -> None:
        """A moderator deletes one of the bot's messages."""
        self.deleted.append(message_id)
        self._notify()

    def hold_downloads(self) -> asyncio.Event:
        """From now on, every download sends its first 64 KB and then waits until the
        returned event is set (the test's `release`)."""
        self._held = asyncio.Event()
        return self._held

    async def _on_cdn(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        found = self._files.get(path)
        if found is None:
            return web.Response(status=404)
        self.downloads.append(path)
        self._notify()
        data, content_type = found
        held = self._held
        if held is None or held.is_set():
            return web.Response(body=data, content_type=content_type)
        resp = web.StreamResponse(headers={"Content-Type": content_type, "Content-Length": str(len(data))})
        await resp.prepare(request)
        await resp.write(data[:65536])
        self.downloads_held += 1
        self._notify()
        try:
            await held.wait()
        finally:
            self.downloads_held -= 1
        await resp.write(data[65536:])
        await resp.write_eof()
        return resp

    # ---------------------------------------------------------------- gateway

    def _guild_create(self) -> dict[str, Any]:
        channels = [c for c in self.channels.values() if c.get("guild_id") == str(self.guild_id) and c["type"] == 0]
        threads = [c for c in self.channels.values()
                   if c.get("guild_id") == str(self.guild_id) and c["type"] in (10, 11, 12)]
        roles = [{"id": str(self.guild_id), "name": "@everyone", "permissions": "0", "position": 0},
                 {"id": str(self.role_id), "name": self.bot_name, "permissions": "0", "position": 1, "managed": True,
                  "tags": {"bot_id": str(self.bot_id)}}]
        return {"id": str(self.guild_id), "name": "Test Server", "owner_id": "1", "roles": roles, "emojis": [],
                "stickers": [], "features": [], "channels": channels, "threads": threads, "members": [],
                "member_count": 3, "large": False, "unavailable": False, "joined_at": now_iso(),
                "voice_states": [], "presences": [], "stage_instances": [], "guild_scheduled_events": []}

    def _dispatch(self, event: str, data: dict[str, Any]) -> None:
        for session in list(self._sessions.values()):
            if session.invalid:
                continue
            self._send_dispatch(session, event, data)
        self._notify()

    def _send_dispatch(self, session: _Session, event: str, data: dict[str, Any]) -> None:
        session.seq += 1
        frame = {"op": 0, "s": session.seq, "t": event, "d": data}
        session.log.append(frame)
        if session.outbox is not None:
            session.outbox.put_nowait(json.dumps(frame))

    @staticmethod
    async def _write(ws: web.WebSocketResponse, outbox: asyncio.Queue[str]) -> None:
        while True:
            frame = await outbox.get()
            try:
                await ws.send_str(frame)
            except Exception:
                return

    async def _on_gateway(self, request: web.Request) -> web.StreamResponse:
        await asyncio.wait_for(self._gateway_open.wait(), 60)
        ws = web.WebSocketResponse(max_msg_size=4096 * 1024)
        await ws.prepare(request)
        session: _Session | None = None
        outbox: asyncio.Queue[str] = asyncio.Queue()
        writer = asyncio.ensure_future(self._write(ws, outbox))
        outbox.put_nowait(json.dumps({"op": 10, "d": {"heartbeat_interval": 41_250}}))
        try:
            async for frame in ws:
                if frame.type != WSMsgType.TEXT:
                    continue
                data = json.loads(frame.data)
                op = data.get("op")
                if op == 1:
                    outbox.put_nowait(json.dumps({"op": 11}))
                elif op == 2:
                    session = await self._identify(ws, request, outbox, data.get("d") or {})
                elif op == 6:
                    session = await self._resume(ws, request, outbox, data.get("d") or {})
        finally:
            writer.cancel()
            if session is not None and session.ws is ws:
                session.ws, session.request, session.outbox = None, None, None
                session.closed_at = time.monotonic()
                if ws.close_code in (1000, 1001):
                    session.invalid = True  # a clean close ends the session, as on Discord
            self._notify()
        return ws

    async def _identify(self, ws: web.WebSocketResponse, request: web.Request, outbox: asyncio.Queue[str],
                        data: dict[str, Any]) -> _Session | None:
        self.identifies.append(data)
        if data.get("token") != self.token:
            await ws.close(code=4004, message=b"Authentication failed.")
            return None
        intents = int(data.get("intents") or 0)
        if intents & PRIVILEGED_INTENTS & ~self.granted_intents:
            await ws.close(code=4014, message=b"Disallowed intent(s).")
            return None
        self._forget_old_sessions()
        session = _Session(secrets.token_hex(16), intents, ws=ws, request=request, outbox=outbox)
        self._sessions[session.id] = session
        self._send_dispatch(session, "READY", {
            "v": 10, "user": self.me, "guilds": [{"id": str(self.guild_id), "unavailable": True}],
            "session_id": session.id, "resume_gateway_url": self.gateway_url, "shard": [0, 1],
            "application": {"id": str(self.bot_id), "flags": 0}, "private_channels": [], "relationships": [],
        })
        self._send_dispatch(session, "GUILD_CREATE", self._guild_create())
        self._notify()
        return session

    async def _resume(self, ws: web.WebSocketResponse, request: web.Request, outbox: asyncio.Queue[str],
                      data: dict[str, Any]) -> _Session | None:
        self.resumes.append(data)
        session = self._sessions.get(str(data.get("session_id")))
        if data.get("token") != self.token or session is None or session.invalid or session.ws is not None:
            outbox.put_nowait(json.dumps({"op": 9, "d": False}))
            return None
        seq = data.get("seq") or 0
        session.ws, session.request, session.outbox, session.closed_at = ws, request, outbox, None
        for frame in session.log:
            if frame["s"] > seq:
                outbox.put_nowait(json.dumps(frame))
        self._send_dispatch(session, "RESUMED", {})
        self._notify()
        return session

    def _forget_old_sessions(self) -> None:
        now = time.monotonic()
        for key, session in list(self._sessions.items()):
            if session.invalid or (session.closed_at is not None and now - session.closed_at > RESUMABLE_FOR_S):
                del self._sessions[key]


def _components_problem(rows: Any) -> str | None:
    """What Discord refuses in a message's components, or None."""
    if rows is None:
        return None
    if not isinstance(rows, list) or len(rows) > 5:
        return "at most 5 action rows"
    custom_ids: set[str] = set()
    for row in rows:
        if not isinstance(row, dict) or row.get("type") != 1:
            return "a top-level component must be an action row"
        buttons = row.get("components")
        if not isinstance(buttons, list) or not 1 <= len(buttons) <= 5:
            return "an action row holds 1 to 5 buttons"
        for button in buttons:
            if not isinstance(button, dict) or button.get("type") != 2:
                return "unsupported component"
            style, label = button.get("style"), button.get("label")
            if style not in (1, 2, 3, 4, 5, 6):
                return "invalid button style"
            if label is not None and (not isinstance(label, str) or len(label) > 80):
                return "a label is at most 80 characters"
            if style == 5:
                if not isinstance(button.get("url"), str) or "custom_id" in button:
                    return "a link button has a url and no custom_id"
                continue
            custom_id = button.get("custom_id")
            if not isinstance(custom_id, str) or not 1 <= len(custom_id) <= 100:
                return "a custom_id is 1 to 100 characters"
            if custom_id in custom_ids:
                return "custom_ids must be unique"
            custom_ids.add(custom_id)
    return None


@pytest.fixture
async def fake_discord() -> AsyncIterator[FakeDiscord]:
    fake = FakeDiscord()
    await fake.start()
    yield fake
    await fake.stop()
