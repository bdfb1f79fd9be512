"""Several `gateway run` processes on one database, behind a round-robin proxy, with the
platforms played by this process: shared by tests/test_cluster_e2e.py and bench/cluster.py.

- `Cluster`: N gateways (bench._procs children), each on its own HTTP port, all with the
  same `store.url` and the same `data_dir`; Telegram in webhook mode and Slack in HTTP
  (Events API) mode, both pointed at the fakes, the model at the fake model.
- `RoundRobinProxy`: an aiohttp reverse proxy on 127.0.0.1 that sends each request to the
  next live gateway and answers 502 when the connection to it fails (that gateway is then
  skipped for a while, as a load balancer's passive health check would).
- `TelegramSender` / `SlackSender`: the platforms' delivery of updates and events through
  the proxy, with their retry rules: Telegram redelivers an update until it gets a 2xx
  (at-least-once); Slack signs every request and retries a failed delivery at most three
  times with `X-Slack-Retry-Num`.
- `ReplyLog`: every reply the fakes were sent (chat, text, when), in arrival order.

PostgreSQL comes from tests/pg.py (`pg_server()`, `create_database()`): a throw-away
server in a temporary directory on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import re
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
from aiohttp import web

from bench._procs import ROOT, Child, gateway_config, start_gateway, wait_ready
from tests.fakes.slack_server import FakeSlack, event_callback, signed_event_request
from tests.fakes.telegram_server import FakeTelegram

TELEGRAM_SECRET = "cluster-hook-secret-0123456789"  # Telegram's charset, 16+ characters
SLACK_SIGNING_SECRET = "cluster-signing-secret"
TOKEN = re.compile(r"\b[tdc]\d+-m\d+-[0-9a-f]{6}\b")  # the unique word in every test message

# Hop-by-hop headers (RFC 9110 §7.6.1) and what aiohttp recomputes: never forwarded.
_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                  "transfer-encoding", "upgrade", "host", "content-length", "content-encoding"})


# ---------------------------------------------------------------------------- sessions


@dataclass(frozen=True, slots=True)
class ChatSession:
    """One conversation the test plays: a Telegram private chat, a Slack DM or a Slack
    channel where one person mentions the bot."""

    kind: str  # "telegram" | "slack-dm" | "slack-channel"
    index: int

    @property
    def platform(self) -> str:
        return "telegram" if self.kind == "telegram" else "slack"

    @property
    def chat(self) -> str:
        """The chat id as the fakes record replies to it."""
        if self.kind == "telegram":
            return str(10_000 + self.index)
        return f"{'D' if self.kind == 'slack-dm' else 'C'}{9_000 + self.index}"

    @property
    def user(self) -> str:
        return str(10_000 + self.index) if self.kind == "telegram" else f"U{9_000 + self.index}"

    @property
    def key(self) -> str:
        """The gateway's session key (gateway/keys.py)."""
        if self.kind == "telegram":
            return f"telegram:dm:{self.user}"
        if self.kind == "slack-dm":
            return f"slack:dm:{self.chat}"
        return f"slack:channel:{self.chat}:user:{self.user}"

    @property
    def scope(self) -> str:
        """Its memory scope."""
        if self.kind == "slack-channel":
            return f"slack:group:{self.chat}:user:{self.user}"
        return f"{self.platform}:user:{self.user}"

    @property
    def admit(self) -> str:
        """Its `access.allow_from` entry: the person in a DM, the channel in a group."""
        return f"{self.platform}:{self.chat if self.kind == 'slack-channel' else self.user}"

    def token(self, message: int, salt: str) -> str:
        return f"{self.kind[0] if self.kind == 'telegram' else self.kind[6]}{self.index}-m{message}-{salt}"


def chat_sessions(telegram: int, slack_dm: int, slack_channel: int) -> list[ChatSession]:
    """Sessions of each kind, interleaved so every slice of the list mixes platforms."""
    kinds = [("telegram", telegram), ("slack-dm", slack_dm), ("slack-channel", slack_channel)]
    lists = [[ChatSession(kind, i) for i in range(n)] for kind, n in kinds]
    return [s for group in itertools.zip_longest(*lists) for s in group if s is not None]


