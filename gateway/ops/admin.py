"""The admin page (`/admin`) and its JSON API (`/admin/api/*`): sessions (and one session's
recent messages and context numbers), pairings (approve, revoke), usage, scheduled jobs,
channel, model and tool-source state, recent errors.

The page is served only while `http.admin_token` is set (else 404 with what to set), and
every API request needs it as `Authorization: Bearer <token>`, on loopback too (a sandboxed
command with the network on is on this machine as well); the web chat's token or cookie
never stands in for it. The token is read from the
running config per request, so setting, rotating or removing it applies at once. Like the
chat API, requests from other sites are refused (403): a foreign `Origin` or
`Sec-Fetch-Site`, and, while the server listens on loopback only, a `Host` that is not
this server (DNS rebinding). A POST must be JSON. The views show keys, identities, counts
and log lines; what people wrote only in the view of one session an admin opens."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime, timedelta
from importlib import resources
from typing import Any, TypedDict

from aiohttp import hdrs, web

from gateway.access import Pairing
from gateway.agents import agent_of_scope, agent_view, model_chain
from gateway.config.cron import zone
from gateway.config.schema import Config, secret_text
from gateway.http.same_site import cross_site_problem
from gateway.http.server import JsonBodyError, parse_json_body
from gateway.http.throttle import AuthThrottle
from gateway.ops.logs import REDACTOR, Redactor
from gateway.store.api import StoreBackend

log = logging.getLogger("gateway.admin")

ERRORS_KEPT = 50
USAGE_DAYS = 14
USAGE_PEOPLE_MAX = 200
SESSIONS_DEFAULT, SESSIONS_MAX = 50, 200
AGENT_SESSIONS = 500  # the agents view tallies this many of the most recent sessions
RECENT_RUNS = 20
READY_TIMEOUT_S = 10.0
APPROVED_BY = "admin-page"
STATIC_FILES = {"admin.js": "text/javascript", "admin.css": "text/css", "favicon.svg": "image/svg+xml"}
# Everything the page shows is set as text by its own script; nothing else may run or load.
ADMIN_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
             "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
OFF_HINT = ("The admin page is off. To turn it on, set http.admin_token in config.json to a secret of at least "
            "16 random characters, e.g. \"${GATEWAY_ADMIN_TOKEN}\" with GATEWAY_ADMIN_TOKEN=$(openssl rand -hex 32) "
            "in the environment.")
NO_STORE = {"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"}
# Log-record extras worth showing: keys, names and error descriptions (`detail`: the
# provider's error message), never chat text.
SHOWN_EXTRAS = ("session", "channel", "scope", "event", "error", "kind", "detail", "keys", "strategy", "tool",
                "path", "client", "job", "status", "limit", "port", "host")

ReadyCheck = Callable[[], Awaitable[dict[str, str | None]]]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


SESSION_MESSAGES = 30  # the recent messages one session's view shows
SESSION_MESSAGE_CHARS = 4000  # of each, the start
# Tool sources as an operator knows them; an MCP server is "MCP server <name>".
PLAIN_SOURCE_NAMES = {"web": "Web tools", "exec": "Running commands (exec)"}


class ToolSourceState(TypedDict):
    """One tool source (an MCP server, a config-driven tool) as the admin page shows it."""
    name: str
    label: str  # the name in plain words: "MCP server github", "Web tools"
    state: str  # e.g. "connected", "connecting", "failed"; "ready" when the source does not say
    tools: list[str]
    detail: str | None


def describe_tool_sources(sources: Sequence[Any]) -> list[ToolSourceState]:
    """The state of each `ToolSource`. A source may add `state` (str) and `detail`
    (str | None) attributes; the protocol itself only promises a name and its tools."""
    out: list[ToolSourceState] = []
    for source in sources:
        try:
            tools = [str(t.name) for t in source.tools()]
        except Exception as err:  # a broken source is shown as such, never breaks the page
            out.append({"name": str(source.name), "label": _plain(str(source.name)), "state": "failed", "tools": [],
                        "detail": f"{type(err).__name__}: {err}"[:300]})
            continue
        statuses = getattr(source, "statuses", None)
        if callable(statuses):  # a source of several servers (MCP): one row per server
            for server in statuses():
                prefix = f"{server.name}__"
                out.append({"name": f"{source.name}:{server.name}", "label": f"MCP server {server.name}",
                            "state": str(server.state),
                            "tools": [t for t in tools if t.startswith(prefix)],
                            "detail": server.describe() if server.state != "ready" else None})
            continue
        detail = getattr(source, "detail", None)
        out.append({"name": str(source.name), "label": _plain(str(source.name)),
                    "state": str(getattr(source, "state", "ready")), "tools": tools,
                    "detail": str(detail)[:300] if detail is not None else None})
    return out


def _plain(name: str) -> str:
    return PLAIN_SOURCE_NAMES.get(name, name)


# ------------------------------------------------------------------------- recent errors


class RecentErrors(logging.Handler):
    """The last WARNING-or-worse log records, redacted like the log lines: time, level,
    logger, message and a few named extras (session key, channel, error), never more.
    Records may come from worker threads; `snapshot` copies under the handler's lock."""

    def __init__(self, capacity: int = ERRORS_KEPT, redactor: Redactor = REDACTOR) -> None:
        super().__init__(logging.WARNING)
        self.redactor = redactor
        self.records: deque[dict[str, Any]] = deque(maxlen=capacity)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            try:
                message = record.getMessage()
            except Exception:  # arguments that do not fit the format: the format alone
                message = str(record.msg)
            extra = {key: self._text(record.__dict__[key]) for key in SHOWN_EXTRAS if key in record.__dict__}
            if record.exc_info and record.exc_info[1] is not None:
                exc = record.exc_info[1]
                extra["exc"] = self._text(f"{type(exc).__name__}: {exc}")
            self.records.append({"at": record.created, "level": record.levelname, "logger": record.name,
                                 "message": self._text(message, 1000), "extra": extra})
        except Exception:
            self.handleError(record)

    def _text(self, value: Any, limit: int = 300) -> str:
        return self.redactor.redact(str(value)[:limit])

    def snapshot(self) -> list[dict[str, Any]]:
        """Newest first."""
        with self.lock:  # type: ignore[union-attr]
            return list(reversed(self.records))

    def install(self) -> None:
        logging.getLogger().addHandler(self)

    def uninstall(self) -> None:
        logging.getLogger().removeHandler(self)


