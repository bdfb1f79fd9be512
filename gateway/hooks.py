"""Inbound webhooks (SPEC §5.9): `POST /hooks/<name>` starts a turn whose reply lands in a chat.

A hook is a source of turns the operator configured (`hooks.<name>`), not a person: its
turn runs in the session `session` names, its text is `template` with the request's body
in place of `{body}`, stored as a user message with origin `hook:<name>`, and its reply
goes to the chat `deliver_to` names, through that channel's `send` (or its stream). It
passes no DM policy or group allowlist (the operator chose the chat), is nobody's admin,
and counts against its own budget as `hook:<name>`. Nothing in a body is expanded or read
as a command.

A request, in order: an unknown name is a 404, a body over MAX_BODY_BYTES a 413, a missing
or wrong `X-Hub-Signature-256` (GitHub's form: `sha256=` and the hex HMAC-SHA256 of the raw
body with the hook's secret, compared in constant time) a 401, an unusable delivery id or
body a 400, GitHub's `ping` a 200 without a turn, a hook over its daily budget a 429. Then
the turn is recorded under the event `hook:<name>:<delivery id>` in the router's dedup
table (the same `X-GitHub-Delivery` or `X-Request-Id` again is answered 200 "duplicate" and
never runs twice, also after a restart), queued in the session's FIFO, and the request is
answered 202: the model is never waited for. A full queue is a 503 with Retry-After, and a
retry with the same delivery id is accepted then.

Without a delivery header the event id is the body's SHA-256 within a 10-minute window
(DEDUP_WINDOW_S): a sender's retry of the same body is absorbed, the same body sent again
later is a new turn. The signature covers the body only (GitHub's scheme has no
timestamp), so HTTPS and the secret are what keep others out; the dedup is for honest
redeliveries.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import re
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs

from aiohttp import web

from context.outside import outside_block
from gateway.agents import agent_scope, bound_agent
from gateway.config.checks import usable_hook_secret
from gateway.config.schema import Config, HookConfig
from gateway.http.server import JSON_IN_THREAD_BYTES, JsonBodyError, parse_json_body
from gateway.keys import SessionPlace, parse_reply_place, parse_session_key
from gateway.services import Services
from gateway.store.errors import StoreError
from gateway.turns.router import clean_text
from gateway.turns.sessions import SessionManager, TurnJob
from gateway.types import HOOK_ORIGIN_PREFIX, Inbound, inbound_to_dict

log = logging.getLogger("gateway.hooks")

MAX_BODY_BYTES = 1024 * 1024  # a GitHub push of a few hundred commits fits; the text is capped anyway
SIGNATURE_HEADER = "X-Hub-Signature-256"
DELIVERY_HEADERS = ("X-GitHub-Delivery", "X-Request-Id")
DELIVERY_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
DEDUP_WINDOW_S = 600  # without a delivery header: the same body within this window is one turn
ACCEPT_TIMEOUT_S = 30.0  # recording and queueing the turn (the database may be slow, never the model)
BUSY_RETRY_AFTER_S = 30
BODY_PLACEHOLDER = "{body}"


class HookRefused(Exception):
    """A request the hook does not take: its HTTP status and why (told to the sender)."""

    def __init__(self, status: int, outcome: str, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.outcome = outcome
        self.reason = reason


def origin_of(name: str) -> str:
    """`hook:<name>`: the origin of its messages and the identity its budget counts."""
    return f"{HOOK_ORIGIN_PREFIX}{name}"


# -- pure parts ---------------------------------------------------------------------------


def signature_valid(secret: str, body: bytes, header: str | None) -> bool:
    """GitHub's `X-Hub-Signature-256: sha256=<hex HMAC-SHA256 of the body>`, in constant time."""
    if not secret or not header:
        return False
    scheme, _, given = header.strip().partition("=")
    if scheme.lower() != "sha256" or not given:
        return False
    expected = hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
    return hmac.compare_digest(expected.encode(), given.strip().lower().encode("utf-8", "replace"))


