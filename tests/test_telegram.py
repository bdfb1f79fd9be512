"""The Telegram channel against a fake Bot API server, with the real python-telegram-bot."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from telegram import Bot, Message
from telegram.error import InvalidToken
from telegramify_markdown import convert

from channels.base import Channel, WebhookChannel
from channels.telegram.adapter import TelegramChannel
from channels.telegram.format import (
    MAX_ENTITIES,
    TELEGRAM_TEXT_LIMIT,
    render_markdown,
    split_chunks,
    utf16_len,
)
from channels.telegram.updates import BotIdentity, parse_update
from gateway.config.schema import TelegramConfig
from gateway.keys import memory_scope, scope_dirname, session_key
from gateway.media import safe_file_name
from gateway.types import Inbound, inbound_from_dict, inbound_to_dict
from tests.fakes import telegram_server
from tests.fakes.media_files import make_image, make_ogg_opus
from tests.fakes.telegram_server import FakeTelegram

fake_telegram = telegram_server.fake_telegram  # the fixture

ME = BotIdentity(id=7_000_001, username="gateway_test_bot")
WEBHOOK_SECRET = "s3cret-token_value"


class Recorder:
    """The in-test router: records every Inbound, optionally answers or fails."""

    def __init__(self) -> None:
        self.inbounds: list[Inbound] = []
        self.answer: Callable[[Inbound], str] | None = None
        self.fail_times = 0
        self.channel: TelegramChannel | None = None
        self.probe: Callable[[], Any] | None = None  # sampled at every call
        self.probed: list[Any] = []
        self.gate: asyncio.Event | None = None  # when set, calls wait for it
        self.entered = asyncio.Event()
        self._changed = asyncio.Event()

    async def __call__(self, inbound: Inbound) -> None:
        if self.probe is not None:
            self.probed.append(self.probe())
        self.entered.set()
        if self.gate is not None:
            await self.gate.wait()
        if self.fail_times > 0:
            self.fail_times -= 1
            raise RuntimeError("router hiccup")
        self.inbounds.append(inbound)
        self._changed.set()
        if self.answer is not None and self.channel is not None:
            await self.channel.send(inbound, self.answer(inbound))

    async def wait(self, n: int, timeout: float = 5) -> list[Inbound]:
        async with asyncio.timeout(timeout):
            while len(self.inbounds) < n:
                self._changed.clear()
                await self._changed.wait()
        return list(self.inbounds)


class SleepLog:
    """Injected sleep: records the requested waits and returns at once (or, `real`, after
    the wait: the fake Bot API refuses a call made before its retry_after)."""

    def __init__(self, real: bool = False) -> None:
        self.waits: list[float] = []
        self.real = real

    async def __call__(self, seconds: float) -> None:
        self.waits.append(seconds)
        await asyncio.sleep(seconds if self.real else 0)


def workspace_for(root: Path) -> Callable[[Inbound], Path]:
    return lambda inbound: root / scope_dirname(memory_scope(inbound))


def config(fake: FakeTelegram, **overrides: Any) -> TelegramConfig:
    values: dict[str, Any] = {
        "enabled": True,
        "token": fake.token,
        "base_url": fake.base_url,
        "poll_timeout_s": 1,
    }
    values.update(overrides)
    return TelegramConfig(**values)


Starter = Callable[..., Awaitable[tuple[TelegramChannel, Recorder]]]


@pytest.fixture
async def start_channel(
    fake_telegram: FakeTelegram, tmp_path: Path
) -> AsyncIterator[Starter]:
    started: list[TelegramChannel] = []

    async def start(
        *, commands: tuple[tuple[str, str], ...] = (), sleep: SleepLog | None = None, **cfg: Any
    ) -> tuple[TelegramChannel, Recorder]:
        recorder = Recorder()
        channel = TelegramChannel(
            config(fake_telegram, **cfg),
            recorder,
            workspace_for=workspace_for(tmp_path / "scopes"),
            commands=commands,
            sleep=sleep or SleepLog(),
        )
        recorder.channel = channel
        await channel.start()
        started.append(channel)
        return channel, recorder

    yield start
    for channel in started:
        await channel.stop()


def dm_inbound(chat_id: int = 42, message_id: int = 1) -> Inbound:
    return Inbound(channel="telegram", chat_id=str(chat_id), user_id=str(chat_id), text="hi",
                   event_id="1", message_id=str(message_id))


# ---------------------------------------------------------------------------- round trips


async def test_dm_round_trip(fake_telegram: FakeTelegram, start_channel: Starter) -> None:
    channel, recorder = await start_channel()
    assert isinstance(channel, Channel) and isinstance(channel, WebhookChannel)
    assert fake_telegram.calls_of("deleteWebhook"), "polling mode removes any webhook"
    recorder.answer = lambda inbound: f"**Hello**, {inbound.user_name}!"

    update_id = fake_telegram.push_message(chat_id=42, user_id=42, text="hello there")
    [inbound] = await recorder.wait(1)
    [sent] = await fake_telegram.wait_sent(1)

    assert inbound.channel == "telegram"
    assert (inbound.chat_id, inbound.user_id, inbound.text) == ("42", "42", "hello there")
    assert inbound.event_id == str(update_id)
    assert inbound.message_id is not None and inbound.message_id.isdigit()
    assert not inbound.is_group and inbound.thread_id is None
    assert inbound.user_name == "User42"
    assert session_key(inbound) == "telegram:dm:42"
    assert inbound_from_dict(json.loads(json.dumps(inbound_to_dict(inbound)))) == inbound

    assert sent["chat_id"] == 42
    assert sent["text"] == "Hello, User42!"
    assert sent["entities"] == [{"type": "bold", "offset": 0, "length": 5}]
    assert "reply_parameters" not in sent, "DMs are answered without quoting"

    await fake_telegram.wait_confirmed(update_id + 1)
    assert channel.is_ready()
    await channel.stop()
    assert not channel.is_ready()


async def test_update_is_confirmed_only_after_the_router_returns(
    fake_telegram: FakeTelegram, start_channel: Starter
) -> None:
    _, recorder = await start_channel()
    recorder.fail_times = 1  # the router fails once: the update must come back
    recorder.probe = lambda: fake_telegram.confirmed_offset
    update_id = fake_telegram.push_message(chat_id=5, user_id=5, text="once")
    [inbound] = await recorder.wait(1)
    assert inbound.event_id == str(update_id)
    assert len(recorder.probed) == 2 and all(offset <= update_id for offset in recorder.probed)
    await fake_telegram.wait_confirmed(update_id + 1)
    assert len(recorder.inbounds) == 1


async def test_stop_lets_the_update_in_hand_finish_and_confirms_it(
    fake_telegram: FakeTelegram, start_channel: Starter
) -> None:
    channel, recorder = await start_channel()
    recorder.gate = asyncio.Event()
    update_id = fake_telegram.push_message(chat_id=5, user_id=5, text="in flight")
    await asyncio.wait_for(recorder.entered.wait(), 5)
    stopping = asyncio.create_task(channel.stop())
    await asyncio.sleep(0)
    assert not stopping.done()
    recorder.gate.set()
    await asyncio.wait_for(stopping, 5)
    assert [i.event_id for i in recorder.inbounds] == [str(update_id)]
    assert fake_telegram.confirmed_offset == update_id + 1
    assert not channel.is_ready()


async def test_polling_survives_server_errors(fake_telegram: FakeTelegram, start_channel: Starter) -> None:
    channel, recorder = await start_channel()
    fake_telegram.fail_next("getUpdates", 502, "Bad Gateway")
    await fake_telegram.wait_call("getUpdates")
    fake_telegram.push_message(chat_id=5, user_id=5, text="still here")
    [inbound] = await recorder.wait(1)
    assert inbound.text == "still here" and channel.is_ready()
    await channel.stop()
    await channel.stop()  # idempotent
    with pytest.raises(RuntimeError):
        await channel.send(inbound, "after stop")


async def test_group_messages_set_mention_flags_and_strip_the_mention(
    fake_telegram: FakeTelegram, start_channel: Starter
) -> None:
    channel, recorder = await start_channel()
    group = -100123
    fake_telegram.push_message(chat_id=group, user_id=7, chat_type="supergroup", text="just chatting")
    text = "hey @gateway_test_bot what's up"
    fake_telegram.push_message(
        chat_id=group, user_id=7, chat_type="supergroup", text=text,
        entities=[{"type": "mention", "offset": 4, "length": 17}],
    )
    fake_telegram.push_message(
        chat_id=group, user_id=8, chat_type="group", text="/context@gateway_test_bot clear",
        entities=[{"type": "bot_command", "offset": 0, "length": 25}],
    )
    fake_telegram.push_message(  # someone else's bot: not for us
        chat_id=group, user_id=8, chat_type="group", text="/help@other_bot",
        entities=[{"type": "bot_command", "offset": 0, "length": 15}],
    )
    fake_telegram.push_message(
        chat_id=group, user_id=9, chat_type="supergroup", text="🙂 @Gateway_Test_Bot",
        entities=[{"type": "mention", "offset": 3, "length": 17}],  # offsets in UTF-16 units
    )
    plain, mention, command, emoji = await recorder.wait(4)

    assert plain.is_group and not plain.mentioned and plain.text == "just chatting"
    assert session_key(plain) == f"telegram:group:{group}:user:7"
    assert mention.mentioned and mention.text == "hey what's up"
    assert command.mentioned and command.text == "/context clear"
    assert emoji.mentioned and emoji.text == "🙂"
    await asyncio.sleep(0)
    assert len(recorder.inbounds) == 4

    await channel.send(mention, "sure")
    [sent] = await fake_telegram.wait_sent(1)
    assert sent["chat_id"] == group
    assert sent["reply_parameters"] == {
        "message_id": int(mention.message_id or 0), "allow_sending_without_reply": True,
    }


async def test_reply_to_the_bot(fake_telegram: FakeTelegram, start_channel: Starter) -> None:
    _, recorder = await start_channel()
    fake_telegram.push_message(chat_id=-5, user_id=3, chat_type="group", text="and then?",
                               reply_to_bot=True)
    [inbound] = await recorder.wait(1)
    assert inbound.reply_to_bot and not inbound.mentioned


async def test_forum_topic_gets_its_own_session(
    fake_telegram: FakeTelegram, start_channel: Starter
) -> None:
    channel, recorder = await start_channel()
    fake_telegram.push_message(chat_id=-1005, user_id=3, chat_type="supergroup", text="in a topic",
                               thread_id=5)
    # A topic the bot created: the implicit "reply" to its creation message is not a reply.
    root = {"message_id": 9, "date": 0, "chat": {"id": -1005, "type": "supergroup", "is_forum": True},
            "from": fake_telegram.bot_user(), "message_thread_id": 9, "is_topic_message": True,
            "forum_topic_created": {"name": "Bot topic", "icon_color": 7322096}}
    fake_telegram.push_message(chat_id=-1005, user_id=3, chat_type="supergroup", text="hi",
                               thread_id=9, reply_to_message=root)
    first, second = await recorder.wait(2)

    assert first.thread_id == "5"
    assert session_key(first) == "telegram:group:-1005:topic:5"
    assert session_key(first, "group") == "telegram:group:-1005:topic:5"
    assert second.thread_id == "9" and not second.reply_to_bot

    async with channel.typing(first):
        action = await fake_telegram.wait_call("sendChatAction")
    assert action == {"chat_id": -1005, "action": "typing", "message_thread_id": 5}
    if channel._typing_tasks:  # told to stop, it ends on its own right away (never cancelled mid-request)
        await asyncio.wait(set(channel._typing_tasks), timeout=1)
    assert not channel._typing_tasks

    await channel.send(first, "topic answer")
    [sent] = await fake_telegram.wait_sent(1)
    assert sent["message_thread_id"] == 5


# ---------------------------------------------------------------------------- sending


def long_reply() -> tuple[str, list[str]]:
    """About 10,000 characters: prose, a short code block, and one longer than a message."""
    prose = " ".join(f"Word{i} **bold{i}** and _it{i}_ 🚀." for i in range(120))
    short_code = "\n".join(f"x_{i} = {i}  # short" for i in range(40))
    long_code = "\n".join(f"    value_{i} = compute({i}, 'ü')  # 🧪 line {i}" for i in range(150))
    md = (f"# Report\n\n{prose}\n\n```python\n{short_code}\n```\n\n{prose[:2000]}\n\n"
          f"```python\n{long_code}\n```\n\nThe end.")
    return md, [short_code, long_code]


async def test_long_reply_arrives_in_chunks_with_code_blocks_intact(
    fake_telegram: FakeTelegram, start_channel: Starter
) -> None:
    channel, _ = await start_channel()
    md, code_blocks = long_reply()
    assert len(md) >= 10_000
    await channel.send(dm_inbound(), md)
    expected = render_markdown(md)
    sent = await fake_telegram.wait_sent(len(expected))
    assert len(sent) >= 3

    for message in sent:
        assert utf16_len(message["text"]) <= TELEGRAM_TEXT_LIMIT
        for ent in message.get("entities", []):
            assert ent["offset"] + ent["length"] <= utf16_len(message["text"])

    full_text, _ = convert(md)
    joined = "".join(m["text"] for m in sent)
    assert re.sub(r"\s", "", joined) == re.sub(r"\s", "", full_text), "no text lost or reordered"

    code_text = ""
    for message in sent:
        units = message["text"].encode("utf-16-le")
        for ent in message.get("entities", []):
            if ent["type"] == "pre":
                assert ent.get("language") == "python"
                piece = units[2 * ent["offset"]: 2 * (ent["offset"] + ent["length"])].decode("utf-16-le")
                code_text += piece + "\n"
    got_lines = [line for line in code_text.splitlines() if line.strip()]
    want_lines = [line for block in code_blocks for line in block.splitlines()]
    assert [g.strip() for g in got_lines] == [w.strip() for w in want_lines]
    # The short block was never cut: it is one closed block in one message.
    assert any(
        ent["type"] == "pre" and ent["length"] == utf16_len(code_blocks[0])
        for m in sent for ent in m.get("entities", [])
    )


async def test_rejected_formatting_resends_the_same_chunk_as_plain_text(
    fake_telegram: FakeTelegram, start_channel: Starter
) -> None:
    channel, _ = await start_channel()
    fake_telegram.reject_formatting()
    await channel.send(dm_inbound(), "Some **bold** and a [link](https://example.org)")
    [sent] = await fake_telegram.wait_sent(1)
    attempts = fake_telegram.calls_of("sendMessage")
    assert len(attempts) == 2
    assert attempts[0]["entities"] and "entities" not in attempts[1]
    assert attempts[0]["text"] == attempts[1]["text"] == sent["text"] == "Some bold and a link"


async def test_malformed_markdown_is_still_delivered(
    fake_telegram: FakeTelegram, start_channel: Starter
) -> None:
    channel, _ = await start_channel()
    await channel.send(dm_inbound(), "**unclosed `code [link](http:// ```py\nx\ud800 = 1")
    [sent] = await fake_telegram.wait_sent(1)
    assert "unclosed" in sent["text"] and "\ufffd" in sent["text"]


async def test_flood_control_is_waited_out(fake_telegram: FakeTelegram, start_channel: Starter) -> None:
    sleep = SleepLog(real=True)
    channel, _ = await start_channel(sleep=sleep)
    fake_telegram.fail_next("sendMessage", 429, retry_after=0.3)
    await channel.send(dm_inbound(), "after the flood")
    [sent] = await fake_telegram.wait_sent(1)
    assert sent["text"] == "after the flood"
    assert sleep.waits == [0.3]
    assert len(fake_telegram.calls_of("sendMessage")) == 2


async def test_server_errors_are_retried_a_bounded_number_of_times(
    fake_telegram: FakeTelegram, start_channel: Starter
) -> None:
    sleep = SleepLog()
    channel, _ = await start_channel(sleep=sleep)
    fake_telegram.fail_next("sendMessage", 502)
    await channel.send(dm_inbound(), "eventually")
    await fake_telegram.wait_sent(1)
    for _ in range(10):
        fake_telegram.fail_next("sendMessage", 500)
    with pytest.raises(Exception, match="500"):
        await channel.send(dm_inbound(), "never")
    assert len(fake_telegram.calls_of("sendMessage")) == 2 + 5


async def test_empty_reply_sends_nothing(fake_telegram: FakeTelegram, start_channel: Starter) -> None:
    channel, _ = await start_channel()
    await channel.send(dm_inbound(), "  \n\n ")
    assert not fake_telegram.calls_of("sendMessage")


# ---------------------------------------------------------------------------- webhook


@pytest.fixture
async def webhook_client(start_channel: Starter) -> AsyncIterator[tuple[TestClient, Recorder]]:
    channel, recorder = await start_channel(
        mode="webhook", webhook_url="https://bot.example.org/telegram/webhook",
        webhook_secret=WEBHOOK_SECRET,
    )
    app = web.Application()
    app.router.add_post(channel.webhook_path, channel.handle_webhook)
    client = TestClient(TestServer(app, host="127.0.0.1", port=0))
    await client.start_server()
    try:
        yield client, recorder
    finally:
        await client.close()


def text_update(update_id: int, text: str, chat_id: int = 77) -> dict[str, Any]:
    return {"update_id": update_id, "message": {
        "message_id": update_id, "date": 0, "chat": {"id": chat_id, "type": "private"},
        "from": {"id": chat_id, "is_bot": False, "first_name": "Web"}, "text": text}}


async def test_webhook_checks_the_secret(
    fake_telegram: FakeTelegram, webhook_client: tuple[TestClient, Recorder]
) -> None:
    client, recorder = webhook_client
    assert fake_telegram.webhook is not None
    assert fake_telegram.webhook["url"] == "https://bot.example.org/telegram/webhook"
    assert fake_telegram.webhook["secret_token"] == WEBHOOK_SECRET
    channel = recorder.channel
    assert channel is not None and channel.is_ready()

    body = json.dumps(text_update(500, "via webhook"))
    for headers in ({}, {"X-Telegram-Bot-Api-Secret-Token": "wrong"}):
        resp = await client.post("/telegram/webhook", data=body, headers=headers)
        assert resp.status == 403
    assert recorder.inbounds == []

    good = {"X-Telegram-Bot-Api-Secret-Token": WEBHOOK_SECRET}
    resp = await client.post("/telegram/webhook", data="{not json", headers=good)
    assert resp.status == 400
    resp = await client.post("/telegram/webhook", data=body, headers=good)
    assert resp.status == 200
    [inbound] = recorder.inbounds
    assert inbound.text == "via webhook" and inbound.event_id == "500"


async def test_webhook_answers_500_when_the_router_fails(
    webhook_client: tuple[TestClient, Recorder],
) -> None:
    client, recorder = webhook_client
    recorder.fail_times = 1
    good = {"X-Telegram-Bot-Api-Secret-Token": WEBHOOK_SECRET}
    body = json.dumps(text_update(600, "retry me"))
    assert (await client.post("/telegram/webhook", data=body, headers=good)).status == 500
    assert (await client.post("/telegram/webhook", data=body, headers=good)).status == 200
    assert [i.event_id for i in recorder.inbounds] == ["600"]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(junk=json_values, message_junk=st.dictionaries(
    st.sampled_from(["text", "chat", "from", "entities", "photo", "document", "caption",
                     "message_id", "reply_to_message", "message_thread_id", "is_topic_message"]),
    json_values, max_size=5))
async def test_webhook_junk_never_breaks_the_channel(
    webhook_client: tuple[TestClient, Recorder], junk: Any, message_junk: dict[str, Any]
) -> None:
    client, recorder = webhook_client
    good = {"X-Telegram-Bot-Api-Secret-Token": WEBHOOK_SECRET}
    near_valid = text_update(900, "x")
    near_valid["message"].update(message_junk)
    for body in (junk, {"update_id": 901, "message": junk}, near_valid):
        resp = await client.post("/telegram/webhook", data=json.dumps(body), headers=good)
        assert resp.status in (200, 400)
    for inbound in recorder.inbounds:
        assert isinstance(inbound.text, str) and isinstance(inbound.chat_id, str)
        assert isinstance(inbound.user_id, str) and inbound.event_id.isdigit()


# ---------------------------------------------------------------------------- files


async def test_photo_and_document_are_saved_in_the_workspace(
    fake_telegram: FakeTelegram, start_channel: Starter, tmp_path: Path
) -> None:
    _, recorder = await start_channel()
    photo_bytes = make_image(800, 600, fmt="JPEG")
    fake_telegram.add_file("big", photo_bytes, "photos/file_1.jpg")
    fake_telegram.add_file("doc", b"%PDF-1.4 report", "documents/file_2.pdf")
    fake_telegram.add_file("evil", b"root:x:0:0", "documents/file_3")
    fake_telegram.add_file("doc2", b"%PDF-1.4 another report", "documents/file_4.pdf")
    photo_mid = fake_telegram._next_message_id
    fake_telegram.push_message(
        chat_id=42, user_id=42, caption="look at this",
        photo=[{"file_id": "small", "file_unique_id": "s", "width": 90, "height": 90, "file_size": 10},
               {"file_id": "big", "file_unique_id": "b", "width": 800, "height": 600,
                "file_size": len(photo_bytes)}],
    )
    fake_telegram.push_message(chat_id=42, user_id=42, document={
        "file_id": "doc", "file_unique_id": "d", "file_name": "report 2024.pdf",
        "mime_type": "application/pdf", "file_size": 15})
    fake_telegram.push_message(chat_id=42, user_id=42, document={
        "file_id": "evil", "file_unique_id": "e", "file_name": "../../etc/passwd"})
    fake_telegram.push_message(chat_id=42, user_id=42, caption="huge", document={
        "file_id": "huge", "file_unique_id": "h", "file_name": "big.iso", "file_size": 30 * 2**20})
    fake_telegram.push_message(chat_id=42, user_id=42, document={  # the same name again
        "file_id": "doc2", "file_unique_id": "d2", "file_name": "report 2024.pdf",
        "mime_type": "application/pdf", "file_size": 23})
    photo, doc, evil, huge, doc2 = await recorder.wait(5)

    workspace = tmp_path / "scopes" / scope_dirname(memory_scope(photo))
    assert photo.text == "look at this"  # the caption is the text; the file is an attachment
    [att] = photo.attachments
    assert (att.path, att.mime, att.size, att.kind) == (f"files/photo_{photo_mid}.jpg", "image/jpeg",
                                                        len(photo_bytes), "image")
    assert (workspace / att.path).read_bytes() == photo_bytes
    assert fake_telegram.calls_of("getFile")[0]["file_id"] == "big"  # the largest size

    [doc_att] = doc.attachments
    assert doc_att.name == "report_2024.pdf" and doc_att.mime == "application/pdf" and doc_att.kind == "file"
    assert doc.text == "" and doc_att.path == "files/report_2024.pdf"
    assert (workspace / doc_att.path).read_bytes() == b"%PDF-1.4 report"
    [doc2_att] = doc2.attachments
    assert doc2_att.path == "files/report_2024-2.pdf"  # unique: the first one stays as it was
    assert (workspace / doc2_att.path).read_bytes() == b"%PDF-1.4 another report"

    [evil_att] = evil.attachments
    assert evil_att.path == "files/passwd"
    assert (workspace / evil_att.path).read_bytes() == b"root:x:0:0"

    [huge_att] = huge.attachments
    assert huge.text == "huge" and huge_att.path == "" and huge_att.name == "big.iso"
    assert huge_att.error == "it is larger than 20 MB, the most I accept (limits.max_inbound_file_mb)"
    assert "huge" not in [c["file_id"] for c in fake_telegram.calls_of("getFile")], "never fetched"
    assert sorted(p.name for p in (workspace / "files").iterdir()) == sorted([
        f"photo_{photo_mid}.jpg", "passwd", "report_2024-2.pdf", "report_2024.pdf"])  # no partial files left


async def test_voice_audio_and_video_notes_are_saved(
    fake_telegram: FakeTelegram, start_channel: Starter, tmp_path: Path
) -> None:
    _, recorder = await start_channel()
    ogg = make_ogg_opus(3)
    fake_telegram.add_file("v", ogg, "voice/file_7.oga")
    fake_telegram.add_file("a", b"ID3 an mp3", "music/file_8.mp3")
    fake_telegram.add_file("n", b"\x00\x00\x00 ftypisom", "video_notes/file_9.mp4")
    mid = fake_telegram._next_message_id
    fake_telegram.push_message(chat_id=5, user_id=5, voice={
        "file_id": "v", "file_unique_id": "uv", "duration": 3, "mime_type": "audio/ogg", "file_size": len(ogg)})
    fake_telegram.push_message(chat_id=5, user_id=5, caption="a song", audio={
        "file_id": "a", "file_unique_id": "ua", "duration": 185, "mime_type": "audio/mpeg",
        "file_name": "tune.mp3", "file_size": 10})
    fake_telegram.push_message(chat_id=5, user_id=5, video_note={
        "file_id": "n", "file_unique_id": "un", "duration": 7, "length": 240, "file_size": 16})
    voice, audio, note = await recorder.wait(3)
    workspace = tmp_path / "scopes" / scope_dirname(memory_scope(voice))
    [v] = voice.attachments
    assert (v.kind, v.path, v.mime, v.duration_s) == ("voice", f"files/voice_{mid}.ogg", "audio/ogg", 3.0)
    assert (workspace / v.path).read_bytes() == ogg
    [a] = audio.attachments
    assert (audio.text, a.kind, a.path, a.duration_s) == ("a song", "audio", "files/tune.mp3", 185.0)
    [n] = note.attachments
    assert (n.kind, n.path, n.mime, n.duration_s) == ("voice", f"files/video_note_{mid + 2}.mp4", "video/mp4", 7.0)


async def test_a_file_is_kept_once_when_the_router_fails_and_the_update_comes_again(
    fake_telegram: FakeTelegram, start_channel: Starter, tmp_path: Path
) -> None:
    _, recorder = await start_channel()
    recorder.fail_times = 1
    fake_telegram.add_file("doc", b"%PDF-1.4 x", "documents/file_1.pdf")
    fake_telegram.push_message(chat_id=3, user_id=3, document={
        "file_id": "doc", "file_unique_id": "d", "file_name": "a.pdf", "file_size": 10})
    (inbound,) = await recorder.wait(1)  # taken on the second try
    workspace = tmp_path / "scopes" / scope_dirname(memory_scope(inbound))
    assert fake_telegram.downloads == ["documents/file_1.pdf"] * 2
    assert [a.path for a in inbound.attachments] == ["files/a.pdf"]
    assert [p.name for p in (workspace / "files").iterdir()] == ["a.pdf"]  # the failed try left nothing


async def test_a_file_larger_than_it_was_said_to_be_is_cut_off_while_downloading(
    fake_telegram: FakeTelegram, start_channel: Starter, tmp_path: Path
) -> None:
    channel, recorder = await start_channel()
    channel._file_limit = lambda: 100_000
    fake_telegram.add_file("liar", b"x" * 300_000, "documents/file_5.bin", reported_size=1000)
    fake_telegram.add_file("big", b"y" * (21 * 2**20), "documents/file_6.bin")
    fake_telegram.push_message(chat_id=9, user_id=9, caption="small, they said", document={
        "file_id": "liar", "file_unique_id": "l", "file_name": "data.bin", "file_size": 1000})
    fake_telegram.push_message(chat_id=9, user_id=9, document={  # no size stated at all
        "file_id": "big", "file_unique_id": "b", "file_name": "big.bin"})
    liar, big = await recorder.wait(2)
    [att] = liar.attachments
    assert att.path == "" and "larger than 98 KB" in (att.error or "")
    assert fake_telegram.downloads == ["documents/file_5.bin"]  # fetched, and stopped at the cap
    workspace = tmp_path / "scopes" / scope_dirname(memory_scope(liar))
    assert list((workspace / "files").iterdir()) == []  # nothing half-written is left
    [att] = big.attachments  # Telegram itself refuses files over 20 MB to bots
    assert att.error == "it is larger than 20 MB, the most Telegram lets bots download"


async def test_fake_accepts_json_bodies_and_edits(fake_telegram: FakeTelegram) -> None:
    bot = Bot(fake_telegram.token, base_url=fake_telegram.base_url)
    async with bot:
        message = await bot.send_message(chat_id=42, text="draft")
        edited = await bot.edit_message_text("final", chat_id=42, message_id=message.message_id)
    assert isinstance(edited, Message) and edited.text == "final"
    assert fake_telegram.edits[0]["text"] == "final"
    async with aiohttp.ClientSession() as http:
        url = f"{fake_telegram.base_url}{fake_telegram.token}/sendMessage"
        async with http.post(url, json={"chat_id": 42, "text": "x" * 4097}) as resp:
            assert resp.status == 400 and "too long" in (await resp.json())["description"]
        async with http.post(url, json={"chat_id": 42, "text": "json body"}) as resp:
            assert (await resp.json())["ok"] is True
    assert fake_telegram.sent[-1] == {"chat_id": 42, "text": "json body"}


def test_safe_file_names() -> None:
    assert safe_file_name("../../etc/passwd") == "passwd"
    assert safe_file_name("C:\\Users\\x\\notes.txt") == "notes.txt"
    assert safe_file_name("..") == "file"
    assert safe_file_name("отчёт 1.pdf") == "отчёт_1.pdf"
    long = safe_file_name("a" * 300 + ".tar.gz")
    assert len(long) == 100 and long.endswith(".gz")


# ---------------------------------------------------------------------------- ignored updates


async def test_unsupported_updates_are_ignored(fake_telegram: FakeTelegram, start_channel: Starter) -> None:
    _, recorder = await start_channel()
    chat = {"id": 42, "type": "private", "first_name": "A"}
    person = {"id": 42, "is_bot": False, "first_name": "A"}
    base = {"date": 0, "chat": chat, "from": person}
    fake_telegram.push_message(chat_id=42, user_id=42, sticker={
        "file_id": "st", "file_unique_id": "st", "type": "regular", "width": 1, "height": 1,
        "is_animated": False, "is_video": False})
    fake_telegram.push_update({"edited_message": {"message_id": 1, "edit_date": 1, "text": "edit", **base}})
    fake_telegram.push_update({"channel_post": {"message_id": 2, "date": 0, "text": "news",
                                                "chat": {"id": -1009, "type": "channel"}}})
    fake_telegram.push_update({"message": {"message_id": 3, "new_chat_members": [person], **base}})
    fake_telegram.push_update({"message": {"message_id": 4, "text": "bot talk", "date": 0, "chat": chat,
                                           "from": {"id": 99, "is_bot": True, "first_name": "B"}}})
    fake_telegram.push_update({"message": {"message_id": 5, "text": "echo", "date": 0, "chat": chat,
                                           "from": fake_telegram.bot_user()}})
    fake_telegram.push_update({"message": {"message_id": 6, "poll": {"id": "p"}, **base}})
    fake_telegram.push_update({"message": {"message_id": 7, "text": 12345, **base}})
    fake_telegram.push_update({"message": "junk"})
    fake_telegram.push_update({"message": {"message_id": 8, "text": "x"}})  # no chat, no date
    fake_telegram.push_update({"callback_query": {"id": "1"}})
    last = fake_telegram.push_message(chat_id=42, user_id=42, text="sentinel")

    [inbound] = await recorder.wait(1)
    assert inbound.text == "sentinel"
    await fake_telegram.wait_confirmed(last + 1)
    assert len(recorder.inbounds) == 1


# ---------------------------------------------------------------------------- commands


async def test_commands_are_set_only_when_they_change(
    fake_telegram: FakeTelegram, start_channel: Starter
) -> None:
    commands = (("help", "List commands"), ("context", "Context statistics"))
    first, _ = await start_channel(commands=commands)
    await first.stop()
    second, _ = await start_channel(commands=commands)
    await second.stop()
    assert len(fake_telegram.calls_of("getMyCommands")) == 2
    assert len(fake_telegram.calls_of("setMyCommands")) == 1
    assert fake_telegram.commands == [{"command": c, "description": d} for c, d in commands]


async def test_bad_token_fails_start(fake_telegram: FakeTelegram, tmp_path: Path) -> None:
    channel = TelegramChannel(
        config(fake_telegram, token="999:wrong"), Recorder(), workspace_for=workspace_for(tmp_path)
    )
    with pytest.raises(InvalidToken):
        await channel.start()
    assert not channel.is_ready()


# ---------------------------------------------------------------------------- pure parts


def message_update(**message: Any) -> dict[str, Any]:
    base = {"message_id": 1, "date": 0, "chat": {"id": 42, "type": "private"},
            "from": {"id": 42, "is_bot": False, "first_name": "A"}}
    return {"update_id": 10, "message": base | message}


@settings(max_examples=100, deadline=None)
@given(raw=json_values, fields=st.dictionaries(st.text(max_size=12), json_values, max_size=6),
       text=st.text(max_size=60), offset=st.integers(-5, 80), length=st.integers(-5, 80),
       kind=st.sampled_from(["mention", "bot_command", "text_mention", "bold", "junk"]))
def test_parse_update_never_raises(
    raw: Any, fields: dict[str, Any], text: str, offset: int, length: int, kind: str
) -> None:
    candidates = [
        raw,
        {"update_id": 1, "message": raw},
        message_update(**fields),
        message_update(text=text, entities=[{"type": kind, "offset": offset, "length": length,
                                             "user": {"id": ME.id, "is_bot": True, "first_name": "G"}}]),
    ]
    for candidate in candidates:
        parsed = parse_update(candidate, ME)
        if parsed is not None:
            inbound = parsed.inbound
            assert isinstance(inbound.text, str)
            inbound.text.encode("utf-8")  # no lone surrogates survive
            assert inbound.chat_id.lstrip("-").isdigit() and inbound.user_id.lstrip("-").isdigit()


PIECES = ["hi", " ", "@gateway_test_bot", "@Gateway_Test_Bot", "@other_bot", "/start", "/help@gateway_test_bot",
          "/help@other_bot", "🙂", "数据", "\ud800", "\x00", "\n", "naïve"]


@settings(max_examples=300, deadline=None)
@given(
    text=st.lists(st.sampled_from(PIECES), max_size=8).map("".join),
    entities=st.lists(st.fixed_dictionaries({
        "type": st.sampled_from(["mention", "bot_command", "bold", "hashtag", "unknown_kind"]),
        "offset": st.integers(-2, 40), "length": st.integers(-2, 40)}), max_size=4),
    chat=st.sampled_from([(42, "private"), (-100_200, "supergroup"), (-300, "group"), (-100_900, "channel")]),
    sender=st.fixed_dictionaries({"id": st.integers(1, 2**40), "is_bot": st.booleans(),
                                  "first_name": st.sampled_from(["A", "Zoë", "🙂"])},
                                 optional={"last_name": st.sampled_from(["B", " "]),
                                           "username": st.sampled_from(["ab", "gateway_test_bot"])}),
    topic=st.sampled_from([None, (5, True), (5, False)]),
)
def test_plain_text_updates_read_without_ptb_read_as_ptb_reads_them(
    text: str, entities: list[dict[str, Any]], chat: tuple[int, str], sender: dict[str, Any],
    topic: tuple[int, bool] | None,
) -> None:
    """The common update (a person's text message) is read straight from the JSON; that
    must give exactly what PTB's objects give, drops included."""
    from telegram import Update

    from channels.telegram.updates import _from_message, _plain_text_message

    message: dict[str, Any] = {"message_id": 9, "date": 1_700_000_000, "chat": {"id": chat[0], "type": chat[1]},
                               "from": sender, "text": text}
    if entities:
        message["entities"] = entities
    if topic is not None:
        message["message_thread_id"], message["is_topic_message"] = topic
    raw = {"update_id": 77, "message": message}

    def read(parsed: Any) -> Any:  # the arrival time aside
        return None if parsed is None else dataclasses.replace(parsed.inbound, received_at=0.0)

    fast = _plain_text_message(77, message, ME)
    slow = read(_from_message(77, Update.de_json(json.loads(json.dumps(raw)), None), ME))
    if chat[1] == "channel":
        assert fast is None  # left to PTB's path, which drops it
    else:
        assert read(fast) == slow
    assert read(parse_update(raw, ME)) == slow


entity_types = st.sampled_from(["bold", "italic", "code", "pre", "blockquote", "text_link"])


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet=st.characters(codec="utf-8") | st.sampled_from(["\n", " ", "😀", "a"]),
                 max_size=400),
    raw_entities=st.lists(st.tuples(entity_types, st.integers(0, 500), st.integers(1, 120)), max_size=30),
    limit=st.integers(8, 120),
)
def test_split_chunks_respects_limits_and_keeps_text(
    text: str, raw_entities: list[tuple[str, int, int]], limit: int
) -> None:
    total = utf16_len(text)
    entities = [{"type": t, "offset": o, "length": min(n, total - o)}
                for t, o, n in raw_entities if o < total]
    chunks = split_chunks(text, entities, limit)
    for chunk in chunks:
        size = utf16_len(chunk.text)
        assert 0 < size <= limit and chunk.text.strip()
        assert len(chunk.entities) <= MAX_ENTITIES
        for ent in chunk.entities:
            assert ent["length"] > 0 and ent["offset"] >= 0 and ent["offset"] + ent["length"] <= size
    assert re.sub(r"\s", "", "".join(c.text for c in chunks)) == re.sub(r"\s", "", text)