def allowlist(sessions: Sequence[ChatSession]) -> dict[str, Any]:
    return {"dm_policy": "allowlist", "allow_from": sorted({s.admit for s in sessions}),
            "group_trigger": "mention"}


# ---------------------------------------------------------------------------- replies


@dataclass(frozen=True, slots=True)
class SeenReply:
    at: float  # time.monotonic() when the fake recorded it
    chat: str
    text: str


class ReplyLog:
    """Every reply delivered to the fakes, in order; `wait` for a predicate over them."""

    def __init__(self) -> None:
        self.replies: list[SeenReply] = []
        self._changed = asyncio.Event()
        self.listeners: list[Callable[[SeenReply], None]] = []

    def add(self, chat: Any, text: str) -> None:
        reply = SeenReply(time.monotonic(), str(chat), text)
        self.replies.append(reply)
        for listener in self.listeners:
            listener(reply)
        self._changed.set()

    async def wait(self, ready: Callable[[], bool], timeout: float) -> bool:
        """Wait until `ready()`; False when `timeout` passed first."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not ready():
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(remaining, 0.5)):
                    await self._changed.wait()
        return True


class LoggedTelegram(FakeTelegram):
    """The fake Bot API, every delivered sendMessage also in a ReplyLog."""

    def __init__(self, log: ReplyLog, **limits: Any) -> None:
        super().__init__(**limits)
        self.log = log

    async def _api_sendmessage(self, params: dict[str, Any]) -> web.Response:
        before = len(self.sent)
        response = await super()._api_sendmessage(params)
        if len(self.sent) > before:
            self.log.add(params["chat_id"], str(self.history[-1][3]))
        return response


class LoggedSlack(FakeSlack):
    """The fake Slack, every posted message also in a ReplyLog."""

    def __init__(self, log: ReplyLog) -> None:
        super().__init__()
        self.log = log

    def _post(self, params: dict[str, Any]) -> dict[str, Any]:
        answer = super()._post(params)
        if answer.get("ok"):
            self.log.add(params.get("channel", ""), str(answer["message"]["text"]))
        return answer


# ---------------------------------------------------------------------------- the proxy


@dataclass
class Upstream:
    url: str
    down_until: float = 0.0
    forwarded: int = 0
    failed: int = 0


class RoundRobinProxy:
    """A reverse proxy: each request to the next live upstream, 502 when the connection to
    it fails (then it is skipped for `down_s`, a passive health check)."""

    def __init__(self, upstreams: Sequence[str] = (), *, down_s: float = 3.0, timeout_s: float = 30.0) -> None:
        self.upstreams = [Upstream(u.rstrip("/")) for u in upstreams]
        self.down_s = down_s
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.url = ""
        self.bad_gateway = 0
        self._next = 0
        self._runner: web.AppRunner | None = None
        self._http: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self._http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), auto_decompress=False,
                                           cookie_jar=aiohttp.DummyCookieJar())
        app = web.Application(client_max_size=4 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._http is not None:
            await self._http.close()
            self._http = None

    def set_upstreams(self, urls: Sequence[str]) -> None:
        self.upstreams = [Upstream(u.rstrip("/")) for u in urls]
        self._next = 0

    def _pick(self) -> Upstream:
        now = time.monotonic()
        count = len(self.upstreams)
        for _ in range(count):
            upstream = self.upstreams[self._next % count]
            self._next += 1
            if upstream.down_until <= now:
                return upstream
        upstream = self.upstreams[self._next % count]  # all down: try them anyway, in turn
        self._next += 1
        return upstream

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        assert self._http is not None
        if not self.upstreams:
            return web.Response(status=503, text="no upstreams")
        body = await request.read()
        upstream = self._pick()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        headers["X-Forwarded-For"] = request.remote or ""
        try:
            async with self._http.request(request.method, upstream.url + request.path_qs, data=body,
                                          headers=headers, allow_redirects=False, timeout=self.timeout) as resp:
                data = await resp.read()
                out = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP}
                if "Content-Encoding" in resp.headers:  # passed through as it came
                    out["Content-Encoding"] = resp.headers["Content-Encoding"]
                upstream.forwarded += 1
                return web.Response(status=resp.status, body=data, headers=out)
        except (aiohttp.ClientError, OSError, TimeoutError) as err:
            upstream.failed += 1
            upstream.down_until = time.monotonic() + self.down_s
            self.bad_gateway += 1
            return web.Response(status=502, text=f"bad gateway: {type(err).__name__}")


# ---------------------------------------------------------------------------- the platforms' senders


@dataclass
class Delivery:
    """One message as the platform delivered it: when it was first sent, when (if ever) the
    gateway accepted it with a 2xx, and every attempt's status (0: no answer)."""

    session: ChatSession
    token: str
    text: str
    sent_at: float
    accepted_at: float | None = None
    statuses: list[int] = field(default_factory=list)

    @property
    def accepted(self) -> bool:
        return self.accepted_at is not None


