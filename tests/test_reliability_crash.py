"""Reliability: the gateway is SIGKILLed at random points and restarted; every accepted
Telegram update still gets exactly one reply and the database stays readable.

`python -m gateway run` runs as a child process, polling a fake Bot API that lives in
this process next to the fake model (some of its replies are delayed so that kills land
mid-turn). Kills happen inside the fakes' request handlers, at the n-th call of a kind:
- "model": while the gateway waits for the model (mid-turn);
- "send": inside sendMessage, after Telegram "delivered" the reply but before the gateway
  hears back — the known window between sendMessage and the "answered" mark, where a
  restart delivers the stored reply again (a duplicate);
- "poll": at a getUpdates call (between updates, or idle).
Updates arrive in waves, one before each start, as they would queue up while the bot is
down. At the end the gateway is stopped with SIGTERM and its database is opened with
gateway.store.Store: every session loads and is well formed, PRAGMA integrity_check is
ok, no event is left pending.

`run_crash_scenario` is reused by bench/soak.py with more sessions and kills.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import signal
import sqlite3
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from bench._procs import Child, gateway_config, start_gateway, telegram_section
from gateway.store.sqlite import Store
from gateway.types import Inbound, Message, inbound_to_dict
from tests.conftest import GatewayFactory
from tests.fakes import telegram_server
from tests.fakes.openai_server import FakeModel, Reply, last_user_text
from tests.fakes.telegram_server import FakeTelegram
from tests.test_reliability_faults import session_problems

fake_telegram = telegram_server.fake_telegram  # the fixture

RESEND_NOTICE = "please send it again"
KILL_KINDS = ("model", "send", "poll")
TERMINAL = {"answered", "ignored", "refused", "busy", "failed"}
CONCURRENT_MODEL_CALLS = 8  # limits.max_concurrent_model_calls here: it bounds the turns a kill can catch


class Killer:
    """SIGKILLs the gateway from inside a fake's handler at the n-th call of one kind.

    It holds a pidfd, not a pid: PIDs wrap fast on a busy machine (pid_max 32768), and a
    signal must never reach whatever process got the number next."""

    def __init__(self) -> None:
        self.pidfd: int | None = None
        self.kind = ""
        self.left = 0
        self.fired: asyncio.Future[str] | None = None
        # (chat, text) of each sendMessage a kill landed in: Telegram delivered it, the
        # gateway never heard back (the one duplicate a kill there may cost).
        self.killed_sends: list[tuple[int, str]] = []

    def arm(self, pid: int, kind: str, after: int) -> asyncio.Future[str]:
        self.disarm()
        self.pidfd, self.kind, self.left = os.pidfd_open(pid), kind, after
        self.fired = asyncio.get_running_loop().create_future()
        return self.fired

    def disarm(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None

    def hit(self, kind: str, sent: tuple[int, str] | None = None) -> None:
        if self.pidfd is None or kind != self.kind:
            return
        self.left -= 1
        if self.left > 0:
            return
        try:
            signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
        except ProcessLookupError:
            return
        finally:
            self.disarm()
        if sent is not None:
            self.killed_sends.append(sent)
        if self.fired is not None and not self.fired.done():
            self.fired.set_result(kind)


class CrashTelegram(FakeTelegram):
    """The fake Bot API with kill points in getUpdates and sendMessage."""

    def __init__(self, killer: Killer) -> None:
        super().__init__()
        self.killer = killer
        self.gate: asyncio.Event | None = None  # when set up, sendMessage waits for it (a kill not armed yet)

    async def _get_updates(self, params: dict[str, Any], request: Any) -> Any:
        self.killer.hit("poll")
        return await super()._get_updates(params, request)

    async def _api_sendmessage(self, params: dict[str, Any]) -> Any:
        if self.gate is not None:
            await asyncio.wait_for(self.gate.wait(), 60)
        response = await super()._api_sendmessage(params)
        # Recorded as delivered; the gateway never sees the answer.
        self.killer.hit("send", (int(params["chat_id"]), str(params.get("text", ""))))
        return response

    def visible(self) -> list[dict[str, Any]]:
        """Every bot message people see now, edits applied (replies stream: a message is
        sent with the first text and edited to the whole reply)."""
        return [{"chat_id": chat, "text": parsed.text} for chat, parsed in self._shown.values()]

    async def wait_until(self, ready: Callable[[], bool], timeout: float, what: str) -> None:
        """Like the fake's own waits, but cancellable: Python 3.11's asyncio.wait_for can
        swallow a cancel that arrives as its event fires, and events fire constantly here."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not ready():
            changed = self._changed  # replaced (and set) on every recorded call
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TimeoutError(f"fake telegram: timed out waiting for {what}")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await changed.wait()