def test_entities_are_not_split_when_a_boundary_exists() -> None:
    para = "word " * 30
    text = f"{para}\n\n**{' '.join(['bold'] * 10)}**\n\n{para}"
    chunks = render_markdown(text, limit=200)
    bold = [e for c in chunks for e in c.entities if e["type"] == "bold"]
    assert len(bold) == 1, "the bold run fits in one message, so it is never cut"


def test_many_entities_are_spread_over_messages() -> None:
    md = " ".join(f"**b{i}**" for i in range(250))
    chunks = render_markdown(md)
    assert len(chunks) >= 3
    assert all(len(c.entities) <= MAX_ENTITIES for c in chunks)
    assert sum(len(c.entities) for c in chunks) == 250


# ---------------------------------------------------------------------------- one poller per bot


async def _raw_poll(fake: FakeTelegram, timeout: int) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as http:
        url = f"{fake.base_url}{fake.token}/getUpdates"
        async with http.post(url, json={"timeout": timeout, "limit": 1}) as resp:
            return resp.status, await resp.json()


async def test_fake_bot_api_terminates_the_older_long_poll_with_409() -> None:
    fake = telegram_server.FakeTelegram(conflict_interval_s=0.2)
    await fake.start()
    try:
        older = asyncio.create_task(_raw_poll(fake, 5))
        await fake.wait_call("getUpdates")
        newer = asyncio.create_task(_raw_poll(fake, 5))
        status, body = await asyncio.wait_for(older, 3)
        assert (status, body) == (409, {"ok": False, "error_code": 409, "description": (
            "Conflict: terminated by other getUpdates request; make sure that only one bot instance is running")})
        assert not newer.done(), "the newer request keeps waiting"
        update_id = fake.push_message(chat_id=1, user_id=1, text="hi")
        status, body = await asyncio.wait_for(newer, 3)
        assert status == 200 and [u["update_id"] for u in body["result"]] == [update_id]
        assert len(fake.conflicts) == 1
    finally:
        await fake.stop()


