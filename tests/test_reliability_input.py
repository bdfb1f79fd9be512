"""Reliability: hostile platform input through the running adapters of a running gateway.

Hypothesis builds Telegram updates and Slack events from a valid one by dropping fields,
putting junk of any JSON type in them, and filling text with huge strings, lone
surrogates, NULs and control characters. Telegram updates go through the fake Bot API's
getUpdates to the polling channel; Slack events are POSTed, correctly signed, to the
gateway's /slack/events (HTTP mode), raw bodies included (invalid UTF-8, not JSON).
Afterwards: no ERROR log line from our packages (or an unhandled exception reported by
aiohttp or asyncio), the gateway still answers on both channels, and every stored
session is well formed.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import sqlite3
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.app import Gateway
from tests.conftest import GatewayFactory
from tests.fakes import slack_server, telegram_server
from tests.fakes.openai_server import FakeModel
from tests.fakes.slack_server import BOT_TOKEN, SIGNING_SECRET, FakeSlack, signed_request
from tests.fakes.telegram_server import FakeTelegram
from tests.test_reliability_faults import session_problems

fake_telegram = telegram_server.fake_telegram  # fixtures
fake_slack = slack_server.fake_slack

EXAMPLES = int(os.environ.get("RELIABILITY_EXAMPLES", "40"))  # more for a longer hunt (make soak)
WATCHED = ("gateway", "channels", "context", "aiohttp.server", "aiohttp.web", "asyncio")
HYPOTHESIS = settings(max_examples=EXAMPLES, deadline=None,
                      suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

# ---------------------------------------------------------------------------- strategies

ODD_PIECES = ["\ud800", "\udfff", "\udc00x", "\x00", "\x1b[31m", "\u202e", "\ufeff", "🙂", "👩‍👩‍👧",
              "\r\n", "@gateway_test_bot", "/start", "/context", "<@UBOT>", "*bold", "`", "[link](x)", "é"]
TEXTS = st.one_of(
    st.text(max_size=200),
    st.lists(st.sampled_from(ODD_PIECES), max_size=40).map("".join),
    st.integers(4_000, 120_000).map(lambda n: ("long line " * (n // 10 + 1))[:n]),
)
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
                    st.floats(allow_nan=False, allow_infinity=False), TEXTS)
JUNK = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=12), inner, max_size=4), max_leaves=10)
DROP = object()


def _apply(target: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    """Set (or, with DROP, delete) a nested key, when the parents are still dicts."""
    for key in path[:-1]:
        nxt = target.get(key)
        if not isinstance(nxt, dict):
            return
        target = nxt
    if value is DROP:
        target.pop(path[-1], None)
    else:
        target[path[-1]] = value


TELEGRAM_PATHS = [("message_id",), ("date",), ("chat",), ("chat", "id"), ("chat", "type"), ("from",),
                  ("from", "id"), ("from", "is_bot"), ("from", "first_name"), ("text",), ("entities",),
                  ("reply_to_message",), ("message_thread_id",), ("is_topic_message",), ("caption",),
                  ("photo",), ("document",), ("caption_entities",), ("sticker",), ("new_chat_members",)]


@st.composite
def telegram_updates(draw: st.DrawFn) -> dict[str, Any]:
    user = draw(st.integers(1, 40))
    chat_type = draw(st.sampled_from(["private", "private", "group", "supergroup", "channel"]))
    chat_id = user if chat_type == "private" else -1000 - user % 3
    message: dict[str, Any] = {
        "message_id": draw(st.integers(1, 10**6)), "date": 1_700_000_000,
        "chat": {"id": chat_id, "type": chat_type, "first_name": "P", "title": "G"},
        "from": {"id": user, "is_bot": False, "first_name": draw(TEXTS)},
        "text": draw(TEXTS),
    }
    for path in draw(st.lists(st.sampled_from(TELEGRAM_PATHS), max_size=4, unique=True)):
        _apply(message, path, draw(st.one_of(st.just(DROP), JUNK)))
    if draw(st.booleans()):
        message["entities"] = draw(st.lists(st.fixed_dictionaries(
            {"type": st.sampled_from(["mention", "bot_command", "text_mention", "bold", "x"]),
             "offset": st.integers(-5, 300), "length": st.integers(-5, 300)},
            optional={"user": JUNK}), max_size=3))
    kind = draw(st.sampled_from(["message", "message", "message", "edited_message", "callback_query", "junk"]))
    if kind == "junk":
        return {"message": draw(JUNK)}
    return {kind: message}


SLACK_PATHS = [("type",), ("channel",), ("user",), ("text",), ("ts",), ("thread_ts",), ("subtype",),
               ("bot_id",), ("files",), ("channel_type",), ("user_profile",), ("parent_user_id",),
               ("blocks",), ("edited",)]
_ts = itertools.count(1)


@st.composite
def slack_events(draw: st.DrawFn) -> dict[str, Any]:
    user = draw(st.integers(1, 40))
    dm = draw(st.booleans())
    event: dict[str, Any] = {
        "type": draw(st.sampled_from(["message", "message", "app_mention", "reaction_added"])),
        "channel": f"D{user:05d}" if dm else "C00000001", "channel_type": "im" if dm else "channel",
        "user": f"U{user:05d}", "text": draw(TEXTS), "ts": f"{1_700_000_000 + next(_ts)}.000100",
    }
    for path in draw(st.lists(st.sampled_from(SLACK_PATHS), max_size=4, unique=True)):
        _apply(event, path, draw(st.one_of(st.just(DROP), JUNK)))
    return event


RAW_BODIES = st.one_of(
    st.binary(max_size=300),  # invalid UTF-8 and any bytes
    st.just(b"\xff\xfe{\"type\": \"event_callback\"}"),
    st.just(b"[1, 2, 3]"),
    JUNK.map(lambda v: json.dumps(v).encode()),
    st.builds(lambda e: json.dumps({"type": "event_callback", "event": e, "event_id": 7}).encode(), JUNK),
    st.builds(lambda c: json.dumps({"type": "url_verification", "challenge": c}).encode(), JUNK),
)

# ---------------------------------------------------------------------------- harness


class ErrorLog(logging.Handler):
    """ERROR records from our packages, and unhandled exceptions aiohttp or asyncio report."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.startswith(WATCHED):
            self.records.append(record)

    def lines(self) -> list[str]:
        return [f"{r.name}: {r.getMessage()} {r.exc_info[1]!r}" if r.exc_info else f"{r.name}: {r.getMessage()}"
                for r in self.records]


