"""A fake Slack: Web API under /api/<method>, a Socket Mode websocket, file downloads and
response_url hooks, on 127.0.0.1:<ephemeral port>. Real slack_sdk / slack-bolt clients
talk to it unchanged (base_url = FakeSlack.base_url).

Every Web API call is recorded in `calls`; waits are event based with timeouts; failures
are scripted with `fail_next`. `signed_event_request` builds the HTTP-mode requests Slack
would send to the gateway's /slack/events (correctly signed, forged or stale).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import itertools
import json
import time
import uuid
from collections import defaultdict, deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlencode

import pytest
from aiohttp import WSMsgType, web

BOT_TOKEN = "xoxb-test-bot-token"
APP_TOKEN = "xapp-test-app-token"
SIGNING_SECRET = "test-signing-secret"
BOT_USER_ID = "UBOT"
BOT_ID = "BBOT"
TEAM_ID = "T1"


@dataclass
class _Failure:
    status: int
    headers: dict[str, str]
    body: dict[str, Any]


class FakeSlack:
    """The fake server. `await start()` / `await stop()`, or use the `fake_slack` fixture."""

    def __init__(
        self, *, bot_token: str = BOT_TOKEN, app_token: str = APP_TOKEN, bot_user_id: str = BOT_USER_ID
    ) -> None:
        self.bot_token = bot_token
        self.app_token = app_token
        self.bot_user_id = bot_user_id
        self.base_url = ""  # "http://127.0.0.1:PORT/api/" once started
        self.root_url = ""
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.posted: list[dict[str, Any]] = []  # chat.postMessage params, in order
        self.ephemeral: list[dict[str, Any]] = []  # chat.postEphemeral params
        self.responses: list[dict[str, Any]] = []  # bodies posted to response_url hooks
        self.reactions: list[tuple[str, dict[str, Any]]] = []  # ("add" | "remove", params)
        self.acked: set[str] = set()
        self.ack_payloads: dict[str, Any] = {}
        self.downloads: list[str] = []  # file ids served
        self.users: dict[str, dict[str, Any]] = {}
        self.sockets_opened = 0
        self._files: dict[str, tuple[bytes, str]] = {}
        self._failures: dict[str, deque[_Failure]] = defaultdict(deque)
        self._sockets: list[web.WebSocketResponse] = []
        self._changed = asyncio.Condition()
        self._ids = itertools.count(1)
        self._runner: web.AppRunner | None = None

    # -- lifecycle

    async def start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/api/{method}", self._api)
        app.router.add_get("/socket", self._socket)
        app.router.add_get("/files/{file_id}/{name:.*}", self._file)
        app.router.add_post("/response/{hook}", self._response_url)
        self._runner = web.AppRunner(app, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.root_url = f"http://127.0.0.1:{port}"
        self.base_url = f"{self.root_url}/api/"

    async def stop(self) -> None:
        await self.drop_sockets()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # -- scripting

    def fail_next(
        self, method: str, status: int, headers: dict[str, str] | None = None,
        body: dict[str, Any] | None = None,
    ) -> None:
        """The next call of `method` answers `status` (e.g. 429 + {"Retry-After": "1"}).
        Queued per method; each scripted failure is used once."""
        if body is None:
            body = {"ok": False, "error": "ratelimited" if status == 429 else "fake_failure"}
        self._failures[method].append(_Failure(status, dict(headers or {}), body))

    def add_user(self, user_id: str, name: str, display_name: str = "") -> None:
        self.users[user_id] = {
            "id": user_id, "name": name, "real_name": name,
            "profile": {"display_name": display_name, "real_name": name},
        }

    def add_file(self, name: str, content: bytes, mimetype: str = "text/plain") -> dict[str, Any]:
        """Register a downloadable file; returns the Slack file object to put in an event."""
        file_id = f"F{next(self._ids):06d}"
        self._files[file_id] = (content, mimetype)
        url = f"{self.root_url}/files/{file_id}/{quote(name, safe='')}"
        return {
            "id": file_id, "name": name, "title": name, "mimetype": mimetype, "size": len(content),
            "mode": "hosted", "url_private": url, "url_private_download": url + "?download=1",
        }

    @property
    def open_sockets(self) -> int:
        return sum(1 for ws in self._sockets if not ws.closed)

    async def drop_sockets(self) -> None:
        """Close every Socket Mode connection from the server side (the client reconnects)."""
        for ws in list(self._sockets):
            await ws.close()

    def method_calls(self, method: str) -> list[dict[str, Any]]:
        return [params for name, params in self.calls if name == method]

    # -- pushing over Socket Mode

    async def push_event(
        self, event: dict[str, Any], *, event_id: str | None = None, retry_num: int | None = None
    ) -> str:
        """Send an events_api envelope to the connected app; returns its envelope_id."""
        payload = {
            "token": "verification-token",
            "team_id": TEAM_ID,
            "api_app_id": "A1",
            "event": event,
            "type": "event_callback",
            "event_id": event_id or f"Ev{next(self._ids):08d}",
            "event_time": int(time.time()),
            "authorizations": [{"team_id": TEAM_ID, "user_id": self.bot_user_id, "is_bot": True}],
        }
        return await self.push_envelope("events_api", payload, retry_num=retry_num)

    async def push_slash_command(self, command: str, text: str, *, user: str, channel: str) -> str:
        hook = f"hook{next(self._ids)}"
        payload = {
            "token": "verification-token",
            "team_id": TEAM_ID,
            "team_domain": "test",
            "channel_id": channel,
            "channel_name": "directmessage" if channel.startswith("D") else "general",
            "user_id": user,
            "user_name": f"name-{user}",
            "command": command,
            "text": text,
            "api_app_id": "A1",
            "response_url": f"{self.root_url}/response/{hook}",
            "trigger_id": f"trigger.{uuid.uuid4().hex}",
        }
        return await self.push_envelope("slash_commands", payload, accepts_response_payload=True)

    async def push_envelope(
        self, kind: str, payload: Any, *, retry_num: int | None = None, accepts_response_payload: bool = False
    ) -> str:
        ws = await self.wait_connected()
        envelope_id = str(uuid.uuid4())
        envelope: dict[str, Any] = {
            "envelope_id": envelope_id,
            "type": kind,
            "payload": payload,
            "accepts_response_payload": accepts_response_payload,
        }
        if kind == "events_api":
            envelope["retry_attempt"] = retry_num or 0
            envelope["retry_reason"] = "timeout" if retry_num else ""
        await ws.send_str(json.dumps(envelope))
        return envelope_id

    async def push_raw(self, text: str) -> None:
        """Send any text frame (junk tests)."""
        ws = await self.wait_connected()
        await ws.send_str(text)

    # -- waits

    async def wait_for(self, predicate: Callable[[], Any], timeout: float = 5) -> Any:
        """Wait until `predicate()` is truthy (re-checked on every recorded change)."""
        async with self._changed:
            return await asyncio.wait_for(self._changed.wait_for(predicate), timeout)

    async def wait_connected(self, timeout: float = 5) -> web.WebSocketResponse:
        live: list[web.WebSocketResponse] = await self.wait_for(
            lambda: [ws for ws in self._sockets if not ws.closed], timeout
        )
        return live[-1]

    async def wait_posted(self, n: int, timeout: float = 5) -> list[dict[str, Any]]:
        await self.wait_for(lambda: len(self.posted) >= n, timeout)
        return list(self.posted)

    async def wait_acked(self, envelope_id: str, timeout: float = 5) -> None:
        await self.wait_for(lambda: envelope_id in self.acked, timeout)

    async def wait_calls(
        self, method: str, n: int = 1, timeout: float = 5
    ) -> list[dict[str, Any]]:
        await self.wait_for(lambda: len(self.method_calls(method)) >= n, timeout)
        return self.method_calls(method)

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    # -- handlers

    async def _api(self, request: web.Request) -> web.Response:
        method = request.match_info["method"]
        params = await _params(request)
        self.calls.append((method, params))
        try:
            failures = self._failures.get(method)
            if failures:
                failure = failures.popleft()
                return web.json_response(failure.body, status=failure.status, headers=failure.headers)
            token = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
            expected = self.app_token if method == "apps.connections.open" else self.bot_token
            if token != expected:
                return web.json_response({"ok": False, "error": "invalid_auth"})
            return web.json_response(self._answer(method, params))
        finally:
            await self._notify()

    def _answer(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        if method == "auth.test":
            return {
                "ok": True, "url": "https://test.slack.com/", "team": "Test", "user": "gateway",
                "team_id": TEAM_ID, "user_id": self.bot_user_id, "bot_id": BOT_ID,
            }
        if method == "apps.connections.open":
            return {"ok": True, "url": f"ws://127.0.0.1:{self.root_url.rsplit(':', 1)[1]}/socket?ticket=t1"}
        if method == "chat.postMessage":
            self.posted.append(params)
            ts = f"{int(time.time())}.{next(self._ids):06d}"
            message = {"text": params.get("text")}
            return {"ok": True, "channel": params.get("channel"), "ts": ts, "message": message}
        if method == "chat.postEphemeral":
            self.ephemeral.append(params)
            return {"ok": True, "message_ts": f"{int(time.time())}.{next(self._ids):06d}"}
        if method in ("reactions.add", "reactions.remove"):
            self.reactions.append((method.split(".")[1], params))
            return {"ok": True}
        if method == "users.info":
            user = self.users.get(str(params.get("user")))
            return {"ok": True, "user": user} if user else {"ok": False, "error": "user_not_found"}
        return {"ok": True}

    async def _socket(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(autoping=True)
        await ws.prepare(request)
        self._sockets.append(ws)
        self.sockets_opened += 1
        await ws.send_str(json.dumps({
            "type": "hello", "num_connections": 1,
            "debug_info": {"host": "fake", "approximate_connection_time": 3600},
            "connection_info": {"app_id": "A1"},
        }))
        await self._notify()
        try:
            async for msg in ws:
                if msg.type != WSMsgType.TEXT:
                    continue
                try:
                    data = json.loads(msg.data)
                except ValueError:
                    continue
                if isinstance(data, dict) and isinstance(data.get("envelope_id"), str):
                    self.acked.add(data["envelope_id"])
                    self.ack_payloads[data["envelope_id"]] = data.get("payload")
                    await self._notify()
        finally:
            self._sockets.remove(ws)
            await self._notify()
        return ws

    async def _file(self, request: web.Request) -> web.Response:
        file_id = request.match_info["file_id"]
        if request.headers.get("Authorization") != f"Bearer {self.bot_token}":
            # What Slack does without a token: a 200 HTML login page.
            return web.Response(text="<html>sign in</html>", content_type="text/html")
        if file_id not in self._files:
            return web.Response(status=404)
        content, mime = self._files[file_id]
        self.downloads.append(file_id)
        await self._notify()
        return web.Response(body=content, content_type=mime)

    async def _response_url(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.responses.append({"hook": request.match_info["hook"], **body})
        await self._notify()
        return web.Response(text="ok")


async def _params(request: web.Request) -> dict[str, Any]:
    params: dict[str, Any] = dict(request.query)
    if request.can_read_body:
        if request.content_type == "application/json":
            body = await request.json()
            if isinstance(body, dict):
                params.update(body)
        else:
            params.update(dict(await request.post()))
    return params


# ---------------------------------------------------------------------------- HTTP mode


def sign(signing_secret: str, body: bytes, timestamp: int) -> str:
    base = b"v0:" + str(timestamp).encode() + b":" + body
    return "v0=" + hmac.new(signing_secret.encode(), base, hashlib.sha256).hexdigest()


def signed_request(
    signing_secret: str, body: bytes, content_type: str, *, timestamp: int | None = None,
    forge: bool = False, retry_num: int | None = None,
) -> tuple[bytes, dict[str, str]]:
    ts = int(time.time()) if timestamp is None else timestamp
    signature = sign("not-" + signing_secret if forge else signing_secret, body, ts)
    headers = {
        "Content-Type": content_type,
        "X-Slack-Request-Timestamp": str(ts),
        "X-Slack-Signature": signature,
    }
    if retry_num is not None:
        headers["X-Slack-Retry-Num"] = str(retry_num)
        headers["X-Slack-Retry-Reason"] = "http_timeout"
    return body, headers


def signed_event_request(
    signing_secret: str, body: dict[str, Any], *, timestamp: int | None = None,
    forge: bool = False, retry_num: int | None = None,
) -> tuple[bytes, dict[str, str]]:
    """A POST /slack/events request as Slack sends it: JSON body and its headers.
    `forge` signs with a wrong secret; pass an old `timestamp` for a stale one."""
    raw = json.dumps(body).encode()
    return signed_request(
        signing_secret, raw, "application/json", timestamp=timestamp, forge=forge, retry_num=retry_num
    )


def signed_command_request(
    signing_secret: str, fields: dict[str, str], *, timestamp: int | None = None, forge: bool = False
) -> tuple[bytes, dict[str, str]]:
    """A slash command as Slack posts it in HTTP mode (form-encoded)."""
    raw = urlencode(fields).encode()
    return signed_request(
        signing_secret, raw, "application/x-www-form-urlencoded", timestamp=timestamp, forge=forge
    )


def event_callback(event: dict[str, Any], *, event_id: str | None = None) -> dict[str, Any]:
    """The Events API body around one event (HTTP mode)."""
    return {
        "token": "verification-token",
        "team_id": TEAM_ID,
        "api_app_id": "A1",
        "event": event,
        "type": "event_callback",
        "event_id": event_id or f"Ev{uuid.uuid4().hex[:10]}",
        "event_time": int(time.time()),
    }


@pytest.fixture
async def fake_slack() -> AsyncIterator[FakeSlack]:
    server = FakeSlack()
    await server.start()
    try:
        yield server
    finally:
        await server.stop()