class TelegramSender:
    """Telegram's webhook delivery: POST the update with the secret header; redeliver it
    while the answer is not a 2xx (backing off, up to `give_up_s`)."""

    def __init__(self, http: aiohttp.ClientSession, proxy_url: str, *, give_up_s: float = 60.0,
                 attempt_timeout_s: float = 10.0) -> None:
        self.http = http
        self.url = proxy_url + "/telegram/webhook"
        self.give_up_s = give_up_s
        self.timeout = aiohttp.ClientTimeout(total=attempt_timeout_s)
        self._update_ids = itertools.count(1)
        self._message_ids = itertools.count(1)

    def update(self, session: ChatSession, text: str) -> dict[str, Any]:
        user = int(session.user)
        return {"update_id": next(self._update_ids), "message": {
            "message_id": next(self._message_ids), "date": int(time.time()), "text": text,
            "chat": {"id": int(session.chat), "type": "private", "first_name": f"P{user}"},
            "from": {"id": user, "is_bot": False, "first_name": f"P{user}", "username": f"p{user}"}}}

    async def deliver(self, delivery: Delivery) -> Delivery:
        body = json.dumps(self.update(delivery.session, delivery.text)).encode()
        headers = {"X-Telegram-Bot-Api-Secret-Token": TELEGRAM_SECRET, "Content-Type": "application/json"}
        deadline = time.monotonic() + self.give_up_s
        pause = 0.2
        while True:
            status = await _post(self.http, self.url, body, headers, self.timeout)
            delivery.statuses.append(status)
            if 200 <= status < 300:
                delivery.accepted_at = time.monotonic()
                return delivery
            if time.monotonic() + pause > deadline:
                return delivery
            await asyncio.sleep(pause)  # Telegram backs off between redeliveries
            pause = min(pause * 2, 2.0)


class SlackSender:
    """Slack's Events API delivery: every attempt signed with the signing secret; a delivery
    that fails (no 2xx within 3 s) is retried at most 3 times with X-Slack-Retry-Num, as
    Slack does (its pauses, 0 s, 1 min and 5 min, shortened to `pauses`)."""

    RETRIES = 3

    def __init__(self, http: aiohttp.ClientSession, proxy_url: str, *,
                 pauses: Sequence[float] = (0.1, 1.0, 3.0), attempt_timeout_s: float = 3.0,
                 bot_user_id: str = "UBOT") -> None:
        self.http = http
        self.url = proxy_url + "/slack/events"
        self.pauses = pauses
        self.timeout = aiohttp.ClientTimeout(total=attempt_timeout_s)
        self.bot_user_id = bot_user_id
        self._ts = itertools.count(1)

    def event(self, session: ChatSession, text: str) -> dict[str, Any]:
        ts = f"{int(time.time())}.{next(self._ts):06d}"
        if session.kind == "slack-dm":
            event = {"type": "message", "user": session.user, "text": text, "ts": ts, "channel": session.chat,
                     "channel_type": "im"}
        else:
            event = {"type": "app_mention", "user": session.user, "text": f"<@{self.bot_user_id}> {text}",
                     "ts": ts, "channel": session.chat, "channel_type": "channel"}
        return event_callback(event, event_id=f"Ev{uuid.uuid4().hex[:12]}")

    async def deliver(self, delivery: Delivery) -> Delivery:
        payload = self.event(delivery.session, delivery.text)
        for attempt in range(self.RETRIES + 1):
            body, headers = signed_event_request(SLACK_SIGNING_SECRET, payload,
                                                 retry_num=attempt if attempt else None)
            status = await _post(self.http, self.url, body, headers, self.timeout)
            delivery.statuses.append(status)
            if 200 <= status < 300:
                delivery.accepted_at = time.monotonic()
                return delivery
            if attempt < self.RETRIES:
                await asyncio.sleep(self.pauses[min(attempt, len(self.pauses) - 1)])
        return delivery