# ------------------------------------------------------------------------- the API


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=NO_STORE)


def _ok(body: dict[str, Any]) -> web.Response:
    return web.json_response(body, headers=NO_STORE)


class AdminApi:
    def __init__(self, *, config: Callable[[], Config], store: StoreBackend, pairing: Pairing, ready: ReadyCheck,
                 next_runs: Callable[[], dict[str, datetime | None]],
                 tool_sources: Callable[[], list[ToolSourceState]], errors: RecentErrors, http_host: str,
                 receiving: Callable[[], dict[str, str]] | None = None,
                 cluster: Callable[[], Awaitable[dict[str, Any] | None]] | None = None,
                 throttle: AuthThrottle | None = None, models: Callable[[], dict[str, Any]] | None = None,
                 session_context: Callable[[str], Awaitable[dict[str, Any] | None]] | None = None) -> None:
        self.config = config
        self.store = store
        self.pairing = pairing
        self.ready = ready
        self.next_runs = next_runs
        self.tool_sources = tool_sources
        self.errors = errors
        self.http_host = http_host
        # Channels received on one gateway of a cluster at a time: "leads" or "standby: …".
        self.receiving = receiving or dict
        self.cluster = cluster  # the gateways sharing the database, when it is shared
        self.throttle = throttle if throttle is not None else AuthThrottle("admin")  # failed token checks, per address
        self._files: dict[str, tuple[bytes, str]] = {}  # static file → (bytes, etag)
        self.models = models  # each model's calls, last error and the fallbacks used
        self.session_context = session_context  # a live session's /context numbers

    def routes(self) -> list[web.RouteDef]:
        api = {"sessions": self.sessions, "pairings": self.pairings, "usage": self.usage, "jobs": self.jobs,
               "status": self.status, "errors": self.recent_errors, "agents": self.agents, "session": self.session}
        return [web.get("/admin", self.page), web.get("/admin/", self.slash),
                web.get("/admin/static/{name}", self.static_file),
                *(web.get(f"/admin/api/{name}", self._guarded(view)) for name, view in api.items()),
                web.post("/admin/api/pairings/approve", self._guarded(self.approve)),
                web.post("/admin/api/pairings/revoke", self._guarded(self.revoke))]

    def token(self) -> str | None:
        return secret_text(self.config().http.admin_token)

    # -- guard -------------------------------------------------------------------------

    def _guarded(self, view: Handler) -> Handler:
        async def guarded(request: web.Request) -> web.StreamResponse:
            token = self.token()
            if token is None:
                return _error(404, OFF_HINT)
            refused = cross_site_problem(request, self.http_host)
            if refused is not None:
                log.info("admin: refused a cross-site request",
                         extra={"host": request.headers.get(hdrs.HOST, "")[:100],
                                "origin": request.headers.get(hdrs.ORIGIN, "")[:100]})
                return _error(403, refused)
            wait = self.throttle.refusal(request.remote)  # an address guessing tokens waits its turn
            if wait is not None:
                resp = _error(429, "too many wrong tokens from your address; try again later")
                resp.headers["Retry-After"] = str(math.ceil(wait))
                return resp
            header = request.headers.get(hdrs.AUTHORIZATION, "")
            given = header[len("Bearer "):].strip() if header.startswith("Bearer ") else ""
            if not hmac.compare_digest(given.encode(), token.encode()):
                await self.throttle.failed(request.remote)
                return _error(401, "a valid admin token is required (Authorization: Bearer <http.admin_token>)")
            if request.method == "POST" and request.content_type != "application/json":
                return _error(415, "send the body as JSON with Content-Type: application/json")
            try:
                return await view(request)
            except web.HTTPException:
                raise
            except Exception as err:  # storage trouble, mostly: say so, never a trace
                log.error("admin: a view failed",
                          extra={"path": request.path, "error": f"{type(err).__name__}: {err}"[:300]})
                return _error(503, f"this view could not be read right now ({type(err).__name__}); try again")
        return guarded

    # -- the page ----------------------------------------------------------------------

    async def _file(self, name: str) -> tuple[bytes, str]:
        cached = self._files.get(name)
        if cached is None:
            data = await asyncio.to_thread(resources.files("gateway.ops").joinpath("static", name).read_bytes)
            cached = self._files[name] = (data, '"' + hashlib.sha256(data).hexdigest()[:20] + '"')
        return cached

    async def _serve(self, request: web.Request, name: str, content_type: str,
                     headers: dict[str, str] | None = None) -> web.Response:
        data, etag = await self._file(name)
        base = {"ETag": etag, "Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff", **(headers or {})}
        if request.headers.get(hdrs.IF_NONE_MATCH) == etag:
            return web.Response(status=304, headers=base)
        return web.Response(body=data, headers={**base, "Content-Type": content_type})

    async def page(self, request: web.Request) -> web.Response:
        if self.token() is None:
            return web.Response(status=404, text=OFF_HINT + "\n", headers=NO_STORE)
        return await self._serve(request, "admin.html", "text/html; charset=utf-8", {
            "Content-Security-Policy": ADMIN_CSP, "Referrer-Policy": "no-referrer", "X-Frame-Options": "DENY"})

    async def slash(self, _request: web.Request) -> web.Response:
        # The page's links are relative to `/admin`; relative here too, so a path prefix
        # added by a reverse proxy is kept.
        raise web.HTTPFound("../admin")

    async def static_file(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if self.token() is None or name not in STATIC_FILES:
            raise web.HTTPNotFound()
        return await self._serve(request, name, f"{STATIC_FILES[name]}; charset=utf-8")

    # -- views -------------------------------------------------------------------------

    def _today(self) -> datetime:
        tz = zone(self.config().timezone)
        return datetime.now(tz).replace(hour=0, minute=0, second=0, microsecond=0)

    async def sessions(self, request: web.Request) -> web.Response:
        try:
            limit = int(request.query.get("limit", SESSIONS_DEFAULT))
        except ValueError:
            limit = 0
        if not 1 <= limit <= SESSIONS_MAX:
            return _error(400, f"limit must be a whole number from 1 to {SESSIONS_MAX}")
        before: tuple[float, str] | None = None
        if "before_at" in request.query or "before_key" in request.query:
            try:
                before = (float(request.query["before_at"]), request.query["before_key"])
            except (KeyError, ValueError):
                return _error(400, "before_at (a number) and before_key go together, as the last page's `next`")
        rows = await self.store.recent_sessions(limit=limit + 1, day_start=self._today().timestamp(), before=before)
        more, rows = len(rows) > limit, rows[:limit]
        last = rows[-1] if rows else None
        return _ok({
            "sessions": [{"key": r.key, "channel": r.channel, "last_activity": r.updated_at, "turns": r.turns,
                          "tokens_today": r.tokens_today, "agent": agent_of_scope(r.scope),
                          "model": self._model_of(r.scope, r.model)} for r in rows],
            "next": {"before_at": last.updated_at, "before_key": last.key} if more and last else None,
            "total": await self.store.count_sessions(),
        })

    async def session(self, request: web.Request) -> web.Response:
        """One session: where it is, its model, its recent messages (what the person wrote
        and the replies, each cut at SESSION_MESSAGE_CHARS, redacted like the log) and,
        while it is live on this gateway, its /context numbers."""
        key = request.query.get("key", "")
        if not 0 < len(key) <= 300:
            return _error(400, "key must be a session key, e.g. ?key=telegram:dm:7")
        row = await self.store.get_session(key)
        if row is None:
            return _error(404, f"no session {key!r}")
        page = await self.store.chat_history_page(key, limit=SESSION_MESSAGES)
        messages = [{"role": m.role, "turn": m.turn, "at": m.created_at,
                     "text": REDACTOR.redact(m.content[:SESSION_MESSAGE_CHARS]),
                     "cut": len(m.content) > SESSION_MESSAGE_CHARS} for m in page.messages]
        context = None
        if self.session_context is not None:
            context = await self.session_context(key)
        return _ok({"key": row.key, "channel": row.channel, "scope": row.scope, "agent": agent_of_scope(row.scope),
                    "model": self._model_of(row.scope, row.model), "created_at": row.created_at,
                    "last_activity": row.updated_at, "context_start_turn": row.context_start_turn,
                    "messages": messages, "older": page.older is not None, "context": context})

    def _model_of(self, scope: str, alias: str | None) -> str:
        """The model a session answers with: its /model pick, else its agent's."""
        cfg = self.config()
        return model_chain(cfg, agent_view(cfg, agent_of_scope(scope)), alias)[0][1].name

    async def agents(self, _request: web.Request) -> web.Response:
        """The agents (SPEC §5.5), what binds messages to them, and their recent sessions
        and today's message tokens (over the AGENT_SESSIONS most recent sessions)."""
        cfg = self.config()
        rows = await self.store.recent_sessions(limit=AGENT_SESSIONS, day_start=self._today().timestamp())
        seen: dict[str, list[int]] = {}
        for r in rows:
            tally = seen.setdefault(agent_of_scope(r.scope), [0, 0])
            tally[0] += 1
            tally[1] += r.tokens_today
        agents = []
        for name in ["default", *sorted(cfg.agents)]:
            view = agent_view(cfg, name)
            alias, model = model_chain(cfg, view, None)[0]
            sessions, tokens = seen.get(name, [0, 0])
            agents.append({"name": name, "model": model.name, "alias": alias, "fallbacks": list(view.fallbacks),
                           "tools": list(view.settings.tools) if view.settings.tools is not None else None,
                           "skills": view.skill_names(), "sessions": sessions, "tokens_today": tokens})
        bindings = [{"match": b.match.model_dump(exclude_none=True), "agent": b.agent} for b in cfg.bindings]
        return _ok({"agents": agents, "bindings": bindings})

    async def pairings(self, _request: web.Request) -> web.Response:
        pending = await self.store.pending_pairings(self.pairing.clock())
        approved = await self.pairing.approved()
        return _ok({"pending": [{"code": p.code, "identity": p.identity, "created_at": p.created_at,
                                 "expires_at": p.expires_at} for p in pending],
                    "approved": [{"identity": p.identity, "approved_by": p.approved_by, "approved_at": p.approved_at}
                                 for p in approved]})

    async def approve(self, request: web.Request) -> web.Response:
        try:
            body = await parse_json_body(await request.read())
        except JsonBodyError as err:
            return _error(400, f"{err}; send {{\"code\": \"ABCD2345\"}}")
        code = body.get("code") if isinstance(body, dict) else None
        if not isinstance(code, str) or not 0 < len(code.strip()) <= 32:
            return _error(400, "code must be the pairing code, e.g. {\"code\": \"ABCD2345\"}")
        # The same path as `/approve CODE` in chat and `gateway pairing approve CODE`: the
        # person is told in their chat when their channel runs here.
        outcome = await self.pairing.approve_code(code, by=APPROVED_BY)
        if not outcome.ok:
            return _error(409 if "already approved" in outcome.text else 404, outcome.text)
        return _ok({"identity": outcome.identity, "message": outcome.text, "told": outcome.told})

    async def revoke(self, request: web.Request) -> web.Response:
        """The same path as `/revoke ID` in chat and `gateway pairing revoke ID`."""
        try:
            body = await parse_json_body(await request.read())
        except JsonBodyError as err:
            return _error(400, f"{err}; send {{\"identity\": \"telegram:7\"}}")
        identity = body.get("identity") if isinstance(body, dict) else None
        if not isinstance(identity, str) or not 0 < len(identity.strip()) <= 200:
            return _error(400, "identity must be an approved person, e.g. {\"identity\": \"telegram:7\"}")
        outcome = await self.pairing.revoke(identity, by=APPROVED_BY, cfg=self.config())
        if not outcome.ok:
            return _error(404, outcome.text)
        return _ok({"identity": outcome.identity, "message": outcome.text})

    async def usage(self, _request: web.Request) -> web.Response:
        today = self._today()
        days = [f"{today - timedelta(days=n):%Y-%m-%d}" for n in range(USAGE_DAYS - 1, -1, -1)]
        index = {day: i for i, day in enumerate(days)}
        people: dict[str, dict[str, Any]] = {}
        for row in await self.store.usage_since(days[0]):
            if row.day not in index:
                continue  # a day ahead of this zone's today (the zone changed): not in the window
            person = people.setdefault(row.identity, {"identity": row.identity, "turns": [0] * USAGE_DAYS,
                                                      "tokens": [0] * USAGE_DAYS})
            person["turns"][index[row.day]] = row.turns
            person["tokens"][index[row.day]] = row.tokens
        for person in people.values():
            person["total_turns"], person["total_tokens"] = sum(person["turns"]), sum(person["tokens"])
        ranked = sorted(people.values(), key=lambda p: (-p["total_tokens"], -p["total_turns"], p["identity"]))
        return _ok({"days": days, "timezone": self.config().timezone, "people": ranked[:USAGE_PEOPLE_MAX],
                    "more_people": max(0, len(ranked) - USAGE_PEOPLE_MAX)})

    async def jobs(self, _request: web.Request) -> web.Response:
        runs = await self.store.job_runs(limit=RECENT_RUNS)
        shown = [{"job": r.job, "slot": r.slot, "started_at": r.started_at, "ended_at": r.ended_at,
                  "outcome": r.outcome, "detail": (r.detail or "")[:300] or None} for r in runs]
        jobs = []
        for name, next_run in sorted(self.next_runs().items()):
            last = (await self.store.job_runs(name, limit=1) or [None])[0]
            jobs.append({"name": name, "next_run": next_run.timestamp() if next_run else None,
                         "last_run": None if last is None else {
                             "started_at": last.started_at, "ended_at": last.ended_at, "outcome": last.outcome,
                             "detail": (last.detail or "")[:300] or None}})
        return _ok({"jobs": jobs, "runs": shown})

    async def status(self, _request: web.Request) -> web.Response:
        try:
            async with asyncio.timeout(READY_TIMEOUT_S):
                checks = await self.ready()
        except Exception as err:  # shown, like /readyz, never a failed page
            checks = {"readiness": f"readiness check failed: {type(err).__name__}: {err}"[:300]}
        channels, others = [], []
        roles = self.receiving()
        for name, problem in checks.items():
            kind, _, label = name.partition(":")
            item = {"name": label or kind, "ok": problem is None, "detail": problem}
            if kind == "channel" and label in roles:
                item["role"] = roles[label]
            (channels if kind == "channel" else others).append(item)
        cluster = None
        if self.cluster is not None:
            try:
                async with asyncio.timeout(READY_TIMEOUT_S):
                    cluster = await self.cluster()
            except Exception as err:
                cluster = {"problem": f"{type(err).__name__}: {err}"[:300]}
        models = self.models() if self.models is not None else {"models": [], "fallbacks": []}
        for model in models["models"]:  # the provider's words may echo a key: masked like the log
            if model.get("last_error") and model["last_error"].get("detail"):
                model["last_error"] = {**model["last_error"],
                                       "detail": REDACTOR.redact_shown(model["last_error"]["detail"])}
        return _ok({"channels": channels, "checks": others, "tool_sources": self.tool_sources(),
                    "cluster": cluster, "model": models, "now": time.time()})

    async def recent_errors(self, _request: web.Request) -> web.Response:
        return _ok({"errors": self.errors.snapshot(), "capacity": self.errors.records.maxlen})