@pytest.fixture
def error_log() -> Iterator[ErrorLog]:
    handler = ErrorLog()
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield handler
    finally:
        root.removeHandler(handler)


async def assert_sessions_intact(gw: Gateway) -> None:
    assert gw.services is not None
    store = gw.services.store
    await gw.services.background.wait_idle(15)
    async with store.connection.execute("SELECT key FROM sessions") as cur:
        keys = [row[0] for row in await cur.fetchall()]
    for key in keys:
        assert session_problems(await store.messages(key)) == [], key
    async with store.connection.execute("PRAGMA integrity_check") as cur:
        assert [tuple(r) for r in await cur.fetchall()] == [("ok",)]


async def assert_serving(gw: Gateway) -> None:
    assert gw.http is not None
    async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{gw.http.port}/healthz") as resp:
        assert resp.status == 200


def channels_section(telegram: FakeTelegram, slack: FakeSlack) -> dict[str, Any]:
    return {
        "telegram": {"enabled": True, "token": telegram.token, "base_url": telegram.base_url,
                     "base_file_url": telegram.base_file_url, "poll_timeout_s": 1},
        "slack": {"enabled": True, "mode": "http", "bot_token": BOT_TOKEN, "signing_secret": SIGNING_SECRET,
                  "base_url": slack.base_url},
    }


@pytest.fixture
async def gateway(make_gateway: GatewayFactory, fake_telegram: FakeTelegram,
                  fake_slack: FakeSlack) -> AsyncIterator[Gateway]:
    """A gateway with both adapters running; after the test (all its examples), it must
    still serve and every session it stored must be intact."""
    gw = await make_gateway(access={"dm_policy": "open", "allow_from": ["*"], "group_trigger": "all"},
                            channels=channels_section(fake_telegram, fake_slack))
    yield gw
    await assert_serving(gw)
    await assert_sessions_intact(gw)


async def post_slack(gw: Gateway, body: bytes, content_type: str = "application/json") -> int:
    assert gw.http is not None
    raw, headers = signed_request(SIGNING_SECRET, body, content_type)
    async with aiohttp.ClientSession() as http, http.post(
        f"http://127.0.0.1:{gw.http.port}/slack/events", data=raw, headers=headers
    ) as resp:
        await resp.read()
        return resp.status


def event_body(event: Any) -> bytes:
    body = {"token": "t", "team_id": "T1", "api_app_id": "A1", "type": "event_callback", "event": event,
            "event_id": f"Ev{next(_ts):010d}", "event_time": int(time.time())}
    return json.dumps(body).encode()  # ensure_ascii: lone surrogates travel as \\ud800, as in real JSON