async def _within(seconds: float, check: Callable[[], bool]) -> None:
    async with asyncio.timeout(seconds):
        while True:
            if check():
                return
            await asyncio.sleep(0.02)


async def test_a_quiet_bot_is_ready_without_waiting_out_a_long_poll(tmp_path: Path) -> None:
    fake = telegram_server.FakeTelegram()
    await fake.start()
    channel = TelegramChannel(config(fake, poll_timeout_s=30), Recorder(), workspace_for=workspace_for(tmp_path))
    try:
        await channel.start()
        await _within(5, channel.is_ready)
        # Then it long-polls as configured.
        await _within(5, lambda: any(c.get("timeout") == 30 for c in fake.calls_of("getUpdates")))
    finally:
        await channel.stop()
        await fake.stop()


async def test_poller_backs_off_on_409_and_logs_it_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    fake = telegram_server.FakeTelegram(conflict_interval_s=0.1)
    await fake.start()
    recorder = Recorder()
    channel = TelegramChannel(config(fake), recorder, workspace_for=workspace_for(tmp_path), sleep=SleepLog())
    try:
        await channel.start()
        await fake.wait_call("getUpdates")
        # Another instance polls until both sides were cut off a few times (as during a
        # hand-over between gateways). Bounded by time, not by a fixed window, so a slow
        # machine still sees the whole fight.
        loop = asyncio.get_running_loop()
        start = loop.time()
        while (len(fake.conflicts) < 3 or loop.time() < start + 2.5) and loop.time() < start + 15:
            await _raw_poll(fake, 1)
        ours = [c for c in fake.calls_of("getUpdates") if c.get("limit") != 1]
        conflicts = [r for r in caplog.records if "another poller" in r.getMessage()]
        assert len(fake.conflicts) >= 3, "both sides were terminated, more than once"
        assert len(conflicts) == 1, "one warning per run of conflicts, not one per retry"
        assert len(ours) <= 5, f"backing off, not hammering: {len(ours)} polls"
        # Alone again: polling resumes and updates flow.
        fake.push_message(chat_id=5, user_id=5, text="after the fight")
        [inbound] = await recorder.wait(1, timeout=10)
        assert inbound.text == "after the fight" and channel.is_ready()
    finally:
        await channel.stop()
        await fake.stop()