def sign(secret: str, body: bytes) -> str:
    """The `X-Hub-Signature-256` value a sender puts on `body`."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def delivery_of(headers: Any, body: bytes, now: float) -> str:
    """The request's delivery id: `X-GitHub-Delivery` or `X-Request-Id`, else the body's hash
    within DEDUP_WINDOW_S. Raises HookRefused for a header that is not a plain id."""
    for name in DELIVERY_HEADERS:
        value = headers.get(name)
        if value is None:
            continue
        value = value.strip()
        if not DELIVERY_ID.fullmatch(value):
            raise HookRefused(400, "bad_request", f"{name} must be 1-128 letters, digits and . _ : -")
        return value
    window = int(now // DEDUP_WINDOW_S)
    return f"body-{hashlib.sha256(body).hexdigest()[:32]}-{window}"


async def body_text(body: bytes, content_type: str) -> str:
    """The body as the turn shows it: JSON pretty-printed (also GitHub's form encoding, a
    `payload` field holding JSON), anything else as UTF-8 text. Raises JsonBodyError."""
    value: Any = None
    is_json = False
    if content_type == "application/json" or content_type.endswith("+json"):
        value, is_json = await parse_json_body(body), True
    elif content_type == "application/x-www-form-urlencoded":
        fields = parse_qs(body.decode("utf-8", "replace"), max_num_fields=1000)
        payload = fields.get("payload")
        if payload:
            value, is_json = await parse_json_body(payload[0]), True
    if not is_json:
        return clean_text(body.decode("utf-8", "replace"))
    if len(body) > JSON_IN_THREAD_BYTES:
        text = await asyncio.to_thread(json.dumps, value, indent=2, ensure_ascii=False)
    else:
        text = json.dumps(value, indent=2, ensure_ascii=False)
    return clean_text(text)


def turn_text(template: str, body: str, max_chars: int, source: str | None = None) -> str:
    """`template` with `body` at each `{body}`, at most `max_chars` long (SPEC §5.9, "capped
    like any message"): a body that does not fit is cut, and the text says so. With
    `source`, the body is fenced as outside content (SPEC §5.7): the template is the
    operator's instruction, the body only data."""
    def fenced(part: str) -> str:
        return outside_block(source, part) if source is not None else part

    slots = max(1, template.count(BODY_PLACEHOLDER))
    fixed = len(template) - template.count(BODY_PLACEHOLDER) * len(BODY_PLACEHOLDER) + slots * len(fenced(""))
    if fixed + slots * len(body) <= max_chars:
        return template.replace(BODY_PLACEHOLDER, fenced(body))
    notice = (f"\n[… the body was cut here: it has {len(body):,} characters and a message may have "
              f"{max_chars:,} (limits.max_inbound_chars)]")
    room = max(0, (max_chars - fixed) // slots - len(notice))
    return template.replace(BODY_PLACEHOLDER, fenced(body[:room] + notice))[:max_chars]


# -- the running part ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Accepted:
    status: int
    outcome: str  # queued | duplicate | ping
    event_id: str | None = None


class Hooks:
    """Serves `POST /hooks/<name>` from the running config (a reload adds, changes or removes
    hooks for the next request)."""

    def __init__(self, services: Services, sessions: SessionManager) -> None:
        self.s = services
        self.sessions = sessions

    def routes(self) -> list[web.RouteDef]:
        # Only POST: aiohttp answers other methods on this path with 405.
        return [web.post("/hooks/{name}", self.handle)]

    async def handle(self, request: web.Request) -> web.Response:
        name = request.match_info.get("name", "")
        try:
            accepted = await self._handle(name, request)
        except HookRefused as refused:
            self.s.metrics.hook_requests.labels(refused.outcome).inc()
            if refused.outcome != "unknown":  # a scan for names is not worth a line each
                log.warning("hook request refused", extra={"hook": name, "outcome": refused.outcome,
                                                           "status": refused.status, "reason": refused.reason})
            headers = {"Retry-After": str(BUSY_RETRY_AFTER_S)} if refused.status == 503 else None
            return web.json_response({"error": refused.reason}, status=refused.status, headers=headers)
        self.s.metrics.hook_requests.labels(accepted.outcome).inc()
        log.info("hook request", extra={"hook": name, "outcome": accepted.outcome, "event": accepted.event_id})
        return web.json_response({"status": accepted.outcome}, status=accepted.status)

    async def _handle(self, name: str, request: web.Request) -> Accepted:
        cfg = self.s.cfg
        hook = cfg.hooks.get(name)
        if hook is None:
            raise HookRefused(404, "unknown", "no such hook")
        body = await request.read()  # already read, within the server's size and time bounds
        if len(body) > MAX_BODY_BYTES:
            raise HookRefused(413, "too_large", f"the body is larger than {MAX_BODY_BYTES:,} bytes")
        secret = usable_hook_secret(hook.secret)
        if secret is None:  # refused at start and on reload; never let an empty key sign
            raise HookRefused(401, "unsigned", "this hook has no usable secret")
        if not signature_valid(secret, body, request.headers.get(SIGNATURE_HEADER)):
            raise HookRefused(401, "unsigned", f"missing or wrong {SIGNATURE_HEADER}")
        if request.headers.get("X-GitHub-Event", "").strip().lower() == "ping":
            return Accepted(200, "ping")  # GitHub's hello when the webhook is saved: no turn
        now = time.time()
        delivery = delivery_of(request.headers, body, now)
        try:
            text = turn_text(hook.template, await body_text(body, request.content_type),
                             cfg.limits.max_inbound_chars, source=f"webhook {name}").strip()
        except JsonBodyError as err:
            raise HookRefused(400, "bad_request", str(err)) from None
        if not text:
            raise HookRefused(400, "bad_request", "the body is empty and the template adds nothing")
        if not self.sessions.open.is_set():
            # Starting up: turns accepted before the restart are being queued first.
            raise HookRefused(503, "busy", "the gateway is starting; try again shortly")
        try:
            async with asyncio.timeout(ACCEPT_TIMEOUT_S):
                return await self._queue(cfg, name, hook, text, delivery, now)
        except TimeoutError:
            raise HookRefused(503, "busy", "the turn could not be queued in time; try again") from None
        except StoreError as err:
            # Not recorded, so not run: a 5xx makes the sender deliver it again later.
            log.error("hook request not stored", extra={"hook": name, "error": str(err)[:300]})
            raise HookRefused(503, "storage", "the gateway cannot store the request now; try again later") from None

    async def _queue(self, cfg: Config, name: str, hook: HookConfig, text: str, delivery: str,
                     now: float) -> Accepted:
        place = parse_reply_place(hook.deliver_to)
        session = parse_session_key(hook.session)
        assert place is not None and session is not None, "checked by the config schema"
        origin = origin_of(name)
        inbound = Inbound(channel=place.channel, chat_id=place.chat_id, user_id=origin, text=text,
                          event_id=f"{origin}:{delivery}", thread_id=place.thread_id, is_group=place.is_group,
                          user_name=f"webhook {name}", received_at=now, origin=origin)
        store = self.s.store
        if self.s.usage is not None and await self.s.usage.refusal(cfg, inbound.identity) is not None:
            raise HookRefused(429, "over_budget", f"{origin} used up today's budget (limits.*_per_user_per_day)")
        key = session.key
        scope = await self._scope(cfg, session)
        # The session's row first: a turn resumed after a crash finds its session and scope there.
        await store.ensure_session(key, scope, session.channel)
        record = inbound_to_dict(inbound)
        fresh = await store.record_event(inbound.channel, inbound.event_id, session_key=key, inbound=record)
        if not fresh:
            # Refused as busy before: nothing of it ran, so a retry is a new attempt.
            fresh = await store.retry_busy_event(inbound.channel, inbound.event_id, session_key=key, inbound=record)
        if not fresh:
            self.s.metrics.dedup_hits.labels(inbound.channel).inc()
            return Accepted(200, "duplicate", inbound.event_id)
        if not await self.sessions.submit(key, scope, TurnJob(inbound)):
            await store.mark_event(inbound.channel, inbound.event_id, "busy")
            raise HookRefused(503, "busy", f"the session {key} has a full queue; try again later")
        return Accepted(202, "queued", inbound.event_id)

    async def _scope(self, cfg: Config, session: SessionPlace) -> str:
        """The memory scope the hook's session uses: the one its key implies (with the agent
        its bindings pick), else (a Slack DM's key names no member) the one stored with it."""
        scope = session.memory_scope()
        if scope is not None:
            return agent_scope(bound_agent(cfg, session.probe()), scope)
        row = await self.s.store.get_session(session.key)
        if row is None:
            raise HookRefused(409, "no_session", f"{session.key} names a Slack DM nobody has written in yet; "
                                                 "write to the bot there once first")
        return str(row.scope)
