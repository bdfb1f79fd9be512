"""The Slack channel end to end: real slack-bolt / slack_sdk against tests/fakes/slack_server."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from slack_sdk.errors import SlackApiError

from channels.base import Channel, WebhookChannel
from channels.slack.adapter import SlackChannel
from channels.slack.events import parse_command, parse_event, reply_thread, verify_signature
from channels.slack.format import MESSAGE_LIMIT, slack_to_text, split_message, to_mrkdwn
from gateway.config.schema import SlackConfig
from gateway.keys import memory_scope, scope_dirname, session_key
from gateway.types import Inbound, inbound_from_dict, inbound_to_dict
from tests.fakes import slack_server
from tests.fakes.media_files import make_image
from tests.fakes.slack_server import (
    APP_TOKEN,
    BOT_TOKEN,
    BOT_USER_ID,
    SIGNING_SECRET,
    FakeSlack,
    event_callback,
    signed_command_request,
    signed_event_request,
)

fake_slack = slack_server.fake_slack  # the fixture

_ts = iter(range(1, 10**6))


def next_ts() -> str:
    return f"1712000000.{next(_ts):06d}"


def dm(
    text: str, *, user: str = "U1", channel: str = "D1", ts: str | None = None, **extra: Any
) -> dict[str, Any]:
    return {"type": "message", "channel_type": "im", "channel": channel, "user": user,
            "text": text, "ts": ts or next_ts(), **extra}


def mention(text: str, *, user: str = "U1", channel: str = "C1", ts: str | None = None,
            **extra: Any) -> dict[str, Any]:
    return {"type": "app_mention", "channel": channel, "user": user,
            "text": f"<@{BOT_USER_ID}> {text}", "ts": ts or next_ts(), **extra}


class Recorder:
    """The router stand-in: records every Inbound, optionally answers through the channel."""

    def __init__(
        self, reply: Callable[[Inbound], str] | None = None, *, dedup: bool = False, failures: int = 0
    ) -> None:
        self.failures = failures  # the first calls raise, as a router whose database is down
        self.inbounds: list[Inbound] = []
        self.reply = reply
        self.dedup = dedup
        self.seen: set[str] = set()
        self.channel: SlackChannel | None = None
        self.gate: asyncio.Event | None = None  # when set, calls wait on it
        self.entered = asyncio.Event()
        self._changed = asyncio.Condition()

    async def __call__(self, inbound: Inbound) -> bool | None:
        self.inbounds.append(inbound)
        self.entered.set()
        async with self._changed:
            self._changed.notify_all()
        if self.gate is not None:
            await asyncio.wait_for(self.gate.wait(), 5)
        if self.failures > 0:
            self.failures -= 1
            raise RuntimeError("router failed")
        if self.dedup:
            if inbound.event_id in self.seen:
                return False  # as the router says of an event it has seen
            self.seen.add(inbound.event_id)
        if self.reply is not None and self.channel is not None:
            await self.channel.send(inbound, self.reply(inbound))

    async def wait(self, n: int, timeout: float = 5) -> list[Inbound]:
        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(lambda: len(self.inbounds) >= n), timeout)
        return list(self.inbounds)


MakeChannel = Callable[..., Awaitable[SlackChannel]]


@pytest.fixture
async def make_channel(fake_slack: FakeSlack, tmp_path: Path) -> AsyncIterator[MakeChannel]:
    started: list[SlackChannel] = []

    async def make(
        handler: Recorder, *, mode: str = "socket", sleep: Callable[[float], Awaitable[None]] | None = None,
        reply_to_mode: str = "thread",
    ) -> SlackChannel:
        cfg = SlackConfig(
            enabled=True, bot_token=BOT_TOKEN, app_token=APP_TOKEN, signing_secret=SIGNING_SECRET,
            mode=mode, base_url=fake_slack.base_url, reply_to_mode=reply_to_mode,
        )
        kwargs: dict[str, Any] = {"sleep": sleep} if sleep is not None else {}
        channel = SlackChannel(
            cfg, handler,
            workspace_for=lambda inbound: tmp_path / "scopes" / scope_dirname(memory_scope(inbound)),
            start_timeout_s=5, **kwargs,
        )
        handler.channel = channel
        await channel.start()
        started.append(channel)
        return channel

    yield make
    for channel in started:
        await channel.stop()


# ---------------------------------------------------------------------------- socket mode


async def test_dm_round_trip_acks_after_the_handler(fake_slack: FakeSlack, make_channel: MakeChannel) -> None:
    handler = Recorder(lambda inbound: f"you said: {inbound.text}")
    handler.gate = asyncio.Event()
    channel = await make_channel(handler)
    assert isinstance(channel, Channel) and isinstance(channel, WebhookChannel)
    assert channel.is_ready()

    event = dm("hello there")
    envelope = await fake_slack.push_event(event)
    await asyncio.wait_for(handler.entered.wait(), 5)
    assert envelope not in fake_slack.acked  # not before the router has the event
    handler.gate.set()
    await fake_slack.wait_acked(envelope)

    [inbound] = handler.inbounds
    assert (inbound.chat_id, inbound.user_id, inbound.text) == ("D1", "U1", "hello there")
    assert inbound.event_id == f"D1:{event['ts']}" and inbound.message_id == event["ts"]
    assert not inbound.is_group and inbound.thread_id is None
    assert session_key(inbound) == "slack:dm:D1"
    [post] = await fake_slack.wait_posted(1)
    assert post["channel"] == "D1" and post["text"] == "you said: hello there"
    assert "thread_ts" not in post


async def test_a_top_level_mention_is_answered_top_level(
    fake_slack: FakeSlack, make_channel: MakeChannel
) -> None:
    handler = Recorder(lambda inbound: "**done**")
    await make_channel(handler, reply_to_mode="channel")
    event = mention("what is up?")
    await fake_slack.wait_acked(await fake_slack.push_event(event))

    [inbound] = handler.inbounds
    assert inbound.text == "what is up?" and inbound.mentioned and inbound.is_group
    assert inbound.thread_id is None
    assert session_key(inbound) == "slack:channel:C1:user:U1"
    assert session_key(inbound, "group") == "slack:channel:C1"
    [post] = await fake_slack.wait_posted(1)
    # The top level is the session, so the answer stays there (a thread would be a new one).
    assert post["channel"] == "C1" and "thread_ts" not in post
    assert post["text"] == "*done*"  # Markdown → mrkdwn


async def test_threads_are_sessions(fake_slack: FakeSlack, make_channel: MakeChannel) -> None:
    handler = Recorder(lambda inbound: "ok")
    await make_channel(handler, reply_to_mode="channel")
    first, second = mention("one"), mention("two")
    follow_up = mention("more", thread_ts=first["ts"])
    # A thread's parent that carries its own ts as thread_ts is still a top-level message.
    parent_ts = next_ts()
    parent = mention("parent", ts=parent_ts, thread_ts=parent_ts)
    for event in (first, second, follow_up, parent):
        await fake_slack.wait_acked(await fake_slack.push_event(event))

    keys = [session_key(i) for i in handler.inbounds]
    assert keys[0] == keys[1] == keys[3] == "slack:channel:C1:user:U1"
    assert keys[2] == f"slack:channel:C1:thread:{first['ts']}"
    posts = await fake_slack.wait_posted(4)
    assert [p.get("thread_ts") for p in posts] == [None, None, first["ts"], None]


async def test_a_top_level_mention_opens_a_thread(fake_slack: FakeSlack, make_channel: MakeChannel) -> None:
    """`reply_to_mode: "thread"` (the default): the mention is answered in a thread under
    it, and is the first message of that thread's session; a follow-up in the thread lands
    in the same session. Top-level messages that do not mention the bot, and DMs, are
    answered where they were written."""
    handler = Recorder(lambda inbound: "ok")
    channel = await make_channel(handler)
    assert channel.cfg.reply_to_mode == "thread"
    first = mention("one")
    follow_up = mention("more", thread_ts=first["ts"])
    parent_ts = next_ts()
    parent = mention("parent", ts=parent_ts, thread_ts=parent_ts)  # a parent carrying its own ts
    unmentioned = {"type": "message", "channel_type": "channel", "channel": "C1", "user": "U1",
                   "text": "no mention here", "ts": next_ts()}
    private = dm("hello")
    for event in (first, follow_up, parent, unmentioned, private):
        await fake_slack.wait_acked(await fake_slack.push_event(event))

    keys = [session_key(i) for i in handler.inbounds]
    assert keys == [f"slack:channel:C1:thread:{first['ts']}", f"slack:channel:C1:thread:{first['ts']}",
                    f"slack:channel:C1:thread:{parent_ts}", "slack:channel:C1:user:U1", "slack:dm:D1"]
    assert handler.inbounds[0].message_id == first["ts"] == handler.inbounds[0].thread_id
    posts = await fake_slack.wait_posted(5)
    assert [(p["channel"], p.get("thread_ts")) for p in posts] == [
        ("C1", first["ts"]), ("C1", first["ts"]), ("C1", parent_ts), ("C1", None), ("D1", None)]


def test_reply_to_mode_in_parse_event() -> None:
    event = {"type": "app_mention", "user": "U1", "channel": "C1", "channel_type": "channel",
             "text": f"<@{BOT_USER_ID}> hi", "ts": "5.5"}
    threaded = parse_event(event, bot_user_id=BOT_USER_ID)
    top = parse_event(event, bot_user_id=BOT_USER_ID, reply_to_mode="channel")
    assert threaded is not None and top is not None
    assert (threaded.inbound.thread_id, top.inbound.thread_id) == ("5.5", None)
    assert reply_thread(threaded.inbound) == "5.5" and reply_thread(top.inbound) is None
    in_thread = parse_event({**event, "thread_ts": "4.4"}, bot_user_id=BOT_USER_ID)
    assert in_thread is not None and in_thread.inbound.thread_id == "4.4"  # an existing thread stays its own
    as_dm = parse_event({**event, "type": "message", "channel": "D1", "channel_type": "im"}, bot_user_id=BOT_USER_ID)
    assert as_dm is not None and as_dm.inbound.thread_id is None


async def test_twins_and_retries_share_one_event_id(fake_slack: FakeSlack, make_channel: MakeChannel) -> None:
    handler = Recorder(lambda inbound: "once", dedup=True)
    await make_channel(handler)
    ts = next_ts()
    text = f"<@{BOT_USER_ID}> hi"
    as_message = {"type": "message", "channel_type": "channel", "channel": "C1", "user": "U1",
                  "text": text, "ts": ts}
    as_mention = {"type": "app_mention", "channel": "C1", "user": "U1", "text": text, "ts": ts}
    envelopes = [
        await fake_slack.push_event(as_message, event_id="Ev1"),
        await fake_slack.push_event(as_mention, event_id="Ev2"),
        await fake_slack.push_event(as_mention, event_id="Ev2", retry_num=1),
    ]
    for envelope in envelopes:
        await fake_slack.wait_acked(envelope)

    assert {i.event_id for i in handler.inbounds} == {f"C1:{ts}"}
    assert len(handler.inbounds) == 3
    assert len({(i.text, i.mentioned, i.thread_id, i.message_id) for i in handler.inbounds}) == 1
    assert len(fake_slack.posted) == 1


async def test_bots_own_edits_and_deletes_are_ignored(
    fake_slack: FakeSlack, make_channel: MakeChannel
) -> None:
    handler = Recorder()
    await make_channel(handler)
    ignored = [
        dm("from a bot", bot_id="B2"),
        dm("from a bot", subtype="bot_message", user="U9"),
        dm("from us", user=BOT_USER_ID),
        {"type": "message", "subtype": "message_changed", "channel": "D1", "ts": next_ts(),
         "message": {"user": "U1", "text": "edited"}},
        {"type": "message", "subtype": "message_deleted", "channel": "D1", "ts": next_ts()},
        dm("joined", subtype="channel_join"),
        {"type": "reaction_added", "user": "U1", "reaction": "+1"},
        dm(f"<@{BOT_USER_ID}>"),  # nothing but the mention: nothing to answer
    ]
    envelopes = [await fake_slack.push_event(event) for event in ignored]
    for envelope in envelopes:
        await fake_slack.wait_acked(envelope)  # acknowledged all the same: no redelivery
    real = dm("real one")
    await fake_slack.wait_acked(await fake_slack.push_event(real))
    assert [i.text for i in handler.inbounds] == ["real one"]


async def test_long_reply_is_split_in_order(fake_slack: FakeSlack, make_channel: MakeChannel) -> None:
    paragraphs = [f"Paragraph {n}: " + " ".join(f"w{n}x{k}" for k in range(60)) for n in range(20)]
    code = "```\n" + "\n".join(f"line_{k} = {k}" for k in range(300)) + "\n```"
    reply = "\n\n".join([*paragraphs[:10], code, *paragraphs[10:]])
    assert len(reply) > 10_000
    handler = Recorder(lambda inbound: reply)
    await make_channel(handler)
    await fake_slack.wait_acked(await fake_slack.push_event(dm("long please")))

    posts = fake_slack.posted
    assert len(posts) >= 3
    texts = [p["text"] for p in posts]
    assert all(len(t) <= MESSAGE_LIMIT for t in texts)
    assert all(t.count("```") % 2 == 0 for t in texts)
    joined = "\n".join(texts)
    markers = [f"Paragraph {n}:" for n in range(20)] + ["line_0 =", "line_299 ="]
    positions = [joined.index(m) for m in markers]
    assert positions[:10] == sorted(positions[:10]) and positions[10:20] == sorted(positions[10:20])
    assert positions[9] < positions[20] < positions[21] < positions[10]


async def test_handler_failure_leaves_the_event_unacknowledged(
    fake_slack: FakeSlack, make_channel: MakeChannel
) -> None:
    handler = Recorder(lambda inbound: "answered", failures=1)
    await make_channel(handler)
    event = dm("try me")
    first = await fake_slack.push_event(event, event_id="Ev9")
    await fake_slack.wait_acked(await fake_slack.push_event(dm("other")))
    assert first not in fake_slack.acked  # Slack will redeliver it
    redelivered = await fake_slack.push_event(event, event_id="Ev9", retry_num=1)
    await fake_slack.wait_acked(redelivered)
    assert [i.text for i in handler.inbounds] == ["try me", "other", "try me"]
    assert handler.inbounds[0].event_id == handler.inbounds[2].event_id


async def test_rate_limit_is_waited_out(fake_slack: FakeSlack, make_channel: MakeChannel) -> None:
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)

    handler = Recorder()
    channel = await make_channel(handler, sleep=sleep)
    fake_slack.fail_next("chat.postMessage", 429, {"Retry-After": "7"})
    inbound = Inbound(channel="slack", chat_id="D1", user_id="U1", text="x", event_id="D1:1.0")
    await channel.send(inbound, "after the wait")
    assert waits == [7.0]
    assert [p["text"] for p in fake_slack.posted] == ["after the wait"]
    assert len(fake_slack.method_calls("chat.postMessage")) == 2

    for _ in range(10):  # bounded: it gives up instead of waiting forever
        fake_slack.fail_next("chat.postMessage", 429, {"Retry-After": "1"})
    with pytest.raises(SlackApiError):
        await channel.send(inbound, "never")
    assert len(waits) == 1 + 3


async def test_slash_command_acked_and_answered_ephemerally(
    fake_slack: FakeSlack, make_channel: MakeChannel
) -> None:
    handler = Recorder(lambda inbound: f"context of {inbound.user_id}")
    await make_channel(handler)
    envelope = await fake_slack.push_slash_command("/context", "clear", user="U1", channel="C1")
    await fake_slack.wait_acked(envelope)
    [inbound] = await handler.wait(1)
    assert inbound.text == "/context clear" and inbound.event_id.startswith("cmd:trigger.")
    assert inbound.is_group and inbound.mentioned
    assert session_key(inbound) == "slack:channel:C1:user:U1"
    await fake_slack.wait_for(lambda: fake_slack.responses)
    assert fake_slack.responses[0]["text"] == "context of U1"
    assert fake_slack.responses[0]["response_type"] == "ephemeral"
    assert fake_slack.posted == []

    # Rebuilt after a restart, its response_url long expired: chat.postEphemeral instead.
    data = inbound_to_dict(inbound)
    data["extra"] = {"command": "/context", "response_url": f"{fake_slack.root_url}/gone"}
    await handler.channel.send(inbound_from_dict(data), "later")  # type: ignore[union-attr]
    [ephemeral] = fake_slack.ephemeral
    assert (ephemeral["channel"], ephemeral["user"], ephemeral["text"]) == ("C1", "U1", "later")


async def test_typing_is_a_reaction_while_working(fake_slack: FakeSlack, make_channel: MakeChannel) -> None:
    handler = Recorder()
    channel = await make_channel(handler)
    inbound = Inbound(channel="slack", chat_id="C1", user_id="U1", text="x", event_id="C1:5.5",
                      message_id="5.5", is_group=True)
    async with channel.typing(inbound):
        assert [kind for kind, _ in fake_slack.reactions] == ["add"]
    assert [kind for kind, _ in fake_slack.reactions] == ["add", "remove"]
    assert fake_slack.reactions[0][1]["timestamp"] == "5.5"

    fake_slack.fail_next("reactions.add", 200, body={"ok": False, "error": "missing_scope"})
    async with channel.typing(inbound):  # failures are ignored, and nothing to remove
        pass
    assert [kind for kind, _ in fake_slack.reactions] == ["add", "remove"]


async def test_files_are_saved_in_the_workspace(
    fake_slack: FakeSlack, make_channel: MakeChannel, tmp_path: Path
) -> None:
    handler = Recorder()
    channel = await make_channel(handler)
    channel._file_limit = lambda: 1000
    good = fake_slack.add_file("../../notes v1.txt", b"hello file")
    evil = {**fake_slack.add_file("x.txt", b"x"), "url_private_download": "https://evil.example/x",
            "url_private": "https://evil.example/x"}
    picture = fake_slack.add_file("shot.png", make_image(20, 10), "image/png")
    clip = {**fake_slack.add_file("audio_message.webm", b"webm bytes", "audio/webm"),
            "subtype": "slack_audio", "duration_ms": 4200}
    big = fake_slack.add_file("big.bin", b"z" * 5000, "application/octet-stream")
    liar = {**fake_slack.add_file("liar.bin", b"z" * 5000, "application/octet-stream"), "size": 10}
    event = dm("see attached", subtype="file_share", files=[good, evil, picture, clip, big, liar])
    await fake_slack.wait_acked(await fake_slack.push_event(event))

    [inbound] = handler.inbounds
    assert inbound.text == "see attached"  # the files are attachments; the turn names them
    note, bad, image, voice, huge, cut = inbound.attachments
    assert (note.path, note.size, note.kind) == ("files/notes_v1.txt", 10, "file")
    workspace = tmp_path / "scopes" / scope_dirname(memory_scope(inbound))
    assert (workspace / note.path).read_bytes() == b"hello file"
    assert bad.path == "" and bad.error == "it could not be downloaded from Slack"
    assert (image.kind, image.path, image.mime) == ("image", "files/shot.png", "image/png")
    assert (voice.kind, voice.duration_s, voice.path) == ("voice", 4.2, "files/audio_message.webm")
    assert huge.path == "" and "larger than 1000 bytes" in (huge.error or "")
    assert cut.path == "" and "larger than 1000 bytes" in (cut.error or "")  # stopped while downloading
    # The bot token never went to evil.example; the file Slack said was too big was never fetched.
    assert fake_slack.downloads == [good["id"], picture["id"], clip["id"], liar["id"]]
    assert sorted(p.name for p in (workspace / "files").iterdir()) == [
        "audio_message.webm", "notes_v1.txt", "shot.png"]


async def test_a_posts_files_are_kept_once_across_failures_twins_and_retries(
    fake_slack: FakeSlack, make_channel: MakeChannel, tmp_path: Path
) -> None:
    handler = Recorder(dedup=True, failures=1)
    await make_channel(handler)
    doc = fake_slack.add_file("notes.txt", b"hello file")
    ts = next_ts()
    text = f"<@{BOT_USER_ID}> see attached"
    as_message = {"type": "message", "channel_type": "channel", "channel": "C1", "user": "U1", "text": text,
                  "ts": ts, "subtype": "file_share", "files": [doc]}
    as_mention = {"type": "app_mention", "channel": "C1", "user": "U1", "text": text, "ts": ts, "files": [doc]}
    failed = await fake_slack.push_event(as_message, event_id="Ev1")  # the router fails: Slack redelivers
    await handler.wait(1)
    await fake_slack.wait_acked(await fake_slack.push_event(dm("other")))
    assert failed not in fake_slack.acked
    for envelope in [await fake_slack.push_event(as_message, event_id="Ev1", retry_num=1),
                     await fake_slack.push_event(as_mention, event_id="Ev2"),  # the twin
                     await fake_slack.push_event(as_mention, event_id="Ev2", retry_num=1)]:
        await fake_slack.wait_acked(envelope)
    workspace = tmp_path / "scopes" / scope_dirname(memory_scope(handler.inbounds[0]))
    # The failed delivery's copy was deleted (its name is free again); the twin and its retry
    # were not fetched at all.
    assert [p.name for p in (workspace / "files").iterdir()] == ["notes.txt"]
    assert fake_slack.downloads == [doc["id"]] * 2
    first, _other, taken, twin, retry = handler.inbounds
    assert [a.path for a in first.attachments] == [a.path for a in taken.attachments] == ["files/notes.txt"]
    assert twin.attachments == retry.attachments == ()


async def test_user_name_comes_from_users_info(fake_slack: FakeSlack, make_channel: MakeChannel) -> None:
    fake_slack.add_user("U7", "Ada Lovelace", display_name="ada")
    handler = Recorder()
    await make_channel(handler)
    for text in ("one", "two"):
        await fake_slack.wait_acked(await fake_slack.push_event(dm(text, user="U7", channel="D7")))
    assert [i.user_name for i in handler.inbounds] == ["ada", "ada"]
    assert len(fake_slack.method_calls("users.info")) == 1  # cached


async def test_stop_is_clean_and_not_ready(fake_slack: FakeSlack, make_channel: MakeChannel) -> None:
    channel = await make_channel(Recorder())
    assert channel.is_ready()
    await channel.stop()
    assert not channel.is_ready()
    await fake_slack.wait_for(lambda: fake_slack.open_sockets == 0)
    await channel.stop()  # idempotent


async def test_socket_reconnects_after_a_drop(fake_slack: FakeSlack, make_channel: MakeChannel) -> None:
    handler = Recorder()
    channel = await make_channel(handler)
    await fake_slack.drop_sockets()
    await fake_slack.wait_for(lambda: fake_slack.sockets_opened == 2 and fake_slack.open_sockets == 1)
    await fake_slack.wait_acked(await fake_slack.push_event(dm("after the drop")))
    assert [i.text for i in handler.inbounds] == ["after the drop"]
    assert channel.is_ready()


async def test_bad_token_fails_start(fake_slack: FakeSlack, tmp_path: Path) -> None:
    cfg = SlackConfig(enabled=True, bot_token="xoxb-wrong", app_token=APP_TOKEN, base_url=fake_slack.base_url)
    channel = SlackChannel(cfg, Recorder(), workspace_for=lambda inbound: tmp_path)
    with pytest.raises(RuntimeError, match="invalid_auth"):
        await channel.start()
    assert not channel.is_ready()


# ---------------------------------------------------------------------------- HTTP mode


@pytest.fixture
async def http_channel(make_channel: MakeChannel) -> AsyncIterator[tuple[SlackChannel, Recorder, str]]:
    handler = Recorder(lambda inbound: "over http")
    channel = await make_channel(handler, mode="http")
    app = web.Application()
    app.router.add_post(channel.webhook_path, channel.handle_webhook)
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield channel, handler, f"http://127.0.0.1:{port}{channel.webhook_path}"
    finally:
        await runner.cleanup()


async def _post(url: str, request: tuple[bytes, dict[str, str]]) -> tuple[int, str]:
    body, headers = request
    async with aiohttp.ClientSession() as session, session.post(url, data=body, headers=headers) as resp:
        return resp.status, await resp.text()


async def test_http_valid_signature_is_accepted(
    fake_slack: FakeSlack, http_channel: tuple[SlackChannel, Recorder, str]
) -> None:
    channel, handler, url = http_channel
    assert channel.is_ready()
    event = mention("via http")
    status, _ = await _post(url, signed_event_request(SIGNING_SECRET, event_callback(event)))
    assert status == 200
    assert [i.text for i in handler.inbounds] == ["via http"]  # before the 200 went out
    [post] = fake_slack.posted
    # Answered in a thread under the mention (reply_to_mode "thread", the default).
    assert post["channel"] == "C1" and post["thread_ts"] == event["ts"]

    # Slack's retry of the same delivery maps to the same event id.
    retry = signed_event_request(SIGNING_SECRET, event_callback(event), retry_num=1)
    assert (await _post(url, retry))[0] == 200
    assert handler.inbounds[1].event_id == handler.inbounds[0].event_id


async def test_http_handler_failure_is_retried(
    fake_slack: FakeSlack, http_channel: tuple[SlackChannel, Recorder, str]
) -> None:
    _, handler, url = http_channel
    handler.failures = 1
    body = event_callback(dm("flaky"))
    assert (await _post(url, signed_event_request(SIGNING_SECRET, body)))[0] == 500
    assert (await _post(url, signed_event_request(SIGNING_SECRET, body, retry_num=1)))[0] == 200
    assert [p["text"] for p in fake_slack.posted] == ["over http"]


async def test_http_forged_and_stale_signatures_are_refused(
    http_channel: tuple[SlackChannel, Recorder, str]
) -> None:
    _, handler, url = http_channel
    body = event_callback(mention("evil"))
    assert (await _post(url, signed_event_request(SIGNING_SECRET, body, forge=True)))[0] == 401
    stale = int(time.time()) - 6 * 60
    assert (await _post(url, signed_event_request(SIGNING_SECRET, body, timestamp=stale)))[0] == 401
    unsigned = (b"{}", {"Content-Type": "application/json"})
    assert (await _post(url, unsigned))[0] == 401
    assert handler.inbounds == []


async def test_http_url_verification(http_channel: tuple[SlackChannel, Recorder, str]) -> None:
    _, _, url = http_channel
    body = {"token": "t", "challenge": "3eZbrw1aBm2rZgRNFdxV2595E9CY3gmdALWMmHkvFXO7tYXAYM8P",
            "type": "url_verification"}
    status, text = await _post(url, signed_event_request(SIGNING_SECRET, body))
    assert status == 200 and "3eZbrw1aBm2rZgRNFdxV2595E9CY3gmdALWMmHkvFXO7tYXAYM8P" in text
    assert (await _post(url, signed_event_request(SIGNING_SECRET, body, forge=True)))[0] == 401


async def test_http_slash_command(
    fake_slack: FakeSlack, http_channel: tuple[SlackChannel, Recorder, str]
) -> None:
    _, handler, url = http_channel
    fields = {
        "command": "/help", "text": "", "user_id": "U2", "channel_id": "D2", "team_id": "T1",
        "trigger_id": "trig.1", "response_url": f"{fake_slack.root_url}/response/h1",
    }
    status, _ = await _post(url, signed_command_request(SIGNING_SECRET, fields))
    assert status == 200
    [inbound] = await handler.wait(1)
    assert inbound.text == "/help" and session_key(inbound) == "slack:dm:D2"
    await fake_slack.wait_for(lambda: fake_slack.responses)
    assert fake_slack.responses[0]["text"] == "over http"


# ---------------------------------------------------------------------------- junk never raises

_json_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=40),
    st.sampled_from(["U1", "D1", "C1", BOT_USER_ID, "1712.1", "im", "channel", "file_share",
                     "\ud800", "<@UBOT>", "../../etc/passwd", ""]),
)
_json = st.recursive(
    _json_leaf, lambda children: st.one_of(st.lists(children, max_size=4),
                                           st.dictionaries(st.text(max_size=10), children, max_size=4)),
    max_leaves=12,
)
_event_keys = st.sampled_from(
    ["type", "subtype", "user", "channel", "ts", "thread_ts", "text", "channel_type", "files",
     "bot_id", "parent_user_id", "user_profile"]
)
junk_events = st.dictionaries(_event_keys, _json, max_size=10).map(
    lambda d: {**d, "type": d.get("type") if isinstance(d.get("type"), str) else "message"}
)


@settings(max_examples=100, deadline=None)
@given(event=st.one_of(_json, junk_events))
def test_parse_event_never_raises(event: Any) -> None:
    parsed = parse_event(event, bot_user_id=BOT_USER_ID, bot_id="BBOT")
    if parsed is not None:
        inbound = parsed.inbound
        assert inbound.event_id == f"{inbound.chat_id}:{inbound.message_id}"
        inbound.text.encode("utf-8")  # no lone surrogates reach the database
        assert "\x00" not in inbound.text
        session_key(inbound)
        reply_thread(inbound)


@settings(max_examples=60, deadline=None)
@given(payload=st.one_of(_json, st.dictionaries(
    st.sampled_from(["command", "text", "user_id", "channel_id", "trigger_id", "response_url"]), _json)))
def test_parse_command_never_raises(payload: Any) -> None:
    inbound = parse_command(payload)
    if inbound is not None:
        assert inbound.text.startswith("/")


@given(body=st.binary(max_size=200), timestamp=st.one_of(st.none(), st.text(max_size=12)),
       signature=st.one_of(st.none(), st.text(max_size=80)))
def test_verify_signature_never_raises(body: bytes, timestamp: str | None, signature: str | None) -> None:
    assert verify_signature(SIGNING_SECRET, body, timestamp, signature, now=time.time()) in (True, False)


@pytest.fixture
async def junk_channel(fake_slack: FakeSlack, make_channel: MakeChannel) -> tuple[FakeSlack, Recorder]:
    handler = Recorder()
    await make_channel(handler)
    return fake_slack, handler


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(event=junk_events)
async def test_running_adapter_survives_junk(junk_channel: tuple[FakeSlack, Recorder], event: Any) -> None:
    fake, handler = junk_channel
    # Acknowledged means our listener returned normally (an exception leaves it unacked).
    await fake.wait_acked(await fake.push_event(event))
    probe = dm("still alive")
    before = len(handler.inbounds)
    await fake.wait_acked(await fake.push_event(probe))
    assert handler.inbounds[before:][-1].event_id == f"D1:{probe['ts']}"


# ---------------------------------------------------------------------------- formatting


def test_split_message_small_and_empty() -> None:
    assert split_message("hi") == ["hi"]
    assert split_message("\n\n") == []


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(list("ab &<>`\n")) | st.characters(), max_size=3000),
       limit=st.integers(min_value=40, max_value=400))
def test_split_message_properties(text: str, limit: int) -> None:
    chunks = split_message(text, limit)
    assert all(0 < len(c) <= limit for c in chunks)

    def squash(s: str) -> str:
        return re.sub(r"\s+", "", s.replace("```", ""))

    assert squash("".join(chunks)) == squash(text)


def test_split_message_keeps_fences_balanced_and_entities_whole() -> None:
    code = "```\n" + "\n".join(f"x{k} = {k}" for k in range(400)) + "\n```"
    chunks = split_message(code, 500)
    assert len(chunks) > 3
    assert all(c.startswith("```") and c.endswith("```") for c in chunks)
    line = " ".join(["a&amp;b", "<https://example.com|link>"] * 300)
    for chunk in split_message(line, 200):
        assert chunk.count("<") == chunk.count(">")
        assert re.sub(r"&amp;", "", chunk).count("&") == 0


def test_markdown_and_slack_markup() -> None:
    assert to_mrkdwn("**b** and [x](https://e.com) & <t>") == "*b* and <https://e.com|x> &amp; &lt;t&gt;"
    raw = f"<@{BOT_USER_ID}|gw> ask <@U2> in <#C9|general> about <https://e.com|this> &amp; <!here>"
    text, mentioned = slack_to_text(raw, BOT_USER_ID)
    assert mentioned
    assert text == "ask @U2 in #general about this (https://e.com) & @here"
