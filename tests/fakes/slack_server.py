"""A fake Slack: Web API under /api/<method>, a Socket Mode websocket, file downloads and
response_url hooks, on 127.0.0.1:<ephemeral port>. Real slack_sdk / slack-bolt clients
talk to it unchanged (base_url = FakeSlack.base_url).

Every Web API call is recorded in `calls`; waits are event based with timeouts; failures
are scripted with `fail_next`. `signed_event_request` builds the HTTP-mode requests Slack
would send to the gateway's /slack/events (correctly signed, forged or stale).

Messages the bot posts are kept as Slack would show them (`messages`, `visible`): posted,
edited (`chat.update`), deleted (`chat.delete`) or streamed (`chat.startStream` /
`appendStream` / `stopStream`, append-only while the stream is open). Slack's documented
rules are enforced: a stream needs `thread_ts`, and in channels the recipient's team and
user; `markdown_text` is at most 12,000 characters per call; `text` past 40,000 is cut
(`chat.postMessage`) or refused (`chat.update`). Per-method rate limits follow Slack's
tiers (token buckets per workspace, per channel for posting, per message for edits) and
answer HTTP 429 with an integer `Retry-After`; a call that comes back before that time is
recorded in `violations`. `rate_scale` speeds the fake's clock up for tests (limits and
Retry-After are in "Slack seconds" = real seconds * rate_scale).

Block Kit, as Slack checks it (chat.postMessage, chat.update): at most 50 blocks of known
types; a section's text 1-3,000 characters; an actions block 1-25 elements; a button's
text at most 75 characters, its action_id 255 and value 2,000, style `primary` or
`danger`; block ids unique in the message. A refusal is `invalid_blocks` with Slack's
`[ERROR] … [json-pointer:…]` line. People press buttons with `push_block_action` (Socket
Mode: an `interactive` envelope) or `block_action_request` (HTTP mode: the signed form
post Slack sends to the Interactivity Request URL); only a button the message shows now
can be pressed, unless `stale` (a client that has not seen the latest update yet).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import itertools
import json
import math
import time
import uuid
from collections import defaultdict, deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
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


TEXT_LIMIT = 40_000  # Slack cuts `text` here
MARKDOWN_LIMIT = 12_000  # `markdown_text` per call (chat.postMessage / update / *Stream)
MAX_BLOCKS = 50
SECTION_TEXT_LIMIT = 3000
BUTTON_TEXT_LIMIT = 75
MAX_ACTION_ELEMENTS = 25


@dataclass
class _Failure:
    status: int
    headers: dict[str, str]
    body: dict[str, Any]


@dataclass
class FakeMessage:
    """One message of the bot's as people see it."""

    channel: str
    ts: str
    thread_ts: str | None
    text: str
    format: str  # "mrkdwn" | "plain" | "markdown"
    streaming: bool = False  # an open chat.startStream: only appends until stopped
    deleted: bool = False
    history: list[str] = field(default_factory=list)  # every text it has shown, in order
    blocks: list[dict[str, Any]] | None = None  # its Block Kit blocks, as posted or last updated
    earlier_blocks: list[list[dict[str, Any]]] = field(default_factory=list)  # what it showed before

    def buttons(self, blocks: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        """The buttons of its actions blocks (now, or in `blocks`), in order."""
        return [e for b in (self.blocks if blocks is None else blocks) or () if b.get("type") == "actions"
                for e in b.get("elements", []) if e.get("type") == "button"]

    def section_texts(self) -> list[str]:
        """The text of each of its section blocks, in order (as sent: mrkdwn, escaped)."""
        return [b["text"]["text"] for b in self.blocks or () if b.get("type") == "section" and "text" in b]


@dataclass(frozen=True)
class RateLimit:
    """`per_s` calls a second sustained (Slack seconds), bursts of `burst`, counted per
    "workspace", "channel" or "message" (channel + ts)."""

    per_s: float
    burst: int
    per: str = "workspace"


# Slack's tiers (per method, per workspace): Tier 2 20+/min, Tier 3 50+/min, Tier 4 100+/min;
# edits of one message about 1/s. chat.postMessage (about 1/s per channel, "short bursts
# allowed") is limited only when a test asks (POST_LIMIT): the flood tests post hundreds
# of answers to one channel in seconds, and the adapter's answer to a 429 there is tested
# on its own.
POST_LIMIT = RateLimit(1.0, 5, "channel")
DEFAULT_LIMITS: dict[str, tuple[RateLimit, ...]] = {
    "chat.update": (RateLimit(1.0, 2, "message"), RateLimit(50 / 60, 50)),
    "chat.delete": (RateLimit(50 / 60, 50),),
    "chat.startStream": (RateLimit(20 / 60, 20),),
    "chat.appendStream": (RateLimit(100 / 60, 30),),
    "chat.stopStream": (RateLimit(20 / 60, 20),),
}


@dataclass
class _Bucket:
    tokens: float
    at: float
    blocked_until: float = 0.0


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
        self.call_times: list[float] = []  # time.monotonic() of each entry in `calls`
        self.latency: dict[str, float] = {}  # method → seconds before it answers (a slow Slack)
        self.posted: list[dict[str, Any]] = []  # chat.postMessage params, in order
        self.ephemeral: list[dict[str, Any]] = []  # chat.postEphemeral params
        self.responses: list[dict[str, Any]] = []  # bodies posted to response_url hooks
        self.reactions: list[tuple[str, dict[str, Any]]] = []  # ("add" | "remove", params)
        self.acked: set[str] = set()
        self.ack_payloads: dict[str, Any] = {}
        self.downloads: list[str] = []  # file ids served
        self.users: dict[str, dict[str, Any]] = {}
        self.sockets_opened = 0
        self.messages: dict[tuple[str, str], FakeMessage] = {}
        self.statuses: list[dict[str, Any]] = []  # assistant.threads.setStatus params
        self.thread_status: dict[tuple[str, str], str] = {}  # what each thread shows now
        # Older workspaces / tokens refuse the chat.*Stream methods: e.g. "unknown_method"
        # or "not_allowed_token_type".
        self.native_refusal: str | None = None
        self.status_refusal: str | None = None  # assistant.threads.setStatus refused
        self.limits: dict[str, tuple[RateLimit, ...]] = dict(DEFAULT_LIMITS)
        self.rate_scale = 1.0
        self.rate_limited: list[tuple[str, int]] = []  # (method, Retry-After) of each 429 sent
        self.violations: list[str] = []  # calls that came back before their Retry-After
        self._buckets: dict[tuple[str, str, str], _Bucket] = {}
        self._files: dict[str, tuple[bytes, str]] = {}
        self._pending_uploads: dict[str, tuple[str, int, bytes | None]] = {}  # file id -> (name, length, bytes)
        self.uploads: list[dict[str, Any]] = []  # files shared by files.completeUploadExternal, in order
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
        app.router.add_post("/upload/{file_id}", self._upload)
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

    def timed_calls(self, method: str) -> list[tuple[float, dict[str, Any]]]:
        return [(at, params) for at, (name, params) in zip(self.call_times, self.calls, strict=True)
                if name == method]

    def set_limit(self, method: str, *limits: RateLimit) -> None:
        self.limits[method] = limits

    def visible(self, channel: str, thread_ts: str | None = None) -> list[str]:
        """The texts of the bot's messages people see in a channel's top level (or in one
        thread), oldest first."""
        return [m.text for m in self.visible_messages(channel, thread_ts)]

    def visible_messages(self, channel: str, thread_ts: str | None = None) -> list[FakeMessage]:
        shown = [m for m in self.messages.values()
                 if m.channel == channel and m.thread_ts == thread_ts and not m.deleted]
        return sorted(shown, key=lambda m: _ts_key(m.ts))

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

    def block_actions_payload(self, *, user: str, channel: str, ts: str, action_id: str,
                              stale: bool = False) -> dict[str, Any]:
        """What Slack sends when `user` presses the button `action_id` of the bot's message
        `ts` in `channel` (only a button the message shows now, unless `stale`)."""
        message = self.messages.get((channel, ts))
        if message is None or message.deleted:
            raise AssertionError(f"no message {ts} in {channel}")
        versions = [message.blocks or []] + (list(reversed(message.earlier_blocks)) if stale else [])
        seen = next((v for v in versions if any(b.get("action_id") == action_id for b in message.buttons(v))), None)
        if seen is None:
            raise AssertionError(f"message {ts} shows no button {action_id!r}" + (" and never did" if stale else ""))
        button = next(b for b in message.buttons(seen) if b.get("action_id") == action_id)
        block_id = next((b.get("block_id", "") for b in seen if b.get("type") == "actions"), "")
        container: dict[str, Any] = {"type": "message", "message_ts": ts, "channel_id": channel,
                                     "is_ephemeral": False}
        shown: dict[str, Any] = {"type": "message", "ts": ts, "text": message.text, "user": self.bot_user_id,
                                 "bot_id": BOT_ID, "blocks": seen}
        if message.thread_ts:
            container["thread_ts"] = shown["thread_ts"] = message.thread_ts
        hook = f"hook{next(self._ids)}"
        return {
            "type": "block_actions", "api_app_id": "A1", "token": "verification-token",
            "user": {"id": user, "username": f"name-{user}", "name": f"name-{user}", "team_id": TEAM_ID},
            "team": {"id": TEAM_ID, "domain": "test"}, "enterprise": None, "is_enterprise_install": False,
            "container": container, "trigger_id": f"trigger.{uuid.uuid4().hex}",
            "channel": {"id": channel, "name": "directmessage" if channel.startswith("D") else "general"},
            "message": shown, "state": {"values": {}}, "response_url": f"{self.root_url}/response/{hook}",
            "actions": [{"type": "button", "action_id": action_id, "block_id": block_id, "text": button["text"],
                         "value": button.get("value", ""), "action_ts": f"{time.time():.6f}",
                         **({"style": button["style"]} if "style" in button else {})}],
        }

    async def push_block_action(self, *, user: str, channel: str, ts: str, action_id: str,
                                stale: bool = False) -> str:
        """A press of a button over Socket Mode (an `interactive` envelope); its envelope id."""
        payload = self.block_actions_payload(user=user, channel=channel, ts=ts, action_id=action_id, stale=stale)
        return await self.push_envelope("interactive", payload)

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
        self.call_times.append(time.monotonic())
        try:
            if method in self.latency:
                await asyncio.sleep(self.latency[method])
            failures = self._failures.get(method)
            if failures:
                failure = failures.popleft()
                return web.json_response(failure.body, status=failure.status, headers=failure.headers)
            token = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
            expected = self.app_token if method == "apps.connections.open" else self.bot_token
            if token != expected:
                return web.json_response({"ok": False, "error": "invalid_auth"})
            retry_after = self._rate_check(method, params)
            if retry_after is not None:
                self.rate_limited.append((method, retry_after))
                return web.json_response(
                    {"ok": False, "error": "ratelimited"}, status=429, headers={"Retry-After": str(retry_after)}
                )
            return web.json_response(self._answer(method, params))
        finally:
            await self._notify()

    async def _upload(self, request: web.Request) -> web.Response:
        """Step 2 of files_upload_v2: the bytes, exactly as long as announced."""
        file_id = request.match_info["file_id"]
        pending = self._pending_uploads.get(file_id)
        if pending is None:
            return web.Response(status=404, text="unknown upload")
        data = await request.read()
        if len(data) != pending[1]:
            return web.Response(status=400, text="length mismatch")
        self._pending_uploads[file_id] = (pending[0], pending[1], data)
        return web.Response(text="OK - " + str(len(data)))

    def _complete_upload(self, params: dict[str, Any]) -> dict[str, Any]:
        files = params.get("files")
        listed = json.loads(files) if isinstance(files, str) else files
        if not isinstance(listed, list) or not listed:
            return {"ok": False, "error": "invalid_arguments"}
        done: list[dict[str, Any]] = []
        for entry in listed:
            pending = self._pending_uploads.get(str(entry.get("id")))
            if pending is None or pending[2] is None:
                return {"ok": False, "error": "file_not_found"}
            done.append({"id": entry["id"], "title": entry.get("title") or pending[0], "name": pending[0]})
        for entry in done:
            name, _length, data = self._pending_uploads.pop(entry["id"])
            self.uploads.append({"channel": params.get("channel_id"), "thread_ts": params.get("thread_ts"),
                                 "name": name, "data": data})
        return {"ok": True, "files": done}

    def _answer(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        if method == "auth.test":
            return {
                "ok": True, "url": "https://test.slack.com/", "team": "Test", "user": "gateway",
                "team_id": TEAM_ID, "user_id": self.bot_user_id, "bot_id": BOT_ID,
            }
        if method == "apps.connections.open":
            return {"ok": True, "url": f"ws://127.0.0.1:{self.root_url.rsplit(':', 1)[1]}/socket?ticket=t1"}
        if method == "chat.postMessage":
            return self._post(params)
        if method == "files.getUploadURLExternal":
            length = int(params.get("length") or 0)
            if not params.get("filename") or length <= 0 or length > FILE_MAX_BYTES:
                return {"ok": False, "error": "invalid_arguments"}
            file_id = f"F{next(self._ids):06d}"
            self._pending_uploads[file_id] = (str(params["filename"]), length, None)
            return {"ok": True, "upload_url": f"{self.root_url}/upload/{file_id}", "file_id": file_id}
        if method == "files.completeUploadExternal":
            return self._complete_upload(params)
        if method in ("chat.startStream", "chat.appendStream", "chat.stopStream", "chat.update", "chat.delete"):
            return self._edit(method, params)
        if method == "assistant.threads.setStatus":
            if self.status_refusal:
                return {"ok": False, "error": self.status_refusal}
            self.statuses.append(params)
            self.thread_status[(str(params.get("channel_id")), str(params.get("thread_ts")))] = str(
                params.get("status", "")
            )
            return {"ok": True}
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

    # -- messages

    def _new_ts(self) -> str:
        return f"{int(time.time())}.{next(self._ids):06d}"

    def _add_message(self, channel: str, thread_ts: Any, text: str, fmt: str, *, streaming: bool = False) -> str:
        ts = self._new_ts()
        thread = str(thread_ts) if thread_ts else None
        self.messages[(channel, ts)] = FakeMessage(channel, ts, thread, text, fmt, streaming, history=[text])
        if thread is not None:
            self.thread_status.pop((channel, thread), None)  # a reply clears the thread's status
        return ts

    def _post(self, params: dict[str, Any]) -> dict[str, Any]:
        channel = str(params.get("channel", ""))
        for flag in ("unfurl_links", "unfurl_media"):  # booleans (form posts spell them as text)
            if flag in params and params[flag] not in (True, False, "true", "false", "1", "0"):
                return {"ok": False, "error": "invalid_arguments"}
        markdown = params.get("markdown_text")
        if markdown is not None:
            if params.get("text") or params.get("blocks"):
                return {"ok": False, "error": "markdown_text_conflict"}
            if len(str(markdown)) > MARKDOWN_LIMIT:
                return {"ok": False, "error": "msg_too_long"}
            text, fmt = str(markdown), "markdown"
        else:
            text = str(params.get("text") or "")
            if not text and not params.get("blocks"):
                return {"ok": False, "error": "no_text"}
            text = text[:TEXT_LIMIT]  # documented: Slack truncates past 40,000 characters
            fmt = "plain" if params.get("mrkdwn") in (False, "false", "0") else "mrkdwn"
        blocks = _blocks(params)
        if isinstance(blocks, dict):
            return blocks
        self.posted.append(params)
        ts = self._add_message(channel, params.get("thread_ts"), text, fmt)
        self.messages[(channel, ts)].blocks = blocks
        return {"ok": True, "channel": channel, "ts": ts, "message": {"text": text}}

    def _edit(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        channel = str(params.get("channel", ""))
        if method == "chat.startStream":
            return self._start_stream(channel, params)
        if method.endswith("Stream") and self.native_refusal:
            return {"ok": False, "error": self.native_refusal}
        message = self.messages.get((channel, str(params.get("ts", ""))))
        if message is None or message.deleted:
            return {"ok": False, "error": "message_not_found"}
        markdown = params.get("markdown_text")
        if markdown is not None and len(str(markdown)) > MARKDOWN_LIMIT:
            return {"ok": False, "error": "msg_too_long"}
        if method == "chat.delete":
            message.deleted = True
            return {"ok": True, "channel": channel, "ts": message.ts}
        if method == "chat.update":
            if message.streaming:
                return {"ok": False, "error": "cant_update_message"}  # stop the stream first
            if markdown is not None:
                if params.get("text") or params.get("blocks"):
                    return {"ok": False, "error": "markdown_text_conflict"}
                text, fmt = str(markdown), "markdown"
            else:
                text, fmt = str(params.get("text") or ""), "mrkdwn"
                if not text:
                    return {"ok": False, "error": "no_text"}
                if len(text) > TEXT_LIMIT:
                    return {"ok": False, "error": "msg_too_long"}
            if "blocks" in params:  # blocks not given: the message keeps its own
                blocks = _blocks(params)
                if isinstance(blocks, dict):
                    return blocks
                if message.blocks:
                    message.earlier_blocks.append(message.blocks)
                message.blocks = blocks
            message.text, message.format = text, fmt
            message.history.append(text)
            return {"ok": True, "channel": channel, "ts": message.ts, "text": text}
        if not message.streaming:
            return {"ok": False, "error": "message_not_in_streaming_state"}
        if method == "chat.appendStream" and not markdown:
            return {"ok": False, "error": "no_text"}
        if len(message.text) + len(str(markdown or "")) > TEXT_LIMIT:
            return {"ok": False, "error": "msg_too_long"}
        if markdown:
            message.text += str(markdown)
            message.history.append(message.text)
        if method == "chat.stopStream":
            message.streaming = False
        return {"ok": True, "channel": channel, "ts": message.ts}

    def _start_stream(self, channel: str, params: dict[str, Any]) -> dict[str, Any]:
        if self.native_refusal:
            return {"ok": False, "error": self.native_refusal}
        thread_ts = params.get("thread_ts")
        if not thread_ts:
            return {"ok": False, "error": "invalid_arguments",
                    "response_metadata": {"messages": ["[ERROR] missing required field: thread_ts"]}}
        if not channel.startswith("D"):  # streaming to a channel names who receives it
            if not params.get("recipient_team_id"):
                return {"ok": False, "error": "missing_recipient_team_id"}
            if not params.get("recipient_user_id"):
                return {"ok": False, "error": "missing_recipient_user_id"}
        markdown = str(params.get("markdown_text") or "")
        if len(markdown) > MARKDOWN_LIMIT:
            return {"ok": False, "error": "msg_too_long"}
        ts = self._add_message(channel, thread_ts, markdown, "markdown", streaming=True)
        return {"ok": True, "channel": channel, "ts": ts}

    # -- rate limits

    def _rate_check(self, method: str, params: dict[str, Any]) -> int | None:
        """None when the call may go through, else the Retry-After (whole Slack seconds)."""
        limits = self.limits.get(method, ())
        now = time.monotonic()
        keys = []
        for limit in limits:
            if limit.per == "channel":
                key = str(params.get("channel", ""))
            elif limit.per == "message":
                key = f"{params.get('channel', '')}:{params.get('ts', '')}"
            else:
                key = TEAM_ID
            keys.append((limit, (method, limit.per, key)))
        wait = 0.0
        for limit, key in keys:
            rate = limit.per_s * self.rate_scale
            bucket = self._buckets.setdefault(key, _Bucket(float(limit.burst), now))
            bucket.tokens = min(float(limit.burst), bucket.tokens + (now - bucket.at) * rate)
            bucket.at = now
            if now < bucket.blocked_until - 0.005:
                self.violations.append(f"{method} {key[2]} came back {bucket.blocked_until - now:.3f}s early")
            if bucket.tokens < 1.0:
                wait = max(wait, (1.0 - bucket.tokens) / rate)
        if wait <= 0:
            for _, key in keys:
                self._buckets[key].tokens -= 1.0
            return None
        retry_after = max(1, math.ceil(wait * self.rate_scale))
        for _, key in keys:
            bucket = self._buckets[key]
            bucket.blocked_until = max(bucket.blocked_until, now + retry_after / self.rate_scale)
        return retry_after

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


def _ts_key(ts: str) -> tuple[int, int]:
    seconds, _, micros = ts.partition(".")
    return int(seconds or 0), int(micros or 0)


FILE_MAX_BYTES = 1024 * 1024 * 1024  # Slack: files up to 1 GB


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


def _blocks(params: dict[str, Any]) -> list[dict[str, Any]] | dict[str, Any] | None:
    """The message's blocks (None without), or Slack's refusal (a dict with ok false)."""
    raw = params.get("blocks")
    if raw is None or raw == "":
        return None
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError:
            return _invalid_blocks("invalid JSON", "")
    if not isinstance(raw, list):
        return _invalid_blocks("must be an array", "")
    if len(raw) > MAX_BLOCKS:
        return _invalid_blocks(f"no more than {MAX_BLOCKS} items allowed", "")
    block_ids: set[str] = set()
    for i, block in enumerate(raw):
        problem = _block_problem(block, block_ids)
        if problem is not None:
            return _invalid_blocks(problem[0], f"/{i}{problem[1]}")
    return raw


def _text_problem(obj: Any, limit: int, *, plain_only: bool = False) -> tuple[str, str] | None:
    kinds = ("plain_text",) if plain_only else ("plain_text", "mrkdwn")
    if not isinstance(obj, dict) or obj.get("type") not in kinds:
        return "must be a text object", ""
    text = obj.get("text")
    if not isinstance(text, str) or not text:
        return "must be more than 0 characters", "/text"
    if len(text) > limit:
        return f"must be less than {limit + 1} characters", "/text"
    return None


def _block_problem(block: Any, block_ids: set[str]) -> tuple[str, str] | None:
    """(what is wrong, where below the block) or None."""
    if not isinstance(block, dict):
        return "must be an object", ""
    block_id = block.get("block_id")
    if block_id is not None:
        if not isinstance(block_id, str) or not 0 < len(block_id) <= 255:
            return "must be less than 256 characters", "/block_id"
        if block_id in block_ids:
            return "block_id must be unique", "/block_id"
        block_ids.add(block_id)
    kind = block.get("type")
    if kind == "section":
        problem = _text_problem(block.get("text"), SECTION_TEXT_LIMIT)
        return (problem[0], "/text" + problem[1]) if problem else None
    if kind == "context":
        elements = block.get("elements")
        if not isinstance(elements, list) or not 0 < len(elements) <= 10:
            return "must provide between 1 and 10 items", "/elements"
        for i, element in enumerate(elements):
            problem = _text_problem(element, SECTION_TEXT_LIMIT)
            if problem:
                return problem[0], f"/elements/{i}{problem[1]}"
        return None
    if kind == "actions":
        elements = block.get("elements")
        if not isinstance(elements, list) or not 0 < len(elements) <= MAX_ACTION_ELEMENTS:
            return f"must provide between 1 and {MAX_ACTION_ELEMENTS} items", "/elements"
        action_ids: set[str] = set()
        for i, element in enumerate(elements):
            problem = _button_problem(element, action_ids)
            if problem:
                return problem[0], f"/elements/{i}{problem[1]}"
        return None
    if kind == "header":
        problem = _text_problem(block.get("text"), 150, plain_only=True)
        return (problem[0], "/text" + problem[1]) if problem else None
    if kind == "divider":
        return None
    return f"unsupported type: {kind}", "/type"


def _button_problem(element: Any, action_ids: set[str]) -> tuple[str, str] | None:
    if not isinstance(element, dict) or element.get("type") != "button":
        return "unsupported element", "/type"
    problem = _text_problem(element.get("text"), BUTTON_TEXT_LIMIT, plain_only=True)
    if problem:
        return problem[0], "/text" + problem[1]
    action_id = element.get("action_id")
    if action_id is not None:
        if not isinstance(action_id, str) or not 0 < len(action_id) <= 255:
            return "must be less than 256 characters", "/action_id"
        if action_id in action_ids:
            return "action_id must be unique in the block", "/action_id"
        action_ids.add(action_id)
    value = element.get("value")
    if value is not None and (not isinstance(value, str) or len(value) > 2000):
        return "must be less than 2001 characters", "/value"
    if element.get("style") not in (None, "primary", "danger"):
        return "must be one of primary, danger", "/style"
    return None


def _invalid_blocks(problem: str, pointer: str) -> dict[str, Any]:
    return {"ok": False, "error": "invalid_blocks",
            "response_metadata": {"messages": [f"[ERROR] {problem} [json-pointer:/blocks{pointer}]"]}}


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


def signed_interaction_request(
    signing_secret: str, payload: dict[str, Any], *, timestamp: int | None = None, forge: bool = False
) -> tuple[bytes, dict[str, str]]:
    """An interaction (a button press) as Slack posts it to the Interactivity Request URL:
    a form with one field, `payload`, the JSON."""
    raw = urlencode({"payload": json.dumps(payload)}).encode()
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