# ---------------------------------------------------------------------------- tests


@HYPOTHESIS
@given(update=telegram_updates())
async def test_junk_telegram_updates_never_escape(gateway: Gateway, fake_telegram: FakeTelegram,
                                                  error_log: ErrorLog, update: dict[str, Any]) -> None:
    update_id = fake_telegram.push_update(update)
    await fake_telegram.wait_confirmed(update_id + 1, timeout=10)  # consumed (or skipped) by the channel
    assert error_log.lines() == []


@HYPOTHESIS
@given(event=slack_events())
async def test_junk_slack_events_never_escape(gateway: Gateway, error_log: ErrorLog, event: dict[str, Any]) -> None:
    status = await post_slack(gateway, event_body(event))
    assert status < 500, status  # a 5xx makes Slack redeliver the junk again and again
    assert error_log.lines() == []


@HYPOTHESIS
@given(body=RAW_BODIES, form=st.booleans())
async def test_junk_slack_bodies_never_escape(gateway: Gateway, error_log: ErrorLog, body: bytes, form: bool) -> None:
    status = await post_slack(gateway, body, "application/x-www-form-urlencoded" if form else "application/json")
    assert status < 500, status
    assert error_log.lines() == []


@pytest.mark.parametrize("event", [
    {"type": {"not": "a string"}, "channel": "D00001", "user": "U00001", "text": "hi", "ts": "1800000000.000100"},
    None,
    "a string where the event object belongs",
], ids=["type is an object", "event is null", "event is a string"])
async def test_malformed_slack_event_envelope_is_dropped(gateway: Gateway, error_log: ErrorLog, event: Any) -> None:
    assert await post_slack(gateway, event_body(event)) == 200
    assert error_log.lines() == []


@pytest.mark.parametrize("body", [{"event": None}, {"token": "t", "event": "a string"}, {"type": "x", "event": [1]}],
                         ids=["event null, no type", "event a string", "other type, event a list"])
async def test_slack_body_with_a_non_object_event_is_dropped(gateway: Gateway, error_log: ErrorLog,
                                                             body: dict[str, Any]) -> None:
    assert await post_slack(gateway, json.dumps(body).encode()) == 200
    assert error_log.lines() == []


async def test_after_junk_both_channels_still_answer(gateway: Gateway, fake_telegram: FakeTelegram,
                                                     fake_slack: FakeSlack, fake_model: FakeModel,
                                                     error_log: ErrorLog) -> None:
    junk = [{"message": {"chat": "nope"}}, {"message": {"text": "\ud800", "chat": {"id": 5, "type": "private"},
                                                        "from": {"id": 5, "is_bot": False}, "message_id": 1,
                                                        "date": 0}}]
    for update in junk:
        fake_telegram.push_update(update)
    assert await post_slack(gateway, b"\xff\xfe not json") < 500
    fake_telegram.push_message(chat_id=77, user_id=77, text="still there?")
    sent = await fake_telegram.wait_sent(1)
    assert any(m["chat_id"] == 77 and m["text"] == "echo: still there?" for m in sent), sent
    event = {"type": "message", "channel": "D00077", "channel_type": "im", "user": "U00077",
             "text": "and on slack?", "ts": f"{1_800_000_000 + next(_ts)}.000100"}
    assert await post_slack(gateway, event_body(event)) == 200
    posted = await fake_slack.wait_posted(1)
    assert posted[-1]["text"] == "echo: and on slack?"
    await assert_serving(gateway)
    await assert_sessions_intact(gateway)
    assert error_log.lines() == []


async def test_odd_text_is_answered_and_stored_as_valid_text(gateway: Gateway, fake_telegram: FakeTelegram,
                                                             error_log: ErrorLog) -> None:
    for n, text in enumerate(["hi", "\ud800 lone", "\x00nul", "x" * 120_000, "🙂" * 3000]):
        fake_telegram.push_message(chat_id=300 + n, user_id=300 + n, text=text)
    chats = {300, 301, 302, 303, 304}
    for count in range(5, 10):  # a long reply may come in several chunks
        sent = await fake_telegram.wait_sent(count, timeout=10)
        if {m["chat_id"] for m in sent} >= chats:
            break
    assert {m["chat_id"] for m in sent} == chats
    await assert_sessions_intact(gateway)
    assert gateway.services is not None
    db = sqlite3.connect(gateway.services.store.path)
    try:
        for (content,) in db.execute("SELECT content FROM messages"):
            content.encode("utf-8")  # stored text is valid UTF-8
    finally:
        db.close()
    assert error_log.lines() == []
