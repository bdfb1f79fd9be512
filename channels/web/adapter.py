"""The local web chat: a small page and `POST /api/chat` on the gateway's HTTP server.

`{"session": "alice", "text": "hi"}` → `{"reply": "..."}`. Every request to /api/* needs
the token, on loopback too (SPEC §9; being on this machine proves nothing: a sandboxed
command with the network on is on it too): `channels.web.token`, else the data dir's own
(gateway/http/web_token.py). Programs send it as `Authorization: Bearer <token>`. The
person opens the link the gateway prints (`/?token=…`), which sets an HttpOnly,
SameSite=Strict cookie and sends the browser on without the token in the address. A
cookie goes with every request the browser makes here, also those another page of this
machine makes, so requests it authorizes must name this server in `Host` (on loopback:
DNS rebinding), must not come from another origin, and a POST must be JSON (a cross-site
form or text/plain POST needs no CORS preflight; `application/json` does, which we never
grant). The page's shell loads without a token; its requests are refused until it has one.

With `"stream": true` (or `Accept: text/event-stream`) the answer is Server-Sent Events
(SPEC §5.1): `delta` {"text"} as the reply grows, `status` {"text"} while tools run
(it replaces what was shown), then `done` {"reply"} or `error` {"error"}.
`GET /api/history?session=NAME[&limit=N][&before=CURSOR]` returns a page of the session's
messages, newest page first: at most N and about HISTORY_PAGE_CHARS of text, with `before`,
the cursor of the page before it (null at the start), so a client reads all of a long
session page by page and no answer holds all of it. Each entry has a `kind`: `message`,
`command` (an in-chat command or its answer, kept apart from the conversation) or
`divider` (a fresh context started there: /new, /context clear).

`GET /api/events?session=NAME` is the session's Server-Sent Events for an open page:
`reply` {"text", "at", "failed"} when a reply reaches the session while none of its
requests waits (a scheduled task's, one that came after the page stopped waiting),
`resync` when a reconnecting page missed more than is kept (channels/web/events.py).

A tool that waits for a person's yes (SPEC §5.7) shows as an `approval` event {"id", "tool",
"arguments", "who", "timeout_s", "files": [{"heading", "text"}]} in the streamed reply (all
of it `visible()`: control characters and bidi controls as escapes), and `approval_done` {"id",
"outcome"} once decided; the page's buttons answer with `POST /api/approvals/<id>`
{"session", "decision": "allow"|"deny"}."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import itertools
import json
import logging
import math
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib import resources
from typing import Any
from urllib.parse import urlencode

from aiohttp import hdrs, web

from channels.base import ApprovalCard, Decide, InboundHandler, ReplyRefSink, ReplyStream, StreamObserver
from channels.web.events import RETRY_MS, STREAM_MAX_S, Listener, SessionEvents, StreamLimit
from gateway.http.same_site import cross_site_problem
from gateway.http.server import JsonBodyError, parse_json_body
from gateway.http.throttle import AuthThrottle
from gateway.http.web_token import cookie_name, cookie_value
from gateway.types import Inbound

log = logging.getLogger("channels.web")

SESSION_NAME = re.compile(r"[A-Za-z0-9_.@-]{1,64}")  # fullmatch: `$` would let "alice\n" through
# Every /api answer: what it carries is conversation text (or says why not), never for a cache.
API_HEADERS = {"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"}
HEARTBEAT_S = 15.0  # an SSE comment this often keeps proxies from closing a quiet stream
STUCK_WRITE_S = 5.0  # past the reply's deadline, how long a write may wait for a client that does not read
HISTORY_DEFAULT, HISTORY_MAX = 50, 200
VENDOR_FILE = re.compile(r"[a-z0-9][a-z0-9.-]{0,63}\.(js|css|txt)")
STATIC_TYPES = {"js": "text/javascript", "css": "text/css", "txt": "text/plain", "svg": "image/svg+xml"}
STATIC_FILES = {"app.js", "app.css", "favicon.svg"}
# The signed-in page's cookie lasts this long; the link signs in again.
COOKIE_MAX_AGE_S = 400 * 24 * 3600  # the most browsers keep one
HOW_TO_GET_IN = ("open the link the gateway printed when it started (http://127.0.0.1:8080/?token=…; "
                 "`python -m gateway web-link` prints it again), or send Authorization: Bearer <token> "
                 "(channels.web.token, else the token in the data dir's web-token file)")
NO_TOKEN = "this gateway needs its token: " + HOW_TO_GET_IN
WRONG_TOKEN = "the token is not this gateway's: " + HOW_TO_GET_IN
WRONG_LINK = ("This link's token is not this gateway's (an older link, or another gateway's). "
              "`python -m gateway web-link` prints the right one.\n")
SIGN_IN_HEADERS = {"Cache-Control": "no-store", "Referrer-Policy": "no-referrer", "X-Content-Type-Options": "nosniff"}
# Replies are Markdown rendered in the page: whatever a sanitizer misses, no script runs
# that the page did not load from here, and nothing is fetched from elsewhere.
PAGE_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
            "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
PAGE_HEADERS = {"Content-Security-Policy": PAGE_CSP, "Referrer-Policy": "no-referrer", "X-Frame-Options": "DENY"}


@dataclass(frozen=True, slots=True)
class HistoryItem:
    role: str  # "user" | "assistant" | "divider"
    text: str
    at: float  # unix time it was stored
    kind: str = "message"  # "message"; "command": a command or its answer; "divider": a fresh context
    turn: int = 0  # the turn it belongs to (a command: the last turn before it)
    fresh_context: bool = False  # a command's answer that started a fresh context


NEW_CONVERSATION = "new conversation"


def with_dividers(items: list[HistoryItem], context_start: int, *, newest: bool) -> list[HistoryItem]:
    """`items` with a divider after each command that started a fresh context, and one
    where the session's live context starts (`context_start`, its first turn) when no
    such command stands there (one from before commands were kept)."""
    out: list[HistoryItem] = []
    start_shown = context_start <= 1
    for item in items:
        if not start_shown and item.turn >= context_start and out and out[-1].turn < context_start:
            out.append(HistoryItem("divider", NEW_CONVERSATION, item.at, kind="divider", turn=context_start))
            start_shown = True
        out.append(item)
        if item.fresh_context:
            out.append(HistoryItem("divider", NEW_CONVERSATION, item.at, kind="divider", turn=item.turn + 1))
            start_shown = start_shown or item.turn + 1 == context_start
    if newest and not start_shown and out and out[-1].turn < context_start:
        out.append(HistoryItem("divider", NEW_CONVERSATION, out[-1].at, kind="divider", turn=context_start))
    return out


# (session name, limit, before: a (turn, seq) cursor or None) → the page's messages, oldest
# first, and the cursor of the page before it (None: this one is the first).
HistoryLookup = Callable[[str, int, tuple[int, int] | None],
                         Awaitable[tuple[list[HistoryItem], tuple[int, int] | None]]]
HISTORY_CURSOR = re.compile(r"(\d{1,18})\.(\d{1,18})")  # turn.seq (a command's seq is large)


class SseOutbox:
    """What a streamed reply has to tell its request, until the request writes it out.

    Producers never wait: a slow or vanished client cannot hold up the turn. However slow
    the client, it holds no more than the reply: deltas merge, and a status drops what it
    replaces before that was written."""

    def __init__(self) -> None:
        self.items: list[tuple[str, list[str] | dict[str, Any]]] = []  # (event, pieces of its text, or its data)
        self.wake = asyncio.Event()
        self.closed = False  # the request has gone; everything is dropped from now on
        self.failed = False  # the turn ended with an error message (`fail`)

    def put(self, event: str, text: str) -> None:
        if self.closed:
            return
        if event == "status":  # what it replaces goes; a card waiting for an answer stays
            self.items = [item for item in self.items if isinstance(item[1], dict)]
        last = self.items[-1] if self.items else None
        if event == "delta" and last is not None and last[0] == "delta" and isinstance(last[1], list):
            last[1].append(text)  # joined once when written, however many pile up
        else:
            self.items.append((event, [text]))
        self.wake.set()

    def put_data(self, event: str, data: dict[str, Any]) -> None:
        """An event with data of its own (an approval card); never merged or dropped."""
        if self.closed:
            return
        self.items.append((event, data))
        self.wake.set()

    def take(self) -> list[tuple[str, dict[str, Any]]]:
        items, self.items = self.items, []
        self.wake.clear()
        return [(event, body if isinstance(body, dict) else {"text": "".join(body)}) for event, body in items]


class WebReplyStream:
    """A ReplyStream onto one waiting `POST /api/chat` (SPEC §5.1). The request's handler
    writes the events; the stream only queues them, so it never blocks or raises. A
    reply whose request has gone stays stored and shows up in the page's history."""

    def __init__(self, outbox: SseOutbox, reply: asyncio.Future[str],
                 orphaned: Callable[[str, bool], None] | None = None,
                 answered: Callable[[], None] | None = None) -> None:
        self._outbox = outbox
        self._reply = reply
        self._orphaned = orphaned  # where the reply goes when its request has gone
        self._answered = answered  # told once the reply went to its request
        self._ended = False

    async def append(self, delta: str) -> None:
        if delta and not self._ended:
            self._outbox.put("delta", delta)

    async def status(self, line: str) -> None:
        if not self._ended:
            self._outbox.put("status", line)

    async def finish(self, text: str) -> None:
        self._end(text, failed=False)

    async def fail(self, text: str) -> None:
        self._end(text, failed=True)

    def _end(self, text: str, *, failed: bool) -> None:
        if self._ended:
            return
        self._ended = True
        self._outbox.failed = failed
        if self._outbox.closed and self._orphaned is not None:
            self._orphaned(text, failed)  # the page stopped waiting: its open pages get it
        if not self._reply.done():
            self._reply.set_result(text)
            if not self._outbox.closed and self._answered is not None:
                self._answered()


