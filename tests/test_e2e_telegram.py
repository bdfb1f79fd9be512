"""The whole gateway with the real python-telegram-bot against the fake Bot API:
pairing, group triggers, exactly-once replies across redelivery and restarts."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import aiohttp

from gateway.access import PAIRING_TTL_S
from gateway.app import Gateway
from gateway.keys import workspace_dir
from gateway.store.sqlite import Store
from tests.conftest import GatewayFactory
from tests.fakes import telegram_server
from tests.fakes.openai_server import FakeModel
from tests.fakes.telegram_server import FakeTelegram

fake_telegram = telegram_server.fake_telegram  # the fixture

ADMIN = 1
SECRET = "hook-secret-0123456789"  # Telegram charset, 16+ characters


def telegram_section(fake: FakeTelegram, **extra: Any) -> dict[str, Any]:
    return {"telegram": {"enabled": True, "token": fake.token, "base_url": fake.base_url,
                         "base_file_url": fake.base_file_url, "poll_timeout_s": 1, **extra}}


async def test_pairing_then_served(make_gateway: GatewayFactory, fake_model: FakeModel,
                                   fake_telegram: FakeTelegram) -> None:
    await make_gateway(admins=[f"telegram:{ADMIN}"], channels=telegram_section(fake_telegram))
    fake_telegram.push_message(chat_id=7, user_id=7, text="hello?")
    (refusal,) = await fake_telegram.wait_sent(1)
    code = re.search(r"pairing code is ([A-Z0-9]{8})", refusal["text"])
    assert code and refusal["chat_id"] == 7
    assert fake_model.requests == []  # refused users never reach the model

    fake_telegram.push_message(chat_id=ADMIN, user_id=ADMIN, text="/approve WRONG000")
    fake_telegram.push_message(chat_id=ADMIN, user_id=ADMIN, text=f"/approve {code.group(1)}")
    sent = await fake_telegram.wait_sent(4)  # the admin's answers, and the approved person told
    assert "unknown or expired" in sent[1]["text"]
    assert {m["chat_id"]: m["text"][:19] for m in sent[2:]} == {1: "Approved telegram:7", 7: "You're approved: yo"}

    fake_model.reply("Welcome aboard!")
    fake_telegram.push_message(chat_id=7, user_id=7, text="hello again")
    sent = await fake_telegram.wait_sent(5)
    assert sent[4]["chat_id"] == 7 and "Welcome aboard" in sent[4]["text"]
    assert fake_model.requests[-1]["messages"][-1]["content"] == "hello again"


async def test_group_trigger_and_per_user_sessions(make_gateway: GatewayFactory, fake_model: FakeModel,
                                                   fake_telegram: FakeTelegram) -> None:
    gw = await make_gateway(access={"allow_from": ["*"]}, channels=telegram_section(fake_telegram))
    bot = f"@{fake_telegram.bot_username}"
    mention = [{"type": "mention", "offset": 0, "length": len(bot)}]
    fake_telegram.push_message(chat_id=-100, user_id=5, text="just chatting", chat_type="supergroup")
    fake_model.reply("hi five")
    fake_telegram.push_message(chat_id=-100, user_id=5, text=f"{bot} hello", chat_type="supergroup",
                               entities=mention)
    fake_model.reply("hi six")
    fake_telegram.push_message(chat_id=-100, user_id=6, text=f"{bot} hello", chat_type="supergroup",
                               entities=mention)
    sent = await fake_telegram.wait_sent(2)
    assert sorted(s["text"] for s in sent) == ["hi five", "hi six"]
    assert len(fake_model.requests) == 2  # the unaddressed message never reached the model
    assert fake_model.requests[0]["messages"][-1]["content"] == "hello"  # mention stripped
    assert gw.services is not None
    assert await gw.services.store.count_messages("telegram:group:-100:user:5") == 2
    assert await gw.services.store.count_messages("telegram:group:-100:user:6") == 2


async def _post_webhook(gw: Gateway, update: dict[str, Any], secret: str) -> int:
    assert gw.http is not None
    async with aiohttp.ClientSession() as http:
        async with http.post(f"http://127.0.0.1:{gw.http.port}/telegram/webhook", data=json.dumps(update),
                             headers={"X-Telegram-Bot-Api-Secret-Token": secret,
                                      "Content-Type": "application/json"}) as resp:
            return resp.status


def _update(update_id: int, text: str, user: int = 9) -> dict[str, Any]:
    return {"update_id": update_id, "message": {
        "message_id": update_id, "date": 1_700_000_000, "text": text,
        "chat": {"id": user, "type": "private", "first_name": "P"},
        "from": {"id": user, "is_bot": False, "first_name": "P"}}}


async def test_webhook_redelivery_gives_one_reply(make_gateway: GatewayFactory, fake_model: FakeModel,
                                                  fake_telegram: FakeTelegram) -> None:
    gw = await make_gateway(access={"dm_policy": "open"}, channels=telegram_section(
        fake_telegram, mode="webhook", webhook_url="https://bot.example/telegram/webhook", webhook_secret=SECRET))
    fake_model.reply("only once")
    assert await _post_webhook(gw, _update(500, "hi"), "wrong-secret") == 403
    assert await _post_webhook(gw, _update(500, "hi"), SECRET) == 200
    assert await _post_webhook(gw, _update(500, "hi"), SECRET) == 200  # Telegram retried
    await fake_telegram.wait_sent(1)
    assert gw.services is not None
    await gw.services.background.wait_idle(5)
    assert [s["text"] for s in fake_telegram.sent] == ["only once"]
    assert len(fake_model.requests) == 1
    assert 'gateway_dedup_hits_total{channel="telegram"} 1.0' in gw.services.metrics.render().decode()


async def test_restart_in_the_middle_of_a_turn_answers_exactly_once(
    make_gateway: GatewayFactory, fake_model: FakeModel, fake_telegram: FakeTelegram
) -> None:
    section = telegram_section(fake_telegram)
    gw = await make_gateway(access={"dm_policy": "open"}, channels=section)
    fake_model.hang(30)  # the model never answers before the "crash"
    fake_telegram.push_message(chat_id=8, user_id=8, text="long question")
    await fake_model.wait_requests(1)
    assert gw.services is not None
    assert await gw.services.store.count_messages("telegram:dm:8") == 1  # stored before the model call
    await gw.stop(timeout=0)  # no grace: the turn is cut mid-call

    fake_model.reply("the answer, after a restart")
    gw2 = await make_gateway(access={"dm_policy": "open"}, channels=section)
    (reply,) = await fake_telegram.wait_sent(1)
    assert reply["text"] == "the answer, after a restart" and reply["chat_id"] == 8
    assert gw2.services is not None
    await gw2.services.background.wait_idle(5)
    assert len(fake_telegram.sent) == 1
    rows = await gw2.services.store.messages("telegram:dm:8")
    assert [m.role for m in rows] == ["user", "assistant"]
    assert rows[0].content == "long question"


async def test_a_resumed_turn_keeps_its_place_before_newer_messages(
    make_gateway: GatewayFactory, fake_model: FakeModel, fake_telegram: FakeTelegram, tmp_path
) -> None:
    """A turn cut by a crash is answered first, with its own reply, even when the person's
    next message is already waiting when the gateway comes back."""
    from gateway.store.sqlite import Store
    from gateway.types import Inbound, Message, inbound_to_dict

    store = await Store.open(tmp_path / "data" / "gateway.sqlite3")
    key = "telegram:dm:12"
    await store.ensure_session(key, "telegram:user:12", "telegram")
    first = Inbound(channel="telegram", chat_id="12", user_id="12", text="first question", event_id="900")
    await store.record_event("telegram", "900", session_key=key, inbound=inbound_to_dict(first))
    await store.add_message(key, Message(role="user", content="first question", turn=1), seq=0)
    await store.mark_event("telegram", "900", "running", turn=1)
    await store.close()
    fake_telegram.push_message(chat_id=12, user_id=12, text="second question")  # waiting at restart

    await make_gateway(access={"dm_policy": "open"}, channels=telegram_section(fake_telegram))
    sent = await fake_telegram.wait_sent(2)
    assert [m["text"] for m in sent] == ["echo: first question", "echo: second question"]


async def test_a_strangers_file_is_never_downloaded(make_gateway: GatewayFactory, fake_model: FakeModel,
                                                    fake_telegram: FakeTelegram) -> None:
    gw = await make_gateway(admins=[f"telegram:{ADMIN}"], channels=telegram_section(fake_telegram))
    fake_telegram.add_file("strangers", b"20 MB of something", "documents/file_9.bin")
    fake_telegram.add_file("admins", b"%PDF-1.4 notes", "documents/file_10.pdf")
    fake_telegram.push_message(chat_id=77, user_id=77, caption="take this", document={
        "file_id": "strangers", "file_unique_id": "s9", "file_name": "payload.bin", "file_size": 18})
    (refusal,) = await fake_telegram.wait_sent(1)
    assert "pairing code" in refusal["text"] and refusal["chat_id"] == 77

    fake_telegram.push_message(chat_id=ADMIN, user_id=ADMIN, caption="my notes", document={
        "file_id": "admins", "file_unique_id": "a10", "file_name": "notes.pdf", "file_size": 14})
    await fake_telegram.wait_sent(2)

    fetched = [call["file_id"] for call in fake_telegram.calls_of("getFile")]
    assert fetched == ["admins"]  # the admin's file was fetched, the stranger's never
    assert gw.services is not None
    assert not list(Path(gw.services.cfg.data_dir).glob("**/payload.bin"))
    assert "notes.pdf" in fake_model.requests[-1]["messages"][-1]["content"]


A_SECRET = "Alice's locker code is 4312"
B_FACT = "Bob prefers tea"


async def test_a_topic_never_uses_one_persons_memory(make_gateway: GatewayFactory, fake_model: FakeModel,
                                                     fake_telegram: FakeTelegram, tmp_path: Path) -> None:
    """Alice (5) keeps a secret in her own group session, then opens a topic; Bob (6) writes
    in it. Bob's turns never see Alice's MEMORY.md (prompt or read_file) and his
    memory_write lands in the group's scope, not hers (SPEC §1, shared session)."""
    topic_key = "telegram:group:-100:topic:9"
    # A session row left by an older version, stored with Alice's scope: it must not stick.
    store = await Store.open(tmp_path / "data" / "gateway.sqlite3")
    await store.ensure_session(topic_key, "telegram:group:-100:user:5", "telegram")
    await store.close()

    gw = await make_gateway(access={"allow_from": ["*"]}, channels=telegram_section(fake_telegram))
    assert gw.services is not None
    bot = f"@{fake_telegram.bot_username}"
    mention = [{"type": "mention", "offset": 0, "length": len(bot)}]

    def say(user: int, text: str, topic: int | None = None) -> None:
        fake_telegram.push_message(chat_id=-100, user_id=user, text=f"{bot} {text}", chat_type="supergroup",
                                   entities=mention, thread_id=topic)

    fake_model.tool_call("memory_write", {"text": A_SECRET, "target": "memory"})
    fake_model.reply("noted")
    # Replies stream (a status first, then the answer): wait for each turn's final text.
    say(5, "remember my locker code")
    await fake_telegram.wait_shown(-100, lambda t: "noted" in t)
    fake_model.reply("hi Alice")
    say(5, "hello topic", topic=9)
    await fake_telegram.wait_shown(-100, lambda t: "hi Alice" in t)
    mark = len(fake_model.requests)
    fake_model.tool_call("read_file", {"path": "MEMORY.md"})
    fake_model.tool_call("memory_write", {"text": B_FACT, "target": "memory"})
    fake_model.reply("done")
    say(6, "what do you know about us?", topic=9)
    await fake_telegram.wait_shown(-100, lambda t: "done" in t)

    bobs = fake_model.requests[mark:]
    assert len(bobs) == 3
    # Requests 0-1 are Alice's own session; from 2 on the topic's (hers, then Bob's).
    assert "4312" in json.dumps(fake_model.requests[1])
    for request in fake_model.requests[2:]:
        assert "4312" not in json.dumps(request), "Alice's memory reached a shared session"
    read_result = [m for m in bobs[1]["messages"] if m["role"] == "tool"][-1]["content"]
    assert "4312" not in read_result

    data_dir = gw.services.data_dir
    alices = (workspace_dir(data_dir, "telegram:group:-100:user:5") / "MEMORY.md").read_text()
    groups = (workspace_dir(data_dir, "telegram:group:-100") / "MEMORY.md").read_text()
    assert A_SECRET in alices and B_FACT not in alices
    assert B_FACT in groups and A_SECRET not in groups
    row = await gw.services.store.get_session(topic_key)
    assert row is not None and row.scope == "telegram:group:-100"