async def _post(http: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str],
                timeout: aiohttp.ClientTimeout) -> int:
    try:
        async with http.post(url, data=body, headers=headers, timeout=timeout) as resp:
            await resp.read()
            return resp.status
    except (aiohttp.ClientError, OSError, TimeoutError):
        return 0


class Senders:
    """Both platforms' senders on one client session; `send` picks by the session's platform."""

    def __init__(self, proxy_url: str, *, telegram_give_up_s: float = 60.0) -> None:
        self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                          cookie_jar=aiohttp.DummyCookieJar())
        self.telegram = TelegramSender(self.http, proxy_url, give_up_s=telegram_give_up_s)
        self.slack = SlackSender(self.http, proxy_url)

    async def close(self) -> None:
        await self.http.close()

    async def send(self, session: ChatSession, token: str, text: str | None = None) -> Delivery:
        delivery = Delivery(session, token, text or token, time.monotonic())
        if session.platform == "telegram":
            return await self.telegram.deliver(delivery)
        return await self.slack.deliver(delivery)


# ---------------------------------------------------------------------------- the gateways


def channels_section(telegram: FakeTelegram, slack: FakeSlack) -> dict[str, Any]:
    """Telegram in webhook mode and Slack in HTTP mode, on the fakes, replies sent whole
    (no streaming: a reply is one message, easy to match and to count)."""
    return {
        "telegram": {"enabled": True, "token": telegram.token, "base_url": telegram.base_url,
                     "base_file_url": telegram.base_file_url, "mode": "webhook",
                     "webhook_url": "https://bot.example/telegram/webhook", "webhook_secret": TELEGRAM_SECRET,
                     "streaming": "off"},
        "slack": {"enabled": True, "bot_token": slack.bot_token, "signing_secret": SLACK_SIGNING_SECRET,
                  "base_url": slack.base_url, "mode": "http", "streaming": "off",
                  # A channel's mentions continue one session per person (ChatSession.key), in order.
                  "reply_to_mode": "channel"},
    }


ROUND_TRIP_PROBE = ROOT / "bench" / "probes" / "pg_round_trips"