@dataclass
class CrashReport:
    sessions: int
    updates: int
    kills: list[str] = field(default_factory=list)  # "kind@n" per kill that happened
    duplicate_replies: int = 0
    # Of those, the replies whose sendMessage a kill landed in (Telegram delivered them and
    # the gateway died before hearing so: at most one per such kill), and all the others
    # (a reply delivered before the kill and sent again: the window this gateway closes).
    duplicates_in_killed_sends: int = 0
    duplicates_elsewhere: int = 0
    # Per kill: the replies Telegram had taken (sendMessage answered) whose message the
    # gateway had not yet made durable (no reply ref naming it, event not answered) when it
    # died: the sends the kill landed inside, from the gateway's side. Their replies may
    # come twice (Telegram has no idempotency key); every other reply must come once.
    in_flight: list[list[tuple[int, str]]] = field(default_factory=list)
    duplicates_inside_sends: int = 0  # duplicate replies whose send was in flight at a kill
    duplicates_outside_sends: int = 0  # all other duplicates (the goal: none)
    duplicate_user_messages: int = 0
    resend_notices: int = 0
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    session_problems: list[str] = field(default_factory=list)
    pending_events: int = 0
    integrity: str = ""
    error_lines: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def line(self) -> str:
        kills = [f"{kill} [{len(flying)} in flight]" for kill, flying in zip(self.kills, self.in_flight, strict=False)]
        return (f"{self.sessions} sessions, {self.updates} updates, {len(self.kills)} kills "
                f"({', '.join(kills)}): {self.duplicate_replies} duplicate replies "
                f"({self.duplicates_in_killed_sends} of a send a kill landed in, {self.duplicates_elsewhere} others; "
                f"{self.duplicates_inside_sends} of the {sum(map(len, self.in_flight))} sends in flight at the "
                f"kills, {self.duplicates_outside_sends} outside), "
                f"{self.duplicate_user_messages} duplicate user messages, {self.resend_notices} resend notices, "
                f"{len(self.missing)} missing, {len(self.unexpected)} unexpected, "
                f"{len(self.session_problems)} session problems, {self.pending_events} pending events, "
                f"integrity {self.integrity}, {len(self.error_lines)} ERROR log lines, {self.seconds:.1f}s")


def _model_responder(killer: Killer, delayed_every: int, delay_s: float) -> Any:
    def respond(body: dict[str, Any]) -> Reply:
        killer.hit("model")
        text = last_user_text(body)
        slow = delayed_every > 0 and sum(map(ord, text)) % delayed_every == 0
        return Reply(text=f"echo: {text}", delay=delay_s if slow else 0.0)
    return respond


async def _start(config: Path, log: Path, telegram: CrashTelegram) -> Child:
    """Start a gateway and wait until it polls."""
    polls = len(telegram.calls_of("getUpdates"))
    child = await start_gateway(config, log)
    await telegram.wait_until(lambda: len(telegram.calls_of("getUpdates")) > polls, 30, "the first poll")
    return child