async def test_a_stranger_gets_one_pairing_reply_per_hour(make_gateway: GatewayFactory, fake_model: FakeModel,
                                                          fake_telegram: FakeTelegram) -> None:
    gw = await make_gateway(channels=telegram_section(fake_telegram))
    assert gw.services is not None and gw.pairing is not None
    now = [time.time()]
    gw.pairing.clock = lambda: now[0]
    store = gw.services.store

    for i in range(30):
        last = fake_telegram.push_message(chat_id=77, user_id=77, text=f"hello? {i}")
    await fake_telegram.wait_confirmed(last + 1)  # polling confirms an update once it was handled
    await gw.services.background.wait_idle(5)
    (first,) = fake_telegram.sent
    code = re.search(r"pairing code is ([A-Z0-9]{8})", first["text"])
    assert code and first["chat_id"] == 77
    codes = await store.run("SELECT count(*) FROM pairing_codes WHERE identity='telegram:77'")
    assert codes[0][0] == 1

    now[0] += PAIRING_TTL_S + 1  # the code expired: the next message gets a new one, once
    fake_telegram.push_message(chat_id=77, user_id=77, text="still there?")
    last = fake_telegram.push_message(chat_id=77, user_id=77, text="hello??")
    await fake_telegram.wait_confirmed(last + 1)
    sent = await fake_telegram.wait_sent(2)
    await gw.services.background.wait_idle(5)
    assert len(fake_telegram.sent) == 2
    second = re.search(r"pairing code is ([A-Z0-9]{8})", sent[1]["text"])
    assert second and second.group(1) != code.group(1)
    codes = await store.run("SELECT count(*) FROM pairing_codes WHERE identity='telegram:77'")
    assert codes[0][0] == 2
    assert fake_model.requests == []


async def test_a_refused_stranger_is_told_once_per_hour(make_gateway: GatewayFactory, fake_model: FakeModel,
                                                        fake_telegram: FakeTelegram) -> None:
    gw = await make_gateway(access={"dm_policy": "allowlist"}, channels=telegram_section(fake_telegram))
    assert gw.services is not None and gw.pairing is not None
    now = [time.time()]
    gw.pairing.clock = lambda: now[0]

    for i in range(10):
        last = fake_telegram.push_message(chat_id=78, user_id=78, text=f"let me in {i}")
    await fake_telegram.wait_confirmed(last + 1)
    await gw.services.background.wait_idle(5)
    assert [s["text"] for s in fake_telegram.sent] == ["Sorry, this bot is private. Ask its admin to add you."]
    now[0] += 3601
    fake_telegram.push_message(chat_id=78, user_id=78, text="and now?")
    await fake_telegram.wait_sent(2)
    assert fake_model.requests == []