class Cluster:
    """N `gateway run` processes on one store and one data dir, behind a RoundRobinProxy."""

    def __init__(self, workdir: Path, *, size: int, store_url: str | None, model_url: str,
                 telegram: FakeTelegram, slack: FakeSlack, sessions: Sequence[ChatSession],
                 **config: Any) -> None:
        self.workdir = workdir
        self.size = size
        self.store_url = store_url
        self.data_dir = workdir / "data"
        self.model_url = model_url
        self.channels = channels_section(telegram, slack)
        self.access = allowlist(sessions)
        self.config = config
        self.gateways: list[Child] = []
        self.killed: list[Child] = []
        self.proxy = RoundRobinProxy()

    def config_path(self, i: int) -> Path:
        overrides: dict[str, Any] = {"data_dir": str(self.data_dir), "channels": self.channels,
                                     "access": self.access, **self.config}
        if self.store_url:
            overrides["store"] = {"url": self.store_url}
        return gateway_config(self.workdir / f"gw{i}", self.model_url, **overrides)

    async def start(self) -> None:
        await self.proxy.start()
        # The first one alone creates the schema; the others then start together.
        first = await self._start_one(0)
        rest = await asyncio.gather(*(self._start_one(i) for i in range(1, self.size)), return_exceptions=True)
        self.gateways = [first] + [g for g in rest if isinstance(g, Child)]
        failed = [g for g in rest if isinstance(g, BaseException)]
        if failed:
            raise failed[0]
        self.proxy.set_upstreams([g.url for g in self.gateways])

    def round_trips_file(self, i: int) -> Path:
        """Where gateway i's PostgreSQL round trips are counted (bench/probes/pg_round_trips)."""
        return self.workdir / f"gateway-{i}.round-trips.json"

    async def _start_one(self, i: int) -> Child:
        env = None
        if self.store_url:
            env = {"PYTHONPATH": str(ROUND_TRIP_PROBE), "PG_ROUND_TRIPS_FILE": str(self.round_trips_file(i))}
        child = await start_gateway(self.config_path(i), self.workdir / f"gateway-{i}.log", env=env)
        await wait_ready(child.url, timeout=60, interval=0.05)
        return child

    async def kill(self, i: int) -> Child:
        """SIGKILL gateway i (the proxy finds out on its next request to it)."""
        victim = self.gateways[i]
        await victim.kill()
        self.killed.append(victim)
        return victim

    async def stop(self) -> list[int]:
        codes = await asyncio.gather(*(g.stop(timeout=20) for g in self.gateways if g not in self.killed))
        await self.proxy.stop()
        return list(codes)

    def live(self) -> list[Child]:
        return [g for g in self.gateways if g not in self.killed]

    async def tear_down(self, senders: Senders | None, *servers: Any) -> None:
        """Whatever happened: the senders closed, gateways still running killed, the proxy
        and the given fake servers stopped."""
        if senders is not None:
            await senders.close()
        for child in self.live():
            if child.returncode is None:
                await child.kill()
        await self.proxy.stop()
        for server in servers:
            await server.stop()

    def error_lines(self) -> list[str]:
        found = []
        for log in sorted(self.workdir.glob("gateway-*.log")):
            found += [f"{log.name}: {line[:300]}" for line in log.read_text(errors="replace").splitlines()
                      if " ERROR " in line or "Traceback" in line]
        return found


def instance_pid(instance: str | None) -> int | None:
    """The pid in a PgStore instance name (host-pid-random)."""
    if not instance:
        return None
    parts = instance.rsplit("-", 2)
    return int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None


async def served_by(store_url: str, pid: int) -> dict[str, set[str]]:
    """The waiting messages (by token) of the sessions gateway `pid` is serving: those it
    accepted, and every waiting one of a session whose lease it holds."""
    conn = await asyncpg.connect(store_url, timeout=10)
    try:
        waiting = await conn.fetch("SELECT session_key, instance, inbound FROM events "
                                   "WHERE status IN ('accepted','queued','running')")
        leased: set[str] = set()
        with contextlib.suppress(asyncpg.UndefinedTableError):
            leased = {str(r["name"]).removeprefix("session:") for r in await conn.fetch(
                "SELECT name, holder FROM leases WHERE name LIKE 'session:%'") if instance_pid(r["holder"]) == pid}
    finally:
        await conn.close(timeout=5)
    served: dict[str, set[str]] = {}
    for r in waiting:
        found = TOKEN.search(r["inbound"] or "")
        if found and (instance_pid(r["instance"]) == pid or r["session_key"] in leased):
            served.setdefault(r["session_key"], set()).add(found.group(0))
    return served


async def lease_holder_pids(store_url: str, prefix: str) -> set[int]:
    """The pids of the gateways holding a live lease whose name starts with `prefix`
    (e.g. "job:" for a scheduled job's run)."""
    conn = await asyncpg.connect(store_url, timeout=10)
    try:
        rows = await conn.fetch("SELECT holder FROM leases WHERE starts_with(name, $1) AND expires_at > now()",
                                prefix)
    finally:
        await conn.close(timeout=5)
    return {pid for r in rows if (pid := instance_pid(r["holder"])) is not None}