class WebChannel:
    name = "web"

    def __init__(self, handler: InboundHandler, *, token: str, max_chars: int,
                 reply_timeout_s: float, http_host: str = "127.0.0.1",
                 history: HistoryLookup | None = None,
                 observe: StreamObserver | None = None, heartbeat_s: float = HEARTBEAT_S,
                 decide: Decide | None = None, throttle: AuthThrottle | None = None) -> None:
        self.handler = handler
        self.decide = decide
        if not token:
            raise ValueError("the web API needs a token (channels.web.token, else the data dir's web-token)")
        self.token = token  # channels.web.token, else the data dir's (gateway/http/web_token.py); may rotate
        self.throttle = throttle if throttle is not None else AuthThrottle("web")  # failed token checks, per address
        self.http_host = http_host  # on loopback, a cookie's request must name this server in Host
        self.max_chars = max_chars
        self.reply_timeout_s = reply_timeout_s
        self.history = history
        self.observe = observe
        self.heartbeat_s = heartbeat_s
        self.stuck_write_s = STUCK_WRITE_S
        self._waiters: dict[str, asyncio.Future[str]] = {}
        self._outboxes: dict[str, SseOutbox] = {}  # event id → its request's stream, when it asked for one
        self._static: dict[str, tuple[bytes, str]] = {}  # file → (bytes, etag); the package never changes
        self._running = False
        # Event ids for requests without one: unique across restarts (dedup keys persist).
        self._id_prefix = uuid.uuid4().hex[:16]
        self._ids = itertools.count(1)
        self.events = SessionEvents()  # what reaches a session while none of its requests waits
        self._closing = asyncio.Event()  # set by stop(): every event stream ends

    def routes(self) -> list[web.RouteDef]:
        return [web.get("/", self.page), web.post("/api/chat", self.api_chat),
                web.post("/api/approvals/{id}", self.api_approval),
                web.get("/api/history", self.api_history),
                web.get("/api/events", self.api_events),
                web.get("/static/{name}", self.static_file),
                web.get("/static/vendor/{name}", self.vendor_file)]

    async def start(self) -> None:
        self._running = True
        self._closing.clear()

    async def stop(self) -> None:
        self._running = False
        self._closing.set()
        for fut in self._waiters.values():
            if not fut.done():
                fut.set_exception(ConnectionAbortedError("the gateway is shutting down"))
        self._waiters.clear()

    def is_ready(self) -> bool:
        return self._running

    @asynccontextmanager
    async def typing(self, inbound: Inbound) -> AsyncIterator[None]:
        yield  # the page shows its own "working… N s" while the request is open

    async def send(self, inbound: Inbound, text: str) -> None:
        fut = self._waiters.get(inbound.event_id)
        if fut is None or fut.done():
            # No request waits (a task's reply, one answered after a restart or after the page gave up):
            # the session's open pages get it now; it is stored and in the history anyway.
            pages = self.push_reply(inbound.chat_id, text, failed=False, event_id=inbound.event_id)
            log.info("web reply with no waiting request", extra={"event": inbound.event_id, "pages": pages})
            return
        fut.set_result(text)
        self._answered(inbound.chat_id, inbound.event_id)

    def push_reply(self, session: str, text: str, *, failed: bool, event_id: str | None = None) -> int:
        """A reply for the session's open pages (`GET /api/events`); how many are open.
        `event_id`: the message it answers, when one did."""
        if not SESSION_NAME.fullmatch(session):
            return 0
        data: dict[str, Any] = {"text": text, "at": time.time(), "failed": failed}
        if event_id is not None:
            data["id"] = event_id
        return self.events.publish(session, "reply", data)

    def _answered(self, session: str, event_id: str) -> None:
        """The reply to `event_id` went to the request that asked: the session's open pages
        hear it, so one that stopped reading that request just then (the reply and its
        leaving crossed) knows the history has it."""
        if SESSION_NAME.fullmatch(session):
            self.events.notify(session, "answered", {"id": event_id})

    def stream(self, inbound: Inbound, *, on_ref: ReplyRefSink | None = None,
               resume_ref: str | None = None) -> ReplyStream | None:
        """A live reply for a request that asked for Server-Sent Events, else None (the
        reply then comes whole through `send`). Nothing is shown outside the request, so
        there is no reference to persist and none to resume."""
        outbox = self._outboxes.get(inbound.event_id)
        fut = self._waiters.get(inbound.event_id)
        if outbox is None or outbox.closed or fut is None or fut.done():
            return None
        if self.observe is not None:
            self.observe("reply")
        session, event_id = inbound.chat_id, inbound.event_id
        return WebReplyStream(outbox, fut, lambda text, failed: self._orphaned_reply(session, text, failed, event_id),
                              lambda: self._answered(session, event_id))

    def _orphaned_reply(self, session: str, text: str, failed: bool, event_id: str) -> None:
        pages = self.push_reply(session, text, failed=failed, event_id=event_id)
        log.info("web reply after its request stopped waiting", extra={"pages": pages})

    async def ask_approval(self, inbound: Inbound, card: ApprovalCard) -> str | None:
        """The card in the waiting request's stream; None when that request is not
        streaming (or gone): /allow ID still answers it, and the timeout ends it."""
        outbox = self._outboxes.get(inbound.event_id)
        if outbox is None or outbox.closed:
            return None
        outbox.put_data("approval", {"id": card.id, "tool": card.tool, "arguments": card.arguments,
                                     "who": card.who, "timeout_s": card.timeout_s,
                                     "files": [{"heading": f.heading(), "text": f.text} for f in card.files]})
        return card.id

    async def settle_approval(self, inbound: Inbound, card: ApprovalCard, ref: str | None, outcome: str) -> None:
        outbox = self._outboxes.get(inbound.event_id)
        if outbox is not None:
            outbox.put_data("approval_done", {"id": card.id, "outcome": outcome})

    async def api_approval(self, request: web.Request) -> web.Response:
        """The page's Allow or Deny: the session answering, as its person."""
        turned_away = await self._checked(request)
        if turned_away is not None:
            return turned_away
        if self.decide is None or not self._running:
            return _error(503, "approvals are not available right now")
        try:
            body = await parse_json_body(await request.read())
        except JsonBodyError as err:
            return _error(400, f"{err}; send {{\"session\": \"alice\", \"decision\": \"allow\"}}")
        session = body.get("session") if isinstance(body, dict) else None
        decision = body.get("decision") if isinstance(body, dict) else None
        if not isinstance(session, str) or not SESSION_NAME.fullmatch(session):
            return _error(400, "session must be 1-64 characters of letters, digits, _ . @ -")
        if decision not in ("allow", "deny"):
            return _error(400, "decision must be \"allow\" or \"deny\"")
        approval_id = request.match_info["id"][:32]
        who = Inbound(channel="web", chat_id=session, user_id=session, text="", event_id="approval",
                      user_name=session)
        notice = await self.decide(approval_id, who, decision == "allow")
        return web.json_response({"notice": notice}, headers=API_HEADERS)

    async def _package_file(self, path: str) -> tuple[bytes, str]:
        cached = self._static.get(path)
        if cached is None:
            file = resources.files("channels.web").joinpath(path)
            data = await asyncio.to_thread(file.read_bytes)
            cached = self._static[path] = (data, '"' + hashlib.sha256(data).hexdigest()[:20] + '"')
        return cached

    async def _serve_file(self, request: web.Request, path: str, content_type: str,
                          headers: dict[str, str] | None = None) -> web.Response:
        try:
            data, etag = await self._package_file(path)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise web.HTTPNotFound() from None
        # Revalidated on every load, so an upgrade shows at once; unchanged files cost a 304.
        base = {"ETag": etag, "Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff", **(headers or {})}
        if request.headers.get("If-None-Match") == etag:
            return web.Response(status=304, headers=base)
        return web.Response(body=data, headers={**base, "Content-Type": content_type})

    async def page(self, request: web.Request) -> web.Response:
        """The page's shell (it holds nothing of anyone's: without the token, its requests
        are refused and it says how to get in). With `?token=`, the link the gateway
        printed: a right token signs the browser in with a cookie and sends it on to the
        same address without the token, so the token is left in no history or screenshot."""
        if "token" in request.query:
            return await self._sign_in(request, request.query["token"])
        return await self._serve_file(request, "static/index.html", "text/html; charset=utf-8", PAGE_HEADERS)

    async def _sign_in(self, request: web.Request, given: str) -> web.Response:
        wait = self.throttle.refusal(request.remote)
        if wait is not None:
            return web.Response(status=429, text="Too many wrong tokens from your address; try again later.\n",
                                headers={**SIGN_IN_HEADERS, "Retry-After": str(math.ceil(wait))})
        token = self.token
        if not hmac.compare_digest(given.encode(), token.encode()):
            await self.throttle.failed(request.remote)
            return web.Response(status=401, text=WRONG_LINK, headers=SIGN_IN_HEADERS)
        rest = [(key, value) for key, value in request.query.items() if key != "token"]
        # Relative, so a path prefix a reverse proxy adds is kept.
        resp = web.Response(status=303, headers={**SIGN_IN_HEADERS, "Location": "./" + (
            "?" + urlencode(rest) if rest else "")})
        resp.set_cookie(cookie_name(token), cookie_value(token), path="/", httponly=True, samesite="Strict",
                        secure=request.secure, max_age=COOKIE_MAX_AGE_S)
        log.info("web page signed in", extra={"client": request.remote})
        return resp

    async def static_file(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in STATIC_FILES:
            raise web.HTTPNotFound()
        kind = STATIC_TYPES[name.rsplit(".", 1)[1]]
        return await self._serve_file(request, f"static/{name}", f"{kind}; charset=utf-8")

    async def vendor_file(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if not VENDOR_FILE.fullmatch(name):
            raise web.HTTPNotFound()
        kind = STATIC_TYPES[name.rsplit(".", 1)[1]]
        return await self._serve_file(request, f"static/vendor/{name}", f"{kind}; charset=utf-8")

    async def api_history(self, request: web.Request) -> web.Response:
        turned_away = await self._checked(request)  # a rebinding page must not read the history either
        if turned_away is not None:
            return turned_away
        if not self._running or self.history is None:
            return _error(503, "the history is not available right now")
        session = request.query.get("session", "default")
        if not SESSION_NAME.fullmatch(session):  # `$` alone would let "alice\n" through
            return _error(400, "session must be 1-64 characters of letters, digits, _ . @ -")
        try:
            limit = int(request.query.get("limit", HISTORY_DEFAULT))
        except ValueError:
            limit = 0
        if not 1 <= limit <= HISTORY_MAX:
            return _error(400, f"limit must be a whole number from 1 to {HISTORY_MAX}")
        before: tuple[int, int] | None = None
        if "before" in request.query:
            cursor = HISTORY_CURSOR.fullmatch(request.query["before"])
            if cursor is None:
                return _error(400, "before must be the cursor a history answer gave (such as 12.3)")
            before = (int(cursor[1]), int(cursor[2]))
        try:
            async with asyncio.timeout(10):
                items, older = await self.history(session, limit, before)
        except Exception as err:
            log.error("history could not be read", extra={"session": session, "error": str(err)[:300]})
            return _error(503, "the history could not be read right now; please try again later")
        return web.json_response({"session": session, "messages": [
            {"role": item.role, "text": item.text, "at": item.at, "kind": item.kind} for item in items],
            "before": f"{older[0]}.{older[1]}" if older is not None else None}, headers=API_HEADERS)

    async def api_events(self, request: web.Request) -> web.StreamResponse:
        """The session's pushed events, for as long as the page stays (at most
        STREAM_MAX_S; it reconnects with `Last-Event-ID`). Ends when the channel stops or
        the token changes (a rotated token locks this stream out too)."""
        turned_away = await self._checked(request)
        if turned_away is not None:
            return turned_away
        if not self._running:
            return _error(503, "the gateway is not accepting pages right now")
        session = request.query.get("session", "default")
        if not SESSION_NAME.fullmatch(session):
            return _error(400, "session must be 1-64 characters of letters, digits, _ . @ -")
        token = self.token
        try:
            with self.events.listen(session, request.remote) as listener:
                return await self._follow(request, session, listener, token)
        except StreamLimit:
            return _error(429, "too many open pages from your address; close some", retry_after=RETRY_MS / 1000)

    async def _follow(self, request: web.Request, session: str, listener: Listener,
                      token: str) -> web.StreamResponse:
        resp = web.StreamResponse(headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-store, no-transform",
            "X-Accel-Buffering": "no",
        })
        missed = self.events.missed(session, request.headers.get("Last-Event-ID"))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + STREAM_MAX_S
        closing = asyncio.ensure_future(self._closing.wait())
        try:
            async with asyncio.timeout(STREAM_MAX_S + self.stuck_write_s):  # a client that stops reading
                await resp.prepare(request)
                await resp.write(f"retry: {RETRY_MS}\n\n".encode())
                if missed is None:  # the page reloads its history; from here on it is current
                    await resp.write(_sse("resync", {}, self.events.event_id(self.events.last_number)))
                for event in missed or ():
                    await resp.write(_sse(event.name, event.data, self.events.event_id(event.number)))
                while not listener.overflowed and self.token == token and not self._closing.is_set():
                    left = deadline - loop.time()
                    if left <= 0:
                        break
                    getting = asyncio.ensure_future(listener.queue.get())
                    done, _ = await asyncio.wait({getting, closing}, timeout=min(self.heartbeat_s, left),
                                                 return_when=asyncio.FIRST_COMPLETED)
                    if getting not in done:
                        getting.cancel()
                        await asyncio.gather(getting, return_exceptions=True)
                        if not done:
                            await resp.write(b": keep-alive\n\n")
                        continue
                    event = getting.result()
                    await resp.write(_sse(event.name, event.data,
                                          self.events.event_id(event.number) if event.number else None))
                await resp.write_eof()
        except ConnectionError:
            pass  # the page went away
        except TimeoutError:
            if request.transport is not None:
                request.transport.abort()
        finally:
            closing.cancel()
            await asyncio.gather(closing, return_exceptions=True)
        return resp

    async def _checked(self, request: web.Request, *, log_refusal: bool = False) -> web.Response | None:
        """The answer to a request from another site or without the right token; None: it may go on.

        Every request needs the token, on loopback too: a sandboxed command with the network
        on reaches 127.0.0.1 like the person's browser. A bearer token is sent by programs
        (a browser never adds one cross-site); the signed-in page's cookie goes with whatever
        the browser sends here, so a request without a bearer token must also come from
        this server's own page, and a POST must be JSON (a cross-site form cannot send it
        without a preflight, which is never granted)."""
        bearer = _bearer(request)
        if bearer is None:
            refused = cross_site_problem(request, self.http_host)
            if refused is not None:
                if log_refusal:
                    log.info("refused a cross-site request",
                             extra={"host": request.headers.get(hdrs.HOST, "")[:100],
                                    "origin": request.headers.get(hdrs.ORIGIN, "")[:100]})
                return _error(403, refused)
        turned_away = await self._unauthorized(request, bearer)
        if turned_away is not None:
            return turned_away
        if request.method == "POST" and request.content_type != "application/json":
            return _error(415, "send the body as JSON with Content-Type: application/json")
        return None

    async def _unauthorized(self, request: web.Request, bearer: str | None) -> web.Response | None:
        """The answer to a request without the right token (None: it may go on). Failed
        checks are counted per address and answered ever more slowly (gateway/http/throttle.py);
        a request with no token at all is answered at once (it guesses nothing)."""
        wait = self.throttle.refusal(request.remote)
        if wait is not None:
            return _error(429, "too many wrong tokens from your address; try again later", retry_after=wait)
        token = self.token
        cookie = request.cookies.get(cookie_name(token))
        if bearer is not None:
            if hmac.compare_digest(bearer.encode(), token.encode()):
                return None
        elif cookie is not None:
            if hmac.compare_digest(cookie.encode(), cookie_value(token).encode()):
                return None
        else:
            return _error(401, NO_TOKEN)
        await self.throttle.failed(request.remote)
        return _error(401, WRONG_TOKEN)

    async def api_chat(self, request: web.Request) -> web.Response:
        turned_away = await self._checked(request, log_refusal=True)
        if turned_away is not None:
            return turned_away
        if not self._running:
            return _error(503, "the gateway is not accepting messages right now")
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
        outbox = SseOutbox() if _wants_stream(request, body) else None
        if outbox is not None:
            self._outboxes[event_id] = outbox
        try:
            if await self.handler(inbound) is False:
                return _error(409, f"a message with id {event_id!r} was already received")
            if outbox is not None:
                return await self._answer_stream(request, fut, outbox, session, event_id)
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
            self._outboxes.pop(event_id, None)
        return web.json_response({"reply": reply, "session": session, "id": event_id}, headers=API_HEADERS)

    async def _answer_stream(self, request: web.Request, fut: asyncio.Future[str],
                             outbox: SseOutbox, session: str, event_id: str) -> web.StreamResponse:
        """Write the reply's events until it is done, the wait times out or the client
        leaves. Never raises: the response has started, and the turn goes on regardless."""
        resp = web.StreamResponse(headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-store, no-transform",  # the conversation: never kept by a cache
            "X-Accel-Buffering": "no",  # nginx: pass events through as they come
        })
        fut.add_done_callback(lambda _f: outbox.wake.set())
        try:
            # The relay keeps its own deadline; this one also bounds writes to a client
            # that stopped reading (they would wait for it forever).
            async with asyncio.timeout(self.reply_timeout_s + self.stuck_write_s):
                await resp.prepare(request)
                await resp.write(b": accepted\n\n")
                last = await self._relay(resp, fut, outbox)
                if request.transport is None or request.transport.is_closing():
                    # Written now, it would go into a socket the page has already left.
                    raise ConnectionResetError("the client left")
                await resp.write(last)
                await resp.write_eof()
        except ConnectionError as err:
            # The client left: the turn is unaffected; its reply is stored and shows in
            # the history. One that ended before this was noticed went to this request,
            # not to the session's open pages: it goes there now (a later one goes there
            # by itself, the outbox being closed).
            log.info("web stream closed by the client", extra={"error": type(err).__name__})
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self._orphaned_reply(session, fut.result(), outbox.failed, event_id)
        except TimeoutError:
            log.info("web stream dropped: the client stopped reading")
            if request.transport is not None:
                request.transport.abort()
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self._orphaned_reply(session, fut.result(), outbox.failed, event_id)
        finally:
            outbox.closed = True
        return resp

    async def _relay(self, resp: web.StreamResponse, fut: asyncio.Future[str], outbox: SseOutbox) -> bytes:
        """Write events as they come, with heartbeats while quiet; the last event, once
        the reply is there or the wait timed out."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.reply_timeout_s
        while True:
            for event, data in outbox.take():
                await resp.write(_sse(event, data))
            if fut.done():
                break
            left = deadline - loop.time()
            if left <= 0:
                return _sse("error", {"error": "no reply in time; the message is saved and will be answered "
                                               "(it will show in the history)"})
            try:
                async with asyncio.timeout(min(self.heartbeat_s, left)):
                    await outbox.wake.wait()
            except TimeoutError:
                await resp.write(b": keep-alive\n\n")
        for event, data in outbox.take():  # what came with the reply (a card settled last)
            await resp.write(_sse(event, data))
        try:
            reply = fut.result()
        except Exception as err:  # ConnectionAbortedError: the gateway is shutting down
            return _sse("error", {"error": str(err)})
        return _sse("error", {"error": reply}) if outbox.failed else _sse("done", {"reply": reply})


def _bearer(request: web.Request) -> str | None:
    """The bearer token the request carries ("" for a malformed Authorization header:
    a wrong token), or None when it sends none."""
    header = request.headers.get(hdrs.AUTHORIZATION)
    if header is None:
        return None
    return header.removeprefix("Bearer ").strip() if header.startswith("Bearer ") else ""


def _wants_stream(request: web.Request, body: dict[str, Any]) -> bool:
    return body.get("stream") is True or "text/event-stream" in request.headers.get("Accept", "")


def _sse(event: str, data: dict[str, Any], event_id: str | None = None) -> bytes:
    # json.dumps escapes newlines, so the data is always one `data:` line.
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


def _error(status: int, message: str, *, retry_after: float | None = None) -> web.Response:
    headers = API_HEADERS if retry_after is None else {**API_HEADERS, "Retry-After": str(math.ceil(retry_after))}
    return web.json_response({"error": message}, status=status, headers=headers)