async def run_crash_scenario(workdir: Path, *, sessions: int = 50, messages_per_session: int = 3, kills: int = 3,
                             seed: int = 7, delayed_every: int = 4, delay_s: float = 0.3,
                             settle_timeout: float = 120) -> CrashReport:
    """Push `messages_per_session` waves of one message per session, SIGKILL the gateway
    `kills` times at random points, restart it each time, then check every reply and the
    database. Returns what it saw; the caller decides what is acceptable."""
    started = time.monotonic()
    rng = random.Random(seed)
    killer = Killer()
    # A killed client leaves the fakes' handlers with "Connection lost": expected here.
    server_log = logging.getLogger("aiohttp.server")
    server_level = server_log.level
    server_log.setLevel(logging.CRITICAL)
    report = CrashReport(sessions=sessions, updates=sessions * messages_per_session)
    telegram = CrashTelegram(killer)
    model = FakeModel()
    await telegram.start()
    await model.start()
    model.respond_with(_model_responder(killer, delayed_every, delay_s))
    expected: dict[tuple[int, str], int] = {}  # (chat, text) → update_id
    child: Child | None = None

    def answered() -> bool:
        """Every update has its echo, or its chat got as many resend notices as it misses."""
        shown = telegram.visible()
        replied = {(int(m["chat_id"]), m["text"]) for m in shown}
        notices = Counter(int(m["chat_id"]) for m in shown if RESEND_NOTICE in m["text"])
        open_by_chat = Counter(chat for chat, text in expected if (chat, f"echo: {text}") not in replied)
        return all(open_by_chat[chat] <= notices[chat] for chat in open_by_chat)

    try:
        config = gateway_config(workdir, model.base_url,
                                telegram=telegram_section(telegram.base_url, telegram.base_file_url,
                                                          telegram.token, poll_timeout_s=1),
                                limits={"max_concurrent_model_calls": CONCURRENT_MODEL_CALLS})
        waves = [[(1000 + s, f"s{s} m{m} {rng.randrange(10**6)}") for s in range(sessions)]
                 for m in range(messages_per_session)]
        lives = kills + 1
        for life in range(lives):
            # Waves spread over the lives; a life without one recovers the previous work.
            for wave in (w for w in range(messages_per_session) if w * lives // messages_per_session == life):
                for chat, text in waves[wave]:
                    expected[(chat, text)] = telegram.push_message(chat_id=chat, user_id=chat, text=text)
            life_sends = len(telegram.history)  # what this life shows starts here
            child = await _start(config, workdir / f"gateway-{life}.log", telegram)
            if life == kills:
                break
            kind = rng.choice(KILL_KINDS)
            after = rng.randint(1, 3) if kind == "poll" else rng.randint(1, max(2, sessions // 2))
            fired = killer.arm(child.pid, kind, after)
            exited = asyncio.create_task(child.proc.wait())
            idle = asyncio.create_task(telegram.wait_until(answered, settle_timeout, "idle"))
            await asyncio.wait({fired, exited, idle}, timeout=settle_timeout, return_when=asyncio.FIRST_COMPLETED)
            killer.disarm()
            if fired.done():
                report.kills.append(f"{kind}@{after}")
            elif exited.done():
                report.error_lines.append(f"gateway life {life} exited by itself with code {exited.result()}")
            else:
                report.kills.append("idle")  # the work ran out before the trigger: kill it idle
            idle.cancel()
            await child.kill()
            await asyncio.wait({exited, idle})
            sent = [(int(chat), mid, text) for method, chat, mid, text in telegram.history[life_sends:]
                    if method == "sendMessage"]
            report.in_flight.append(await asyncio.to_thread(_not_durable, workdir / "data" / "gateway.sqlite3",
                                                            sent))

        try:
            await telegram.wait_until(answered, settle_timeout, "a reply to every update")
            await telegram.wait_confirmed(max(expected.values()) + 1, timeout=settle_timeout)
        except TimeoutError:
            pass  # reported below as missing replies
        assert child is not None
        code = await child.stop(timeout=30)
        if code != 0:
            report.error_lines.append(f"the final gateway exited with code {code}")
    finally:
        if child is not None and child.returncode is None:
            await child.kill()
        await telegram.stop()
        await model.stop()
        server_log.setLevel(server_level)

    _check_replies(report, expected, telegram.visible(), killer.killed_sends,
                   [send for sends in report.in_flight for send in sends])
    await _check_database(report, workdir / "data" / "gateway.sqlite3", expected)
    for log in sorted(workdir.glob("gateway-*.log")):
        report.error_lines += [f"{log.name}: {line[:300]}" for line in log.read_text(errors="replace").splitlines()
                               if " ERROR " in line or "Traceback" in line]
    report.seconds = time.monotonic() - started
    return report


def _not_durable(path: Path, sent: list[tuple[int, int, str]]) -> list[tuple[int, str]]:
    """(chat, text) of the messages in `sent` (chat, message id, text) that the killed
    gateway had not made durable: no event's reply ref names the message, and the event of
    that reply (by its echoed text) is not answered. Read from the database the kill left."""
    if not sent:
        return []
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        rows = db.execute("SELECT status, reply_ref, inbound FROM events WHERE channel='telegram'").fetchall()
    finally:
        db.close()
    kept: set[tuple[int, int]] = set()
    answered: set[tuple[int, str]] = set()
    for status, ref, inbound in rows:
        if ref:
            data = json.loads(ref)
            kept.update((int(data["chat_id"]), int(mid)) for mid in data.get("message_ids", []))
        if status == "answered" and inbound:
            message = json.loads(inbound)
            answered.add((int(message["chat_id"]), f"echo: {message['text']}"))
    return [(chat, text) for chat, mid, text in sent if (chat, mid) not in kept and (chat, text) not in answered]


def _check_replies(report: CrashReport, expected: dict[tuple[int, str], int], sent: list[dict[str, Any]],
                   killed_sends: list[tuple[int, str]] = (),  # type: ignore[assignment]
                   in_flight: list[tuple[int, str]] = ()) -> None:  # type: ignore[assignment]
    echoes = Counter((int(m["chat_id"]), str(m["text"])) for m in sent)
    notices = Counter(int(m["chat_id"]) for m in sent if RESEND_NOTICE in str(m["text"]))
    report.resend_notices = sum(notices.values())
    known = {(chat, f"echo: {text}") for chat, text in expected}
    killed = Counter(killed_sends)
    flying = Counter(in_flight)
    for (chat, text), count in echoes.items():
        if (chat, text) in known:
            extra = count - 1
        elif any(c == chat and reply.startswith(text) for c, reply in known):
            # A streamed reply's first message, sent just before a kill: the gateway never
            # learned its id, so the resumed turn could not edit it (the same window as a
            # duplicate reply: Telegram has no idempotency key).
            extra = count
        else:
            if RESEND_NOTICE not in text:
                report.unexpected.append(f"chat {chat}: {text[:100]!r}")
            continue
        in_killed = min(extra, killed[(chat, text)])
        inside = min(extra, flying[(chat, text)])
        report.duplicate_replies += extra
        report.duplicates_in_killed_sends += in_killed
        report.duplicates_elsewhere += extra - in_killed
        report.duplicates_inside_sends += inside
        report.duplicates_outside_sends += extra - inside
    unanswered = Counter(chat for chat, text in expected if echoes[(chat, f"echo: {text}")] == 0)
    for chat, count in unanswered.items():
        if count > notices[chat]:
            report.missing += [f"chat {chat}: {t!r}" for c, t in expected if c == chat
                               and echoes[(chat, f"echo: {t}")] == 0]


async def _check_database(report: CrashReport, path: Path, expected: dict[tuple[int, str], int]) -> None:
    store = await Store.open(path)
    try:
        db = store.connection
        async with db.execute("SELECT key FROM sessions") as cur:
            keys = [row[0] for row in await cur.fetchall()]
        users: Counter[tuple[int, str]] = Counter()
        for key in keys:
            messages = await store.messages(key)  # every session loads
            report.session_problems += [f"{key}: {p}" for p in session_problems(messages)]
            chat = int(key.rsplit(":", 1)[1]) if key.startswith("telegram:dm:") else 0
            users.update((chat, m.content) for m in messages if m.role == "user")
        report.duplicate_user_messages = sum(n - 1 for n in users.values() if n > 1)
        missing_rows = [f"{c}: {t!r}" for c, t in expected if users[(c, t)] == 0]
        report.session_problems += [f"user message never stored: {row}" for row in missing_rows]
        async with db.execute("SELECT status, count(*) FROM events GROUP BY status") as cur:
            statuses = {row[0]: row[1] for row in await cur.fetchall()}
        report.pending_events = sum(n for status, n in statuses.items() if status not in TERMINAL)
        async with db.execute("PRAGMA integrity_check") as cur:
            report.integrity = " ".join(str(row[0]) for row in await cur.fetchall())
    finally:
        await store.close()


async def test_sigkill_at_random_points_answers_every_update_exactly_once(tmp_path: Path) -> None:
    kills = 3
    report = await run_crash_scenario(tmp_path, sessions=50, messages_per_session=3, kills=kills, seed=7)
    print("\ncrash:", report.line())  # shown with -s; the soak prints the same line
    assert report.missing == []
    assert report.unexpected == []
    assert report.session_problems == []
    assert report.pending_events == 0
    assert report.integrity == "ok"
    assert report.error_lines == []
    assert len(report.kills) >= 1, "no kill trigger fired"
    # A reply may come twice only when a kill landed inside its send (Telegram took it, the
    # gateway had not recorded its message yet): at most the turns in flight at each kill.
    # A reply whose message was recorded never comes again.
    assert report.duplicate_replies <= kills * CONCURRENT_MODEL_CALLS
    assert report.duplicates_outside_sends == 0
    # Storing the user message marks its event "running" in the same statement (migration
    # 3), so a kill cannot fall between the two any more; a database left in that state by
    # an older version is still recovered (the test below).


async def test_restart_after_the_user_message_was_stored_runs_the_turn_once(
    tmp_path: Path, make_gateway: GatewayFactory, fake_model: FakeModel, fake_telegram: FakeTelegram
) -> None:
    # The database exactly as a SIGKILL between those two commits left it before migration 3.
    store = await Store.open(tmp_path / "data" / "gateway.sqlite3")
    inbound = Inbound(channel="telegram", chat_id="9", user_id="9", text="are you there?", event_id="500",
                      message_id="1", extra={"chat_type": "private"})
    await store.ensure_session("telegram:dm:9", "telegram:user:9", "telegram")
    await store.record_event("telegram", "500", session_key="telegram:dm:9", inbound=inbound_to_dict(inbound))
    await store.add_message("telegram:dm:9", Message(role="user", content="are you there?", turn=1), seq=0)
    await store.close()

    gw = await make_gateway(access={"dm_policy": "open"}, channels={"telegram": telegram_section(
        fake_telegram.base_url, fake_telegram.base_file_url, fake_telegram.token, poll_timeout_s=1)})
    (reply,) = await fake_telegram.wait_sent(1)
    assert reply["text"] == "echo: are you there?"
    assert gw.services is not None
    await gw.services.background.wait_idle(5)
    rows = await gw.services.store.messages("telegram:dm:9")
    assert [(m.role, m.content) for m in rows] == [("user", "are you there?"), ("assistant", "echo: are you there?")]


# Two Telegram messages' worth (each chunk at most 4,096 UTF-16 units), cut at the blank line.
LONG_REPLY = "first part " + "alpha " * 600 + "\n\n" + "second part " + "omega " * 600


@pytest.mark.parametrize("resumed", [False, True], ids=["a turn", "a turn resumed after a restart"])
async def test_a_reply_shown_before_a_kill_is_never_sent_again(tmp_path: Path, resumed: bool) -> None:
    """The reply's platform message is made durable as soon as Telegram answered: the
    gateway is SIGKILLed inside the sendMessage of the reply's second message (after the
    first one was answered, before the turn's end was written), and the restarted gateway
    edits the first message instead of sending it again; only the message the kill landed
    in may come twice. Also when the reply was itself being delivered by a turn resumed
    after an earlier restart (that delivery recorded no reference before)."""
    killer = Killer()
    telegram = CrashTelegram(killer)
    model = FakeModel()
    await telegram.start()
    await model.start()
    model.respond_with(lambda body: Reply(text=LONG_REPLY))
    child: Child | None = None
    data = tmp_path / "data"
    try:
        if resumed:
            # The database as a kill after the reply was stored, before it was sent, left it.
            store = await Store.open(data / "gateway.sqlite3")
            inbound = Inbound(channel="telegram", chat_id="9", user_id="9", text="tell me a lot", event_id="1",
                              message_id="1", extra={"chat_type": "private"})
            await store.ensure_session("telegram:dm:9", "telegram:user:9", "telegram")
            await store.record_event("telegram", "1", session_key="telegram:dm:9", inbound=inbound_to_dict(inbound))
            await store.add_message("telegram:dm:9", Message(role="user", content="tell me a lot", turn=1), seq=0,
                                    event=("telegram", "1"))
            await store.add_message("telegram:dm:9", Message(role="assistant", content=LONG_REPLY, turn=1), seq=1)
            await store.close()
            telegram._next_update_id = 2  # that update was taken before the restart
        else:
            telegram.push_message(chat_id=9, user_id=9, text="tell me a lot")
        config = gateway_config(tmp_path, model.base_url, telegram=telegram_section(
            telegram.base_url, telegram.base_file_url, telegram.token, poll_timeout_s=1))
        telegram.gate = asyncio.Event()  # nothing is sent before the kill is armed
        child = await start_gateway(config, tmp_path / "gateway-1.log")
        fired = killer.arm(child.pid, "send", 2)  # inside the second message's sendMessage
        telegram.gate.set()
        await asyncio.wait_for(fired, 60)
        await child.kill()
        first, second = [text for method, chat, _, text in telegram.history if method == "sendMessage"]

        child = await start_gateway(config, tmp_path / "gateway-2.log")
        await telegram.wait_until(lambda: len(telegram.visible()) >= 2 and _answered(data, "1" if resumed else None),
                                  60, "the reply in full, the turn ended")
        code = await child.stop()
        assert code == 0
    finally:
        killer.disarm()
        if child is not None and child.returncode is None:
            await child.kill()
        await telegram.stop()
        await model.stop()

    sends = [text for method, chat, _, text in telegram.history if method == "sendMessage"]
    assert sends.count(first) == 1, "the first message was sent again after the restart"
    assert sends.count(second) == 2  # the one the kill landed in: Telegram has no idempotency key
    shown = sorted(m["text"] for m in telegram.visible())
    assert shown == sorted([first, second, second])
    for log in tmp_path.glob("gateway-*.log"):
        assert " ERROR " not in log.read_text(errors="replace")


def _answered(data: Path, event_id: str | None) -> bool:
    """Whether the turn's event (the only Telegram one, or `event_id`) is answered."""
    db = sqlite3.connect(f"file:{data / 'gateway.sqlite3'}?mode=ro", uri=True)
    try:
        rows = db.execute("SELECT event_id, status FROM events WHERE channel='telegram'").fetchall()
    except sqlite3.Error:
        return False
    finally:
        db.close()
    return any(status == "answered" and event_id in (None, eid) for eid, status in rows)


if __name__ == "__main__":  # a quick manual run: python -m tests.test_reliability_crash
    with tempfile.TemporaryDirectory() as tmp:
        print(asyncio.run(run_crash_scenario(Path(tmp))).line())
